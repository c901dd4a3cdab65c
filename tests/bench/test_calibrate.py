"""``litellm-flm calibrate`` (flm_bench.calibrate) on SmolLM2 at tiny settings: the
acceptance records are right where they are known exactly (a proposer replaying the greedy output
is always accepted; a random draft almost never), the decision per bucket (draft length and
confidence gate) follows from the measured costs and the records, and the command writes a table
the engine then reads (``decoders.load_policy``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_files import draft_config_dict, random_draft_weights, write_draft_dir  # tests/models, on sys.path

from flm_runtime import api, paths, registry
from flm_runtime.speculation import decoders
from flm_bench import calibrate
from flm_runtime.models.dflash import DFlashDraft
from flm_runtime.request import SamplingParams
from flm_runtime.speculation.policy import PolicyTable
from flm_runtime.speculation.speculative import DraftStandIn, SpeculativeDecoder

PROMPT = ("Explain in simple terms why the sky looks blue during the day.",)


@pytest.fixture(scope="module")
def draft(random_draft, smollm2_model):
    return DFlashDraft.load(random_draft, smollm2_model)


@pytest.fixture(scope="module")
def draft16(tmp_path_factory, smollm2_model):
    """A 1-layer random draft of block size 16 (the public DFlash drafts'): K up to 15."""
    cfg = draft_config_dict(smollm2_model.config, layers=1, mask_token_id=0, target_tag="smollm2:135m", block_size=16)
    return DFlashDraft.load(write_draft_dir(tmp_path_factory.mktemp("draft16"), cfg,
                                            random_draft_weights(cfg, seed=5, scale=0.05)), smollm2_model)


def replayed_greedy_output(engine, tok, drafted: int) -> tuple[list[int], DraftStandIn]:
    """``PROMPT[0]``'s ids, and a stand-in proposer that drafts the next ``drafted`` tokens of the
    engine's greedy answer to it (40 tokens; 0 past them): every drafted token is accepted."""
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT[0]}]))
    want = engine.submit(ids, SamplingParams(max_tokens=40, ignore_eos=True)).result().token_ids
    truth = dict(enumerate(want, start=len(ids)))

    def replay(draft_cache, anchor_id, start):
        return np.array([truth.get(p, 0) for p in range(start + 1, start + 1 + drafted)])

    return ids, replay


def test_a_replayed_greedy_output_is_always_accepted(smollm2_model, smollm2_tokenizer, smollm2_engine, draft):
    tok = smollm2_tokenizer
    ids, replay = replayed_greedy_output(smollm2_engine, tok, 7)
    perfect = calibrate.acceptance_records(SpeculativeDecoder(smollm2_model, draft, proposer=replay), tok, [ids], 32)
    # 1 token from prefill, then whole steps of 8 while 32 tokens are not reached: 3 (the 4th is cut).
    assert perfect.accepted.tolist() == [7, 7, 7] and (perfect.confidence == 1.0).all()
    np.testing.assert_array_equal(perfect.at_least(), np.ones(7))
    random = calibrate.acceptance_records(SpeculativeDecoder(smollm2_model, draft), tok, [ids], 16)
    at_least = random.at_least()
    assert at_least.shape == (7,) and at_least[0] < 0.5 and (np.diff(at_least) <= 0).all()
    assert random.confidence.shape == (len(random.accepted), 7) and (random.confidence < 0.5).all()


