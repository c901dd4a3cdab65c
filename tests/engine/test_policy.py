"""The speculation policy (flm_runtime.speculation.policy): the table, the per-request acceptance
tracker step by step, the confidence gate, and the engine switching a request whose acceptance
collapses to plain decoding, or gating its drafts (exact output, exact step counts) on a scripted
target."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import FakeTokenizer
from pydantic import ValidationError
from spec_fakes import ScriptTarget, random_draft, replay_proposer

from flm_runtime.outputs import confident_length
from flm_runtime.request import SamplingParams
from flm_runtime.speculation.policy import (ALWAYS_SPECULATE, MIN_SPEEDUP, PLAIN_STEP, AcceptanceTracker, Bucket,
                                            LookupTracker, PolicyTable, paying_step)
from flm_runtime.speculation.speculative import SpeculativeDecoder

PAYS_AT_2 = Bucket(max_context=1 << 20, speculate=True, draft_length=7, cost_ratio=2.0, expected_al=3.0)


def test_tracker_switches_off_probes_with_backoff_and_resumes():
    t = AcceptanceTracker()
    # The window starts full of the prior (16 x AL 3, sum 48); each step of AL 1 takes 2 off its sum:
    # after 8 the mean is exactly the cost ratio (still speculating), the 9th switches off.
    for n in range(1, 9):
        assert t.draft_length(PAYS_AT_2) == 7
        t.record_step(PAYS_AT_2, 1)
        assert (t.al, t.plain_until) == ((48 - 2 * n) / 16, 0)
    assert t.draft_length(PAYS_AT_2) == 7
    t.record_step(PAYS_AT_2, 1)
    assert (t.al, t.switches, t.tokens, t.plain_until, t.probe_after) == (1.875, 1, 9, 9 + 16, 16)
    for _ in range(16):  # plain decoding until the first probe
        assert t.draft_length(PAYS_AT_2) == 0
        t.record_plain()
    # The probe restarts from the prior: 8 steps of AL 1 keep it on, the 9th fails it -> wait twice as long.
    for _ in range(9):
        assert t.draft_length(PAYS_AT_2) == 7 and t.probing
        t.record_step(PAYS_AT_2, 1)
    assert (t.al, t.switches, t.tokens, t.probe_after, t.plain_until) == (1.875, 2, 34, 32, 34 + 32)
    for _ in range(32):
        assert t.draft_length(PAYS_AT_2) == 0
        t.record_plain()
    for n in range(1, 17):  # a probe that pays for a whole window: the wait is reset
        assert t.draft_length(PAYS_AT_2) == 7
        t.record_step(PAYS_AT_2, 8)
        assert t.al == (3 * (16 - n) + 8 * n) / 16
    assert (t.probing, t.probe_after, t.switches, t.plain_until) == (False, 16, 2, 0)
    assert t.draft_length(PAYS_AT_2) == 7


def test_tracker_is_not_switched_off_by_a_run_of_short_steps_where_speculation_pays():
    # AL 1.6 against a cost ratio of 1.33 (calibrated K = 2 at 256 tokens): eight single-token steps
    # in ten, four of them in a row (such a run starts at about one step in eleven there), leave the
    # estimate above the ratio.
    bucket = Bucket(max_context=256, speculate=True, draft_length=2, cost_ratio=1.33, expected_al=1.6)
    t = AcceptanceTracker()
    for emitted in (1, 1, 1, 1, 3, 2, 1, 1, 1, 1):
        assert t.draft_length(bucket) == 2
        t.record_step(bucket, emitted)
    assert (t.switches, t.plain_until) == (0, 0) and round(t.al, 4) == round((6 * 1.6 + 13) / 16, 4)


def test_a_bucket_without_speculation_never_drafts():
    off = Bucket(max_context=100, speculate=False)
    t = AcceptanceTracker()
    assert [t.draft_length(off) for _ in range(3)] == [0, 0, 0]


def test_the_gate_keeps_the_prefix_whose_cumulative_confidence_clears_it():
    confidence = np.array([0.75, 0.5, 0.5, 1.0], dtype=np.float32)  # cumulative 0.75, 0.375, 0.1875, 0.1875
    assert [confident_length(confidence, g) for g in (0.0, 0.1875, 0.2, 0.375, 0.75, 0.8)] == [4, 4, 2, 2, 1, 0]
    steps = np.array([[0.75, 0.5, 0.5, 1.0], [0.25, 1.0, 1.0, 1.0]], dtype=np.float32)
    assert confident_length(steps, 0.3).tolist() == [2, 0]
    assert Bucket(max_context=8, speculate=True).min_confidence == 0.0  # tables without a gate verify all K
    with pytest.raises(ValidationError, match="min_confidence"):
        Bucket(max_context=8, speculate=True, min_confidence=1.5)


def test_table_buckets_and_the_cards_rule(tmp_path):
    """FastFlowLM's DFlash engine turns speculation off at 32k: one bucket up to 32767 tokens, one above."""
    card = PolicyTable(model="x-dflash:1b", backend="npu", buckets=[
        Bucket(max_context=32767, speculate=True, draft_length=7, cost_ratio=1.3, expected_al=2.9),
        Bucket(max_context=131072, speculate=False)])
    assert card.bucket(1).speculate and card.bucket(32767).speculate
    assert not card.bucket(32768).speculate and not card.bucket(10**6).speculate  # past the last: the last
    assert PolicyTable.load(card.save(tmp_path / "p.json")) == card
    with pytest.raises(ValidationError, match="strictly ascending"):
        PolicyTable(model="m", backend="cpu", buckets=[Bucket(max_context=10, speculate=True),
                                                       Bucket(max_context=10, speculate=False)])
    (tmp_path / "bad.json").write_text('{"model": "m", "backend": "cpu", "buckets": [{"max_context": 0}]}')
    with pytest.raises(ValueError, match="bad.json: not a valid speculation policy table"):
        PolicyTable.load(tmp_path / "bad.json")


