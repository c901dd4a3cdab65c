"""This host's verify costs (``speculation.costs``) in the policy: the table's ratios rescaled to the
host's curve, a cheap host verifying longer proposals than an expensive one, the curve measured
once per host (exact ratios from a target whose passes take known times) and kept, and a DFlash
engine whose shipped table takes the curve while a calibrated one does not."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from flm_runtime import api, paths
from flm_runtime.settings import Settings
from flm_runtime.speculation import costs
from flm_runtime.speculation.policy import Bucket, PolicyTable

DFLASH_TAG = "smollm2-dflash:135m"
# The shipped table's first bucket on the host that calibrated it: 8 rows at about 3 decodes.
EXPENSIVE = [1.2204, 1.605, 1.7904, 2.1886, 2.5317, 2.9107, 2.9811]
CHEAP = [1.05, 1.08, 1.11, 1.14, 1.17, 1.2, 1.23]


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
        self.config = SimpleNamespace(vocab_size=50, max_position_embeddings=300)
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


def test_the_curve_is_measured_once_per_host_and_kept(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(costs, "measure_verify_ratio",
                        lambda target, taps, drafted, context: measured.append(context) or CHEAP[:drafted])
    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    path = tmp_path / "policy" / "smollm2-dflash" / "135m-cpu-host.json"

    def curve():
        return costs.host_costs(path, target, (1,), 7, model=DFLASH_TAG, backend="cpu")
    first = curve()
    assert (first.verify_ratio, first.context, first.host, measured) == (CHEAP, 256, costs.host_id(), [256])
    assert json.loads(path.read_text())["verify_ratio"] == CHEAP and list(path.parent.iterdir()) == [path]
    assert curve() == first and measured == [256]  # kept: not measured again
    path.write_text(first.model_copy(update={"host": "another machine"}).model_dump_json())
    assert curve().host == costs.host_id() and measured == [256, 256]  # another host's: measured here
    path.write_text("{not json")
    assert curve().verify_ratio == CHEAP and len(measured) == 3  # a broken file: measured again
    assert costs.host_costs(path, target, (1,), 3, model=DFLASH_TAG, backend="cpu").verify_ratio == CHEAP[:3]


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_dflash_engine_takes_this_hosts_costs_unless_calibrated_here(tmp_path, monkeypatch, calibrated):
    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure_verify_ratio", lambda target, taps, drafted, context: CHEAP[:drafted])
    shipped = api.load_policy(DFLASH_TAG, "cpu")
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