def test_calibrate_decides_each_bucket_from_its_measurements(smollm2_model, smollm2_tokenizer, draft, monkeypatch):
    # From LONG_CONTEXT on, a bucket's acceptance comes from a document filling its context.
    monkeypatch.setattr(calibrate, "LONG_CONTEXT", 100)
    recorded = []  # the acceptance records, chat (16) then document (150)
    records = calibrate.acceptance_records
    monkeypatch.setattr(calibrate, "acceptance_records", lambda *a: recorded.append(records(*a)) or recorded[-1])
    table = calibrate.calibrate(SpeculativeDecoder(smollm2_model, draft), smollm2_tokenizer, tag="t-dflash:1",
                                backend="cpu", contexts=[16, 150], rounds=1, max_new=4, spells=2, spell_gap=0.0,
                                prompts=PROMPT)
    assert [b.max_context for b in table.buckets] == [16, smollm2_model.config.max_position_embeddings]
    by_context = table.measured["by_context"]
    assert [by_context[c]["acceptance_prompts"] for c in ("16", "150")] == ["chat", "document"]
    assert [len(by_context[c]["step_costs"]) for c in ("16", "150")] == [2, 2]  # one per spell
    assert "--spells 2 --spell-gap 0" in table.measured["command"]
    assert (table.block_size, table.min_speedup) == (8, calibrate.MIN_SPEEDUP)

    def costs(measured: dict) -> dict:  # a step_costs dict (milliseconds: only ratios matter)
        return {"decode": measured["decode_ms"], "propose": measured["propose_ms"], "verify": measured["verify_ms"]}

    # Each bucket's decision is choose()'s on its own records and the costs at its edges (the first:
    # its own context only) in every spell.
    for bucket, edges, acceptance in zip(table.buckets, (("16",), ("16", "150")), recorded):
        want = calibrate.choose([costs(c) for e in edges for c in by_context[e]["step_costs"]], acceptance,
                                bucket.max_context)
        assert (bucket.speculate, bucket.draft_length, bucket.min_confidence) == (
            want.speculate, want.draft_length, want.min_confidence)
        assert bucket.expected_al == want.expected_al and bucket.cost_ratio == pytest.approx(want.cost_ratio, rel=1e-3)
        assert bucket.verify_ratio == pytest.approx(want.verify_ratio, rel=1e-3) and len(bucket.verify_ratio) == 7
    for ctx, acceptance in zip(("16", "150"), recorded):
        assert by_context[ctx]["acceptance_at_least"] == [round(float(p), 4) for p in acceptance.at_least()]
        assert by_context[ctx]["acceptance_steps"] == len(acceptance.accepted)
    with pytest.raises(ValueError, match="contexts must ascend"):
        calibrate.calibrate(SpeculativeDecoder(smollm2_model, draft), smollm2_tokenizer, tag="t", backend="cpu",
                            contexts=[64, 16], rounds=1, max_new=16, prompts=PROMPT)


def test_calibrate_handles_a_draft_of_block_size_16(smollm2_model, smollm2_tokenizer, smollm2_engine, draft16,
                                                    monkeypatch):
    """Whole steps of 15 drafted tokens: a replayed greedy output keeps all 15 (and the bonus) in
    each; the table's grid of K runs to 15, its step costs and verify ratios have 15 values, and
    each bucket is choose()'s decision on them."""
    tok = smollm2_tokenizer
    ids, replay = replayed_greedy_output(smollm2_engine, tok, 15)
    perfect = calibrate.acceptance_records(SpeculativeDecoder(smollm2_model, draft16, proposer=replay), tok, [ids], 40)
    # 1 token from prefill, then whole steps of 16 while 40 tokens are not reached: 2 (the 3rd is cut).
    assert perfect.accepted.tolist() == [15, 15] and perfect.confidence.shape == (2, 15)
    np.testing.assert_array_equal(perfect.at_least(), np.ones(15))
    recorded = []
    records = calibrate.acceptance_records
    monkeypatch.setattr(calibrate, "acceptance_records", lambda *a: recorded.append(records(*a)) or recorded[-1])
    table = calibrate.calibrate(SpeculativeDecoder(smollm2_model, draft16), tok, tag="t-dflash:1", backend="cpu",
                                contexts=[16], rounds=1, max_new=4, prompts=PROMPT)
    (bucket,) = table.buckets
    (measured,) = table.measured["by_context"]["16"]["step_costs"]
    assert table.block_size == 16 and len(measured["propose_ms"]) == len(measured["verify_ms"]) == 15
    assert len(bucket.verify_ratio) == 15 and 1 <= bucket.draft_length <= 15
    costs = {"decode": measured["decode_ms"], "propose": measured["propose_ms"], "verify": measured["verify_ms"]}
    (acceptance,) = recorded
    assert acceptance.confidence.shape[1] == 15
    want_bucket = calibrate.choose([costs], acceptance, bucket.max_context)
    assert (bucket.draft_length, bucket.min_confidence, bucket.expected_al) == (
        want_bucket.draft_length, want_bucket.min_confidence, want_bucket.expected_al)


def records(accepted: list[int], confidence: list[list[float]] | None = None) -> calibrate.Acceptance:
    """Acceptance records of whole steps of 7 (confidence 1 unless given)."""
    confidence = np.ones((len(accepted), 7)) if confidence is None else np.array(confidence)
    return calibrate.Acceptance(confidence.astype(np.float32), np.array(accepted))