VERIFY_RATIO = [1.25, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0]  # t_verify(n+1) / t_decode, n = 1 .. 7


def test_a_table_with_verify_ratios_round_trips_and_checks_their_length(tmp_path):
    """``verify_ratio`` holds ``block_size - 1`` positive values; a table without it (calibrated before
    it was recorded) still loads, and has no n-gram-only steps."""
    table = PolicyTable(model="m-dflash:1", backend="cpu", block_size=8, min_speedup=1.2, buckets=[
        Bucket(max_context=256, speculate=False, verify_ratio=VERIFY_RATIO), Bucket(max_context=4096, speculate=False)])
    loaded = PolicyTable.load(table.save(tmp_path / "p.json"))
    assert loaded == table and loaded.buckets[0].verify_ratio == VERIFY_RATIO and loaded.min_speedup == 1.2
    for block_size, ratio, error in [(8, VERIFY_RATIO[:6], "verify_ratio has 6 values, block_size - 1 = 7 expected"),
                                     (None, VERIFY_RATIO, "verify_ratio needs the table's block_size"),
                                     (8, [0.0, *VERIFY_RATIO[1:]], "greater than 0")]:
        with pytest.raises(ValidationError, match=error):
            PolicyTable(model="m", backend="cpu", block_size=block_size,
                        buckets=[Bucket(max_context=10, speculate=False), Bucket(max_context=20, speculate=False,
                                                                                   verify_ratio=ratio)])
    old = PolicyTable.model_validate({"model": "m", "backend": "cpu", "buckets": [
        {"max_context": 256, "speculate": False, "draft_length": 4, "cost_ratio": 1.8, "expected_al": 1.6}]})
    assert (old.block_size, old.buckets[0].verify_ratio, old.min_speedup) == (None, None, MIN_SPEEDUP)
    assert old.lookup_step(100, np.ones(7, dtype=np.float32)) is None
    assert ALWAYS_SPECULATE.lookup_step(100, np.ones(7, dtype=np.float32)) is None
    assert table.lookup_step(100, np.ones(7, dtype=np.float32)) == (7, 8 / VERIFY_RATIO[6], 7.0)
    assert table.lookup_step(1000, np.ones(7, dtype=np.float32)) is None  # its bucket has no verify_ratio


