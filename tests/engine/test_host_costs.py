"""This host's costs (``speculation.costs``) in the policy: the table's ratios rescaled to the
host's curve, a cheap host verifying longer proposals than an expensive one, the curves measured
once per host (exact ratios from a target and a draft whose passes take known times) and kept, a
DFlash engine whose shipped table takes the curve while a calibrated one does not, the first-run
estimate of a tag without a table (``speculation.estimate``): the draft length of the most
expected tokens per unit of cost under the prior, exactly, for blocks of 8 and 16; and a tag
without a draft, which speculates on this host's verify curve alone, unless ``FLM_HOST_COSTS`` or
``FLM_SPECULATION`` say no."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from flm_runtime import api, paths
from flm_runtime.settings import Settings
from flm_runtime.speculation import costs, decoders, estimate
from flm_runtime.speculation.policy import Bucket, PolicyTable

DFLASH_TAG = "smollm2-dflash:135m"
# The shipped table's first bucket on the host that calibrated it: 8 rows at about 3 decodes.
EXPENSIVE = [1.2204, 1.605, 1.7904, 2.1886, 2.5317, 2.9107, 2.9811]
CHEAP = [1.05, 1.08, 1.11, 1.14, 1.17, 1.2, 1.23]
PROPOSE = [0.25] * 15  # t_propose(n) / t_decode, n = 1 .. 15


def table(*ratios: list[float], block_size: int = 8) -> PolicyTable:
    buckets = [Bucket(max_context=256 * 4**i, speculate=False, verify_ratio=r) for i, r in enumerate(ratios)]
    return PolicyTable(model=DFLASH_TAG, backend="cpu", buckets=buckets, block_size=block_size)


def test_on_host_takes_the_hosts_level_and_keeps_the_tables_profile():
    shipped = table([1.2, 1.6, 2.0], [1.4, 1.8, 2.4], block_size=4)
    host = shipped.on_host([1.1, 1.2, 1.3], context=200)  # measured in the first bucket
    assert [b.verify_ratio for b in host.buckets] == [[1.1, 1.2, 1.3], [1.2833, 1.35, 1.56]]
    assert host.measured["host_verify_ratio"] == {"context": 200, "verify_ratio": [1.1, 1.2, 1.3]}
    assert shipped.buckets[1].verify_ratio == [1.4, 1.8, 2.4]  # the table itself is left alone
    assert shipped.on_host([1.1, 1.2], context=200) is shipped  # another block size: not this draft's
    no_ratios = PolicyTable(model=DFLASH_TAG, backend="cpu", buckets=[Bucket(max_context=256, speculate=False)])
    assert no_ratios.on_host([1.1, 1.2, 1.3], context=200) is no_ratios


def test_a_cheap_host_verifies_long_proposals_and_an_expensive_one_short():
    """A proposal whose tokens are each 0.8 likely: 1 + E(n) = 1.8, 2.44, 2.95, 3.36, 3.69, 3.95,
    4.16 tokens for n = 1..7. At the expensive host's costs the best speed-up is n = 3 (2.95 / 1.79 =
    1.65); at the cheap host's it is n = 7 (4.16 / 1.23 = 3.38)."""
    shipped = table(EXPENSIVE)
    confidence = np.full(7, 0.8, dtype=np.float32)
    expensive = shipped.lookup_step(100, confidence)
    cheap = shipped.on_host(CHEAP, context=256).lookup_step(100, confidence)
    assert expensive.length == 3 and expensive.speedup == pytest.approx(2.952 / 1.7904)
    assert cheap.length == 7 and cheap.speedup == pytest.approx((1 + 4 * (1 - 0.8**7)) / 1.23)


class Cache:
    def __init__(self):
        self.length = 0

    def trim(self, length):
        assert length <= self.length
        self.length = length