PROFILE = records([2, 1, 1, 1, 0, 0, 0, 0, 0, 0])  # P(a >= 1) 0.4, P(a >= 2) 0.1: AL 1.4 at K = 1, 1.5 from 2 on


def test_a_bucket_speculates_only_where_it_pays_at_both_edges():
    cheap = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.0] * 7}  # cost ratio 1.1 at every K
    dear = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.5] * 7}  # 1.6
    alone = calibrate.choose([cheap], PROFILE, 256)
    assert (alone.speculate, alone.draft_length, alone.min_confidence, alone.expected_al, alone.cost_ratio) == (
        True, 2, 0.0, 1.5, 1.1)
    both = calibrate.choose([dear, cheap], PROFILE, 1024)  # dear at the lower edge: 1.5 / 1.6 < 1
    assert (both.speculate, both.draft_length, both.cost_ratio) == (False, 2, 1.6)
    # the verify ratios, per verified length, the largest over the edges
    rising = {"decode": 2.0, "propose": [0.1] * 7, "verify": [2.0 + 0.5 * n for n in range(1, 8)]}  # 1.25 .. 2.75
    assert alone.verify_ratio == [1.0] * 7 and both.verify_ratio == [1.5] * 7
    assert calibrate.choose([rising, dear], PROFILE, 4096).verify_ratio == [1.5, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75]


def test_a_bucket_speculates_only_past_the_margin():
    step = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.3] * 7}  # cost ratio 1.4: expects 1.07x
    assert calibrate.choose([step], PROFILE, 256, min_speedup=1.0).speculate
    assert not calibrate.choose([step], PROFILE, 256).speculate  # MIN_SPEEDUP 1.1
    assert calibrate.MIN_SPEEDUP == 1.1


def test_the_gate_is_chosen_where_it_skips_the_verify_of_guesses():
    # Five sure steps (confidence 0.9) that keep 3, five guesses (0.05) that keep nothing; verifying
    # k tokens costs 1.1 + 0.05 k decodes, the draft 0.1.
    acceptance = records([3] * 5 + [0] * 5, [[0.9] * 7] * 5 + [[0.05] * 7] * 5)
    step = {"decode": 1.0, "propose": [0.1] * 7, "verify": [1.1 + 0.05 * k for k in range(1, 8)]}
    assert acceptance.tokens_and_cost(3, 0.0, step) == pytest.approx((2.5, 1.35))  # every step verifies 3: 0.1 + 1.25
    # gate 0.1: the guesses decode plainly (0.1 + 1 decodes): (5 x 1.35 + 5 x 1.1) / 10
    assert acceptance.tokens_and_cost(3, 0.1, step) == pytest.approx((2.5, 1.225))
    bucket = calibrate.choose([step], acceptance, 256)
    assert (bucket.speculate, bucket.draft_length, bucket.min_confidence) == (True, 3, 0.1)
    assert (bucket.expected_al, bucket.cost_ratio) == (2.5, 1.225)


def test_the_command_writes_the_table_the_engine_reads(run_cli, random_draft, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "config_dir", lambda: tmp_path / "config")
    models = tmp_path / "models.yaml"
    models.write_text(json.dumps({"smollm2-rnd-dflash:135m": {"base": "smollm2:135m", "draft": str(random_draft)}}))
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    registry.reload()
    try:
        status, out, _ = run_cli("calibrate", "--tag", "smollm2-rnd-dflash:135m", "--backend", "cpu",
                                 "--contexts", "32", "--rounds", "1", "--max-new", "3")
        assert status == 0 and "| contexts up to | speculate |" in out
        written = tmp_path / "config" / "policy" / "smollm2-rnd-dflash" / "135m-cpu.json"
        assert f"wrote {written}" in out
        table = PolicyTable.load(written)
        assert decoders.load_policy("smollm2-rnd-dflash:135m", "cpu") == table
        assert api.default_runtime.forget("smollm2-rnd-dflash:135m")  # an engine reads its table when it starts
        assert api.get_engine("smollm2-rnd-dflash:135m", "cpu").speculative.policy == table
    finally:
        api.default_runtime.forget("smollm2-rnd-dflash:135m")


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