@pytest.mark.parametrize("confidence, most, want", [
    (1.0, 7, (7, 4.0)),   # 1 + n tokens: (1 + 7) / 2.0 = 4 beats 2 / 1.25 = 1.6
    (1.0, 2, (2, 2.0)),   # a shorter proposal: n <= 2, 3 / 1.5 = 2
    (0.5, 7, (1, 1.2)),   # 1.5 / 1.25 = 1.2 beats 1.75 / 1.5 = 1.17 and 1.875 / 2.0
    (0.3, 7, (0, 1.0)),   # 1.3 / 1.25 = 1.04, and less further on: no n exceeds 1.1, a plain step
])
def test_an_ngram_only_step_verifies_the_length_with_the_best_expected_speedup(confidence, most, want):
    got = paying_step(np.full(most, confidence, dtype=np.float32), VERIFY_RATIO, MIN_SPEEDUP)
    assert (got.length, got.speedup) == (want[0], pytest.approx(want[1]))
    assert paying_step(np.zeros(0, dtype=np.float32), VERIFY_RATIO, MIN_SPEEDUP) is PLAIN_STEP


def step(t: LookupTracker, priced: float, emitted: int, cost: float) -> None:
    """An n-gram-only step priced at ``priced``, which kept ``emitted`` tokens for ``cost``
    decodes, judged against a margin of 1.1."""
    t.take(priced)
    t.record(emitted, cost, 1.1)


def backoff_chances(t: LookupTracker) -> int:
    """Chances of the back-off still to come (each gives the raised bar), counted through."""
    n = 0
    while t.chance():
        n += 1
    return n


def test_lookup_tracker_raises_the_bar_after_steps_that_do_not_pay_and_doubles_the_wait():
    t = LookupTracker()
    # 1-token steps priced 1.2 at 1.25 decodes: 7 judge nothing; the 8th fills the window with 11
    # tokens kept (12 expected) for 10 decodes, 1.1, no more than the margin: for 16 chances a step
    # must be priced above 1.1 * 12 / 11 = 1.2, so those priced like these are declined.
    for emitted in (2, 1, 1, 2, 1, 1, 2):
        step(t, 1.2, emitted, 1.25)
        assert (t.chance(), t.backoffs) == (0.0, 0)
    step(t, 1.2, 1, 1.25)
    assert (t.backoffs, t.declining, t.bar, t.speedup) == (1, 16, pytest.approx(1.1 * 12 / 11), None)
    assert backoff_chances(t) == 16 and t.chance() == 0.0
    # the window after it (steps priced 1.25 at 1 decode) keeps 8 of 10 expected: the wait doubles
    for _ in range(8):
        step(t, 1.25, 1, 1.0)
    assert (t.backoffs, t.bar, backoff_chances(t)) == (2, 1.1 * 10 / 8, 32)
    # one that pays (a 3-token step at 1.75 and seven 2-token ones at 1.25: 17 tokens for 10.5
    # decodes, 1.62) resets the wait; the window slides: the fifth 1-token step after it leaves
    # 11 tokens for 10 decodes, and the back-off waits 16 again
    step(t, 2.0, 3, 1.75)
    for _ in range(7):
        step(t, 1.6, 2, 1.25)
    assert (t.backoffs, t.after_backoff, t.wait, t.speedup) == (2, False, 16, 17 / 10.5)
    for _ in range(5):
        step(t, 1.2, 1, 1.25)
    assert (t.backoffs, backoff_chances(t)) == (3, 16)


def test_lookup_tracker_keeps_steps_that_pay_and_caps_the_wait():
    t = LookupTracker()
    for emitted in (2, 2, 1, 2, 1, 1, 2, 1, 2, 2):  # the window slides: 12 tokens for 10 decodes, three times
        step(t, 1.2, emitted, 1.25)
    assert (t.backoffs, t.speedup, t.chance()) == (0, 12 / 10, 0.0)
    t = LookupTracker(first_wait=200, max_wait=256)
    for k in range(2):
        for _ in range(8):
            step(t, 1.2, 1, 1.25)
        assert backoff_chances(t) == (200, 256)[k]