class TimedTarget:
    """A target whose pass of ``n`` rows takes ``1 + 0.25 * (n - 1)`` units of ``clock``."""

    def __init__(self, clock):
        self.config = SimpleNamespace(vocab_size=50, max_position_embeddings=300, hidden_size=4)
        self.clock, self.passes = clock, []

    def new_cache(self, capacity):
        return Cache()

    def forward_batch(self, rows, caches, *, taps=(), logit_rows=None):
        (ids,), (cache,) = rows, caches
        self.passes.append((len(ids), cache.length, taps, logit_rows))
        self.clock.now += 1 + 0.25 * (len(ids) - 1)
        cache.length += len(ids)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_measure_gives_each_pass_over_the_one_row_pass(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    target = TimedTarget(clock)
    assert costs.measure_verify_ratio(target, (1, 3), 3, context=20, rounds=2) == [1.25, 1.5, 1.75]
    prefill, *timed = target.passes
    assert prefill == (20, 0, (), [1])
    # 3 rounds (the first a warm-up) of 1, 2, 3, 4 rows, each on a cache rolled back to 20 positions;
    # verify passes ask every row's logits and the draft's taps, the decode pass the last row's.
    assert timed == [(1, 20, (), [1]), (2, 20, (1, 3), [2]), (3, 20, (1, 3), [3]), (4, 20, (1, 3), [4])] * 3
    with pytest.raises(ValueError, match="do not fit 300 positions"):
        costs.measure_verify_ratio(target, (), 7, context=293)


class TimedDraft:
    """A draft whose proposal of ``n`` tokens takes ``0.2 + 0.1 * n`` units of ``clock`` (taking
    taps into its cache none)."""

    def __init__(self, clock):
        self.config = SimpleNamespace(target_layer_ids=[1, 3], block_size=8)
        self.clock, self.calls = clock, []

    def new_cache(self, capacity):
        return Cache()

    def add_context(self, cache, taps, start):
        assert cache.length == start and taps.shape[1] == 2 * 4  # two taps of the target's width
        self.calls.append(("context", len(taps), start))
        cache.length += len(taps)

    def draft_blocks(self, caches, anchor_ids, n):
        (cache,) = caches
        self.calls.append(("draft", cache.length, n))
        self.clock.now += 0.2 + 0.1 * n


def test_measure_gives_each_proposal_over_the_one_row_pass(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    target, draft = TimedTarget(clock), TimedDraft(clock)
    assert costs.measure_propose_ratio(target, draft, 3, context=20, rounds=2) == [0.3, 0.4, 0.5]
    prefill, *timed = target.passes
    assert prefill == (20, 0, (), [1]) and timed == [(1, 20, (), [1])] * 4 * 3  # before each proposal too
    # the draft's context of 20 positions, then per round a proposal of 1, 2, 3 after one position's taps
    assert draft.calls == [("context", 20, 0)] + [("context", 1, 20), ("draft", 21, 1), ("context", 1, 20),
                                                  ("draft", 21, 2), ("context", 1, 20), ("draft", 21, 3)] * 3
    with pytest.raises(ValueError, match="do not fit 300 positions"):
        costs.measure_propose_ratio(target, draft, 15, context=285)


def draft_of(block_size: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(target_layer_ids=[1], block_size=block_size))


def test_the_curve_is_measured_once_per_host_and_kept(tmp_path, monkeypatch, capsys):
    measured = []
    monkeypatch.setattr(costs, "measure_verify_ratio",
                        lambda target, taps, drafted, context: measured.append(context) or CHEAP[:drafted])
    monkeypatch.setattr(costs, "measure_propose_ratio", lambda target, draft, drafted, context: PROPOSE[:drafted])
    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    path = tmp_path / "policy" / "smollm2-dflash" / "135m-cpu-host.json"

    def curve():
        return costs.host_costs(path, target, draft_of(8), model=DFLASH_TAG, backend="cpu")
    first = curve()
    assert (first.verify_ratio, first.propose_ratio, first.context, first.host, measured) == (
        CHEAP, PROPOSE[:7], 256, costs.host_id(), [256])
    # seconds in the first request's time: said as it starts, and not when the curve is kept
    assert capsys.readouterr().err == (f"litellm-flm: timing this host's verify and draft passes for {DFLASH_TAG} "
                                       f"once, seconds (kept in {path}; FLM_HOST_COSTS=0 skips it)\n")
    assert json.loads(path.read_text())["verify_ratio"] == CHEAP and list(path.parent.iterdir()) == [path]
    assert curve() == first and measured == [256] and capsys.readouterr().err == ""  # kept: not measured again
    path.write_text(first.model_copy(update={"host": "another machine"}).model_dump_json())
    assert curve().host == costs.host_id() and measured == [256, 256]  # another host's: measured here
    path.write_text(first.model_copy(update={"kernels": "other code"}).model_dump_json())
    assert curve().kernels == costs.kernels_digest() and len(measured) == 3  # other kernels' curve: measured again
    path.write_text("{not json")
    assert curve().verify_ratio == CHEAP and len(measured) == 4  # a broken file: measured again
    assert costs.host_costs(path, target, draft_of(4), model=DFLASH_TAG, backend="cpu").verify_ratio == CHEAP[:3]
    old = json.loads(path.read_text())
    del old["propose_ratio"]  # a file written before the draft's costs were measured
    path.write_text(json.dumps(old))
    assert curve().propose_ratio == PROPOSE[:7] and len(measured) == 6


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_dflash_engine_takes_this_hosts_costs_unless_calibrated_here(tmp_path, monkeypatch, calibrated):
    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure_verify_ratio", lambda target, taps, drafted, context: CHEAP[:drafted])
    monkeypatch.setattr(costs, "measure_propose_ratio", lambda target, draft, drafted, context: PROPOSE[:drafted])
    shipped = decoders.load_policy(DFLASH_TAG, "cpu")
    if calibrated:
        user = shipped.model_copy(update={"min_speedup": 1.5})
        user.save(paths.policy_file(DFLASH_TAG, "cpu"))
    for switch, expected in (("0", None), ("1", CHEAP)):
        runtime = api.Runtime(Settings(host_costs=switch))
        try:
            policy = runtime.get_engine(DFLASH_TAG, "cpu").speculative.policy
        finally:
            runtime.close()
        if calibrated:
            assert policy == user
        elif expected is None:
            assert policy == shipped and not paths.host_costs_file(DFLASH_TAG, "cpu").exists()
        else:
            assert policy == shipped.on_host(CHEAP, 256)
            assert policy.buckets[0].verify_ratio != shipped.buckets[0].verify_ratio
    assert paths.host_costs_file(DFLASH_TAG, "cpu").exists() is not calibrated


def host(verify_at_8_rows: float, drafted: int = 15, propose: float = 0.25) -> costs.HostCosts:
    """Curves rising evenly from 1 decode for one row to ``verify_at_8_rows`` for 8, and on to
    ``drafted + 1`` rows, with proposals of ``propose`` decodes."""
    slope = (verify_at_8_rows - 1) / 7
    return costs.HostCosts(host="h", model="x-dflash:1", backend="cpu", context=256, date="2026-12-05",
                           verify_ratio=[round(1 + slope * n, 4) for n in range(1, drafted + 1)],
                           propose_ratio=[propose] * drafted)


@pytest.mark.parametrize("verify_at_8_rows, drafted, k", [
    (1.2, 15, 7),  # E(7) / c(7) = 3.1412 / (1.2 + 0.25) = 2.166 beats 3.0588 / 1.4214 and 3.1988 / 1.4786
    (2.9, 15, 3),  # 2.533 / (1.8143 + 0.25) = 1.227 beats 2.19 / 1.7929 = 1.2215 and 2.7731 / 2.3357 = 1.187
    (1.2, 7, 7),   # a block of 8: the whole block
    (2.9, 7, 3),
])
def test_the_estimate_drafts_long_on_a_flat_curve_and_short_on_a_steep_one(verify_at_8_rows, drafted, k):
    costs_here = host(verify_at_8_rows, drafted)
    table = estimate.first_run_table("x-dflash:1", "cpu", costs_here)
    (bucket,) = table.buckets
    tokens = 1 + sum(0.7**j for j in range(1, k + 1))  # the prior: 1 + a + .. + a^K, a = 0.7
    assert (bucket.speculate, bucket.draft_length, bucket.min_confidence) == (True, k, 0.0)
    assert bucket.expected_al == round(tokens, 4)
    assert bucket.cost_ratio == round(costs_here.verify_ratio[k - 1] + 0.25, 4)
    assert (bucket.max_context, bucket.verify_ratio, table.block_size) == (256, costs_here.verify_ratio, drafted + 1)
    assert table.measured["estimate"]["acceptance_prior"] == estimate.ACCEPTANCE_PRIOR == 0.7


def test_the_estimate_speculates_only_past_the_margin():
    # 2 rows at 2 decodes: E(1) / c(1) = 1.7 / 2.25 at best, and less further on.
    costs_here = host(8.0, 15)
    assert costs_here.verify_ratio[0] == 2.0
    bucket = estimate.first_run_table("x-dflash:1", "cpu", costs_here).buckets[0]
    assert (bucket.speculate, bucket.draft_length, bucket.expected_al, bucket.cost_ratio) == (False, 1, 1.7, 2.25)
    # a prior of 0.95 on a flat curve drafts the whole block of 16
    bucket = estimate.first_run_table("x-dflash:1", "cpu", host(1.05, 15), acceptance=0.95).buckets[0]
    assert (bucket.speculate, bucket.draft_length) == (True, 15)
    with pytest.raises(ValueError, match=r"acceptance must be in \(0, 1\), got 1.0"):
        estimate.first_run_table("x-dflash:1", "cpu", host(1.2), acceptance=1.0)


@pytest.mark.parametrize("switch", ["0", "1"])
def test_an_engine_of_a_tag_without_a_table_starts_from_the_estimate(tmp_path, monkeypatch, switch):
    """A block-16 draft added through the registry has no table: with the host's costs measured its
    engine's policy is the estimate from them; with ``FLM_HOST_COSTS=0``, whole blocks."""
    from spec_fakes import draft_config_dict, random_draft_weights, write_draft_dir

    from flm_runtime import registry
    from flm_runtime.speculation.policy import ALWAYS_SPECULATE

    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path / "config")
    flat = host(1.2, 15)
    monkeypatch.setattr(costs, "measure_verify_ratio", lambda target, taps, drafted, context: flat.verify_ratio)
    monkeypatch.setattr(costs, "measure_propose_ratio", lambda target, draft, drafted, context: flat.propose_ratio)
    runtime = api.Runtime(Settings(host_costs=switch))
    target = runtime.get_engine("smollm2:135m", "cpu").model
    cfg = draft_config_dict(target.config, layers=1, mask_token_id=0, target_tag="smollm2:135m", block_size=16)
    draft_dir = write_draft_dir(tmp_path / "draft", cfg, random_draft_weights(cfg, seed=5, scale=0.05))
    models = tmp_path / "models.yaml"
    models.write_text(json.dumps({"smollm2-k15-dflash:135m": {"base": "smollm2:135m", "draft": str(draft_dir)}}))
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    registry.reload()
    try:
        spec = runtime.get_engine("smollm2-k15-dflash:135m", "cpu").speculative
    finally:
        runtime.close()
        monkeypatch.delenv("FLM_MODELS_FILE")
        registry.reload()
    assert spec.block_size == 16
    if switch == "0":
        assert spec.policy is ALWAYS_SPECULATE
        return
    kept = costs.HostCosts.model_validate_json(paths.host_costs_file("smollm2-k15-dflash:135m", "cpu").read_text())
    assert (kept.verify_ratio, kept.propose_ratio) == (flat.verify_ratio, flat.propose_ratio)
    assert spec.policy == estimate.first_run_table("smollm2-k15-dflash:135m", "cpu", kept)
    assert (spec.policy.buckets[0].draft_length, spec.policy.block_size) == (7, 16)


@pytest.mark.parametrize("speculation, host_costs", [("1", "1"), ("1", "0"), ("0", "1")])
def test_a_tag_without_a_draft_speculates_on_this_hosts_verify_curve(tmp_path, monkeypatch, speculation, host_costs):
    """``smollm2:135m``: with the host's costs measured, its engine decodes with the proposers alone
    (no draft, no taps, prefix caching on), priced by the verify curve measured for it and kept
    (no propose costs: nothing proposes by running a model); without them, or with
    ``FLM_SPECULATION=0`` (which leaves a DFlash tag its target alone too), it decodes plainly.
    Quantized weights: batch-invariant, so the prefix cache is on."""
    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure_verify_ratio", lambda target, taps, drafted, context: CHEAP[:drafted])
    monkeypatch.setattr(costs, "measure_propose_ratio", lambda target, draft, drafted, context: PROPOSE[:drafted])
    monkeypatch.setenv("FLM_WEIGHTS", "auto")
    runtime = api.Runtime(Settings(speculation=speculation, host_costs=host_costs))
    try:
        engine = runtime.get_engine("smollm2:135m", "cpu")
        dflash = runtime.get_engine(DFLASH_TAG, "cpu").speculative if speculation == "0" else None
    finally:
        runtime.close()
    kept = paths.host_costs_file("smollm2:135m", "cpu")
    if "0" in (speculation, host_costs):
        assert engine.speculative is None and dflash is None and not kept.exists()
        return
    spec = engine.speculative
    assert (spec.draft, spec.taps, spec.block_size, engine.prefix) == (None, (), decoders.LOOKUP_BLOCK, True)
    assert [b.model_dump(exclude_defaults=True) for b in spec.policy.buckets] == [
        {"max_context": 256, "speculate": False, "verify_ratio": CHEAP}]
    assert spec.suffix is not None and spec.ngram
    curve = costs.HostCosts.model_validate_json(kept.read_text())
    assert (curve.model, curve.verify_ratio, curve.propose_ratio) == ("smollm2:135m", CHEAP, [])
