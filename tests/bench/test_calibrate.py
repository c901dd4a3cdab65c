"""``litellm-flm calibrate`` (flm_runtime.bench.calibrate) on SmolLM2 at tiny settings: the
acceptance profile is right where it is known exactly (a proposer replaying the greedy output is
always accepted; a random draft almost never), the decision per bucket follows from the measured
costs and the profile, and the command writes a table the engine then reads (``api.load_policy``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flm_runtime import api, paths
from flm_runtime.bench import calibrate
from flm_runtime.engine.policy import PolicyTable
from flm_runtime.engine.request import SamplingParams
from flm_runtime.engine.speculative import SpeculativeDecoder
from flm_runtime.models.dflash import DFlashDraft

PROMPT = ("Explain in simple terms why the sky looks blue during the day.",)


@pytest.fixture(scope="module")
def draft(random_draft, smollm2_model):
    return DFlashDraft.load(random_draft, smollm2_model)


def test_a_replayed_greedy_output_is_always_accepted(smollm2_model, smollm2_tokenizer, smollm2_engine, draft):
    tok = smollm2_tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT[0]}]))
    want = smollm2_engine.submit(ids, SamplingParams(max_tokens=40, ignore_eos=True)).result().token_ids
    truth = dict(enumerate(want, start=len(ids)))

    def replay(draft_cache, anchor_id, start):
        return np.array([truth.get(p, 0) for p in range(start + 1, start + 8)])

    perfect = SpeculativeDecoder(smollm2_model, draft, proposer=replay)
    np.testing.assert_array_equal(calibrate.acceptance_profile(perfect, tok, [ids], 32), np.ones(7))
    random = calibrate.acceptance_profile(SpeculativeDecoder(smollm2_model, draft), tok, [ids], 16)
    assert random.shape == (7,) and random[0] < 0.5 and (np.diff(random) <= 0).all()


def test_calibrate_decides_each_bucket_from_its_measurements(smollm2_model, smollm2_tokenizer, draft, monkeypatch):
    # From LONG_CONTEXT on, a bucket's acceptance comes from a document filling its context.
    monkeypatch.setattr(calibrate, "LONG_CONTEXT", 100)
    table = calibrate.calibrate(SpeculativeDecoder(smollm2_model, draft), smollm2_tokenizer, tag="t-dflash:1",
                                backend="cpu", contexts=[16, 150], rounds=1, max_new=16, spells=2, spell_gap=0.0,
                                prompts=PROMPT)
    assert [b.max_context for b in table.buckets] == [16, smollm2_model.config.max_position_embeddings]
    by_context = table.measured["by_context"]
    assert [by_context[c]["acceptance_prompts"] for c in ("16", "150")] == ["chat", "document"]
    assert [len(by_context[c]["step_costs"]) for c in ("16", "150")] == [2, 2]  # one per spell
    assert "--spells 2 --spell-gap 0" in table.measured["command"]

    def ratio(costs: dict, k: int) -> float:
        return (costs["propose_ms"][k - 1] + costs["verify_ms"][k - 1]) / costs["decode_ms"]

    # Each bucket's cost ratio is the largest at its edges (the first: its own context only) in any spell.
    for bucket, edges, ctx in zip(table.buckets, (("16",), ("16", "150")), ("16", "150")):
        profile = np.array(by_context[ctx]["acceptance_at_least"])
        assert profile.shape == (7,) and (np.diff(profile) <= 0).all()
        speedups = [(1 + profile[:k].sum()) / max(ratio(c, k) for e in edges for c in by_context[e]["step_costs"])
                    for k in range(1, 8)]
        k = int(np.argmax(speedups)) + 1
        assert bucket.draft_length == k and bucket.expected_al == pytest.approx(1 + profile[:k].sum(), abs=1e-4)
        assert bucket.speculate == (speedups[k - 1] > 1.0)
        assert bucket.expected_speedup == pytest.approx(speedups[k - 1], rel=1e-2)
    with pytest.raises(ValueError, match="contexts must ascend"):
        calibrate.calibrate(SpeculativeDecoder(smollm2_model, draft), smollm2_tokenizer, tag="t", backend="cpu",
                            contexts=[64, 16], rounds=1, max_new=16, prompts=PROMPT)


def test_a_bucket_speculates_only_where_it_pays_at_both_edges():
    profile = np.array([0.4, 0.1, 0, 0, 0, 0, 0])  # AL 1.4 at K = 1, 1.5 from K = 2 on
    cheap = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.0] * 7}  # cost ratio 1.1 at every K
    dear = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.5] * 7}  # 1.6
    alone = calibrate.choose([cheap], profile, 256)
    assert (alone.speculate, alone.draft_length, alone.expected_al, alone.cost_ratio) == (True, 2, 1.5, 1.1)
    both = calibrate.choose([dear, cheap], profile, 1024)  # dear at the lower edge: 1.5 / 1.6 < 1
    assert (both.speculate, both.draft_length, both.cost_ratio) == (False, 2, 1.6)


def test_a_bucket_speculates_only_past_the_margin():
    profile = np.array([0.4, 0.1, 0, 0, 0, 0, 0])  # AL 1.5 from K = 2 on
    step = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.3] * 7}  # cost ratio 1.4: expects 1.07x
    assert calibrate.choose([step], profile, 256, min_speedup=1.0).speculate
    assert not calibrate.choose([step], profile, 256).speculate  # MIN_SPEEDUP 1.1
    assert calibrate.MIN_SPEEDUP == 1.1


def test_the_command_writes_the_table_the_engine_reads(run_cli, random_draft, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path / "config")
    models = tmp_path / "models.yaml"
    models.write_text(json.dumps({"smollm2-rnd-dflash:135m": {"base": "smollm2:135m", "draft": str(random_draft)}}))
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    try:
        status, out, _ = run_cli("calibrate", "--tag", "smollm2-rnd-dflash:135m", "--backend", "cpu",
                                 "--contexts", "32", "--rounds", "1", "--max-new", "12")
        assert status == 0 and "| contexts up to | speculate |" in out
        written = tmp_path / "config" / "policy" / "smollm2-rnd-dflash" / "135m-cpu.json"
        assert f"wrote {written}" in out
        table = PolicyTable.load(written)
        assert api.load_policy("smollm2-rnd-dflash:135m", "cpu") == table
        api._engines.pop("smollm2-rnd-dflash:135m").close()  # an engine reads its table when it starts
        assert api.get_engine("smollm2-rnd-dflash:135m", "cpu").speculative.policy == table
    finally:
        engine = api._engines.pop("smollm2-rnd-dflash:135m", None)
        if engine is not None:
            engine.close()


@pytest.mark.parametrize(("argv", "message"), [
    (["--contexts", "abc"], "argument --contexts: not an integer: 'abc'"),
    (["--contexts", "256,0"], "argument --contexts: must be at least 1, got 0"),
    (["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["--spells", "0"], "argument --spells: must be at least 1, got 0"),
    (["--spell-gap", "-5"], "argument --spell-gap: must be at least 0 seconds, got -5"),
    (["--max-new", "-3"], "argument --max-new: must be at least 1, got -3"),
    (["--min-speedup", "0.9"], "argument --min-speedup: must be at least 1 (a speed-up), got 0.9"),
    (["--min-speedup", "fast"], "argument --min-speedup: not a number: 'fast'"),
])
def test_calibrate_refuses_bad_arguments_by_name(argv, message, capsys):
    from flm_runtime import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["calibrate", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