def test_a_table_judges_an_n_gram_only_step_at_its_buckets_verify_ratio():
    table = PolicyTable(model="t", backend="cpu", block_size=4, min_speedup=1.2, buckets=[
        Bucket(max_context=64, speculate=False, verify_ratio=[1.5, 2.0, 2.5]),
        Bucket(max_context=128, speculate=False, verify_ratio=[1.0, 1.0, 1.0])])
    t = LookupTracker(window=3)
    for context, verified, emitted in ((64, 3, 3), (100, 2, 1)):  # 3 tokens for 2.5 decodes, 1 for 1
        t.take(1.6)
        table.record_lookup(context, t, verified, emitted)
    assert (t.speedup, t.backoffs, t.chance()) == (4 / 3.5, 0, 0.0)
    t.take(1.6)
    table.record_lookup(10, t, 1, 1)    # 1 token for 1.5 decodes: the window's 5 for 5, below 1.2
    assert (t.speedup, t.backoffs, t.declining, t.bar) == (None, 1, 16, pytest.approx(1.2 * 1.6))
    ALWAYS_SPECULATE.record_lookup(64, t, 3, 1)  # the null policy takes no n-gram-only step, judges none
    assert (t.speedup, t.backoffs) == (None, 1)


def test_a_plain_step_of_several_tokens_counts_them_towards_the_probe():
    """An n-gram-only step while switched off: its tokens bring the probe nearer, the estimate stays."""
    t = AcceptanceTracker()
    assert t.draft_length(PAYS_AT_2) == 7
    for _ in range(9):  # 9 steps of AL 1 switch off (test above): plain until token 9 + 16
        t.record_step(PAYS_AT_2, 1)
    t.record_plain(5)
    t.record_plain()
    assert (t.tokens, t.al, t.draft_length(PAYS_AT_2)) == (15, 1.875, 0)
    t.record_plain(10)
    assert t.draft_length(PAYS_AT_2) == 7 and t.probing


LETTERS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"] * 8


def collapsing_engine(make_engine, perfect: bool):
    target = ScriptTarget(LETTERS, 3)
    truth = (lambda p: LETTERS[p - 3])
    proposer = replay_proposer(truth, 300, corrupt=(lambda p: not perfect))  # all wrong: AL 1
    table = PolicyTable(model="script-dflash:1", backend="cpu", buckets=[PAYS_AT_2])
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), policy=table, proposer=proposer)
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder)


def test_engine_turns_speculation_off_when_acceptance_collapses(make_engine):
    done = collapsing_engine(make_engine, perfect=False).submit([1, 2, 3], SamplingParams(max_tokens=200)).result()
    assert done.token_ids == tuple(LETTERS[:200])  # exact whatever the policy does
    s = done.stats
    # 1 token from prefill, then: 9 failing steps (off), 16 plain, a probe of 9 failing steps, 32
    # plain, 9, 64 plain (the pending taps folded into the draft cache on the way), 9, 51 plain.
    assert (s.spec.steps, s.spec.accepted, s.spec.switches_off, s.generated_tokens) == (36, 0, 4, 200)


def test_engine_keeps_speculating_while_it_pays(make_engine):
    done = collapsing_engine(make_engine, perfect=True).submit([1, 2, 3], SamplingParams(max_tokens=97)).result()
    assert done.token_ids == tuple(LETTERS[:97])
    s = done.stats
    assert (s.spec.steps, s.spec.accepted, s.spec.switches_off) == (12, 84, 0)  # 1 + 12 blocks of 8


def test_the_draft_scores_only_the_k_rows_the_policy_verifies(make_engine):
    # K = 2 from the table: the draft's LM head runs on block rows 1..2 only, and each step verifies 2.
    target = ScriptTarget(LETTERS, 3)
    draft = random_draft(target, taps=[0, 1])
    asked = []
    draft_blocks = draft.draft_blocks
    draft.draft_blocks = lambda caches, anchors, n_drafts=None: asked.append(n_drafts) or draft_blocks(caches, anchors, n_drafts)
    k2 = Bucket(max_context=1 << 20, speculate=True, draft_length=2, cost_ratio=0.5, expected_al=3.0)
    decoder = SpeculativeDecoder(target, draft, policy=PolicyTable(model="script-dflash:1", backend="cpu", buckets=[k2]))
    done = make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder).submit(
        [1, 2, 3], SamplingParams(max_tokens=20)).result()
    assert done.token_ids == tuple(LETTERS[:20])
    s = done.stats
    assert asked == [2] * s.spec.steps and s.spec.steps > 0
    assert s.spec.drafted == 2 * s.spec.steps


def gated_engine(make_engine, confidence: list[float], gate: float):
    """A scripted target and a draft that drafts the script's tokens, block row k with the draft
    probability ``confidence[k - 1]``, under a table whose bucket gates at ``gate``."""
    target = ScriptTarget(LETTERS, 3)
    draft = random_draft(target, taps=[0, 1])
    vocab = target.config.vocab_size
    assert draft.vocab is None  # draft-vocabulary index == target id

    def draft_logits_batch(caches, anchor_ids, n_drafts=None):  # [S, K, V]: softmax of the token = confidence
        logits = np.zeros((len(caches), n_drafts, vocab), dtype=np.float32)
        for s, cache in enumerate(caches):
            for j, c in enumerate(confidence[:n_drafts]):
                logits[s, j, LETTERS[cache.length + 1 + j - 3]] = np.log(c * (vocab - 1) / (1 - c))
        return logits

    draft.draft_logits_batch = draft_logits_batch
    bucket = Bucket(max_context=1 << 20, speculate=True, draft_length=7, min_confidence=gate, cost_ratio=0.5,
                    expected_al=3.0)
    table = PolicyTable(model="script-dflash:1", backend="cpu", buckets=[bucket])
    decoder = SpeculativeDecoder(target, draft, policy=table)
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder)


def test_the_gate_verifies_only_the_confident_prefix(make_engine):
    # Cumulative confidence 0.9, 0.81, 0.243, ...: a gate of 0.5 verifies d1, d2 of every block; all
    # are right, so a step emits 3 tokens: 1 from prefill, 6 steps of 3, a 7th cut by max_tokens.
    engine = gated_engine(make_engine, [0.9, 0.9, 0.3, 0.9, 0.9, 0.9, 0.9], gate=0.5)
    done = engine.submit([1, 2, 3], SamplingParams(max_tokens=20)).result()
    assert done.token_ids == tuple(LETTERS[:20])
    s = done.stats
    assert (s.spec.steps, s.spec.drafted, s.spec.accepted, s.spec.gated) == (7, 14, 13, 0)


def test_a_draft_unsure_of_its_first_token_leaves_every_step_plain(make_engine):
    engine = gated_engine(make_engine, [0.3] + [0.99] * 6, gate=0.5)
    done = engine.submit([1, 2, 3], SamplingParams(max_tokens=20)).result()
    assert done.token_ids == tuple(LETTERS[:20])
    s = done.stats
    assert (s.spec.steps, s.spec.drafted, s.spec.gated, s.spec.switches_off) == (0, 0, 19, 0)


def test_a_bucket_without_a_draft_length_drafts_the_whole_block_and_one_beyond_it_is_refused():
    """``draft_length`` None: K = ``most`` (block_size - 1, 15 for a block of 16); a table's bucket
    may not draft more than its ``block_size`` allows."""
    whole = PolicyTable(model="m", backend="cpu", block_size=16,
                        buckets=[Bucket(max_context=256, speculate=True, cost_ratio=1.5, expected_al=3.0)])
    assert whole.plan(100, AcceptanceTracker(), 15) == (15, 0.0)
    assert whole.plan(100, AcceptanceTracker(), 7) == (7, 0.0)  # near the context end: what fits
    with pytest.raises(ValidationError, match="bucket up to 256: draft_length 15 is beyond block_size - 1 = 7"):
        PolicyTable(model="m", backend="cpu", block_size=8,
                    buckets=[Bucket(max_context=256, speculate=True, draft_length=15)])
