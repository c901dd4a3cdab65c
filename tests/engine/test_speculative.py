"""The speculative verifier (hand-built logits, statistics) and step (invariants, rollback,
equivalence with plain decoding) on tiny random models, and the engine's speculative path on a
scripted target (EOS, max_tokens and stop strings inside an accepted block, stats)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from engine_fakes import EOS, FakeTokenizer
from spec_fakes import PROMPT, ScriptTarget, family_model, plain_generate, random_draft, replay_proposer, spec_generate

from flm_runtime.backends import forward
from flm_runtime.outputs import expected_accepted
from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.sampling.grammar import GrammarCompiler, json_schema_grammar, lark_grammar
from flm_runtime.sampling.picker import Picker
from flm_runtime.scheduling.step import PLAIN, Lane, StepRecord
from flm_runtime.speculation.policy import ALWAYS_SPECULATE, Bucket, PolicyTable
from flm_runtime.speculation.retrieval import NO_LOOKUP, Lookup
from flm_runtime.speculation.speculative import SpeculativeDecoder, choose, verify
from flm_runtime.speculation.suffix import SuffixIndex

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11)
DRAFT = np.array([11, 12, 13, 14, 15, 16, 17])


# ---- verifier ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", range(8))
def test_verify_greedy_rejects_at_k(k):
    logits = np.random.default_rng(k).standard_normal((8, 50)).astype(np.float32)  # [K+1, V]
    logits[np.arange(k), DRAFT[:k]] = 10.0  # the target agrees with d1..dk
    if k < 7:
        logits[k, DRAFT[k]] = -10.0  # and not with d(k+1)
    rng = sampler.new_rng(0)
    before = rng.bit_generator.state
    assert verify(DRAFT, logits, Picker(GREEDY, rng)) == (k, int(np.argmax(logits[k])))  # k == 7: bonus from row 7
    assert rng.bit_generator.state == before  # greedy draws nothing


@pytest.mark.parametrize("k", range(8))
def test_verify_sampled_rejects_at_k_with_one_draw_per_emitted_token(k):
    logits = np.random.default_rng(k).standard_normal((8, 50)).astype(np.float32)
    logits[:k] = -np.inf
    logits[np.arange(k), DRAFT[:k]] = 0.0  # warp(row j) is one-hot on d(j+1): accepted surely
    if k < 7:
        logits[k, DRAFT[k]] = -np.inf  # d(k+1) impossible: rejected surely
    rng, twin = sampler.new_rng(5), sampler.new_rng(5)
    n, token = verify(DRAFT, logits, Picker(SAMPLED, rng))
    assert n == k
    assert sampler.warp(logits[k], SAMPLED)[token] > 0 and (k == 7 or token != DRAFT[k])
    twin.random(k + 1)  # k + 1 tokens emitted: exactly k + 1 draws
    assert rng.random() == twin.random()


class NoRepeat:
    """A stateful processor: the last accepted token may not come next. Records what it accepted."""

    def __init__(self):
        self.accepted: list[int] = []

    def process(self, logits):
        if self.accepted:
            logits[self.accepted[-1]] = -np.inf
        return logits

    def accept(self, token):
        self.accepted.append(token)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verify_processes_row_j_after_the_j_kept_tokens(params):
    """Row j is processed with the state after d1 .. dj: a drafted token the processor forbids
    there (d3 repeats d2) ends the accepted prefix, although the raw target agrees with it; the
    processor accepts exactly the emitted tokens, in order, and the pass's logits are left as
    they were."""
    draft = np.array([11, 12, 12, 14, 15, 16, 17])
    logits = np.full((8, 50), -np.inf, dtype=np.float32)
    logits[np.arange(7), draft] = 10.0           # the raw target agrees with every drafted token
    logits[2, 30] = 5.0                          # row 2's only token left once 12 is forbidden
    raw = logits.copy()
    processor = NoRepeat()
    n, token = verify(draft, logits, Picker(params, sampler.new_rng(0), [processor]))
    assert (n, token) == (2, 30)
    assert processor.accepted == [11, 12, 30]
    np.testing.assert_array_equal(logits, raw)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (over the support), p-value for an
    even number of degrees of freedom: ``Q(df/2, x/2) = exp(-x/2) * sum_{i<df/2} (x/2)^i / i!``."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    n, expected = counts.sum(), probs[support] * counts.sum()
    x = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert df % 2 == 0, "the closed form needs an even df"
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2)) if n else 1.0


def test_verify_sampled_emits_the_target_distribution():
    """Lossless: the first emitted token ~ warp(row 0) and, when d1 was accepted, the second ~
    warp(row 1), with a draft that is right about a quarter of the time. Pearson chi-square over
    20,000 seeded trials; the test passes at p > 0.001 (it is deterministic: fixed seeds)."""
    logits = (np.random.default_rng(3).standard_normal((8, 12)) * 0.5).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=5)  # 5 tokens keep mass: df = 4
    p0, p1 = sampler.warp(logits[0], params), sampler.warp(logits[1], params)
    draft = np.array([np.argsort(-p0)[1], np.argsort(-p1)[0], 0, 1, 2, 3, 4])
    picker = Picker(params, sampler.new_rng(1234))
    first, second = np.zeros(12, int), np.zeros(12, int)
    for _ in range(20_000):
        n, token = verify(draft, logits, picker)
        emitted = [*draft[:n], token]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    assert 0.15 < first[draft[0]] / first.sum() < 0.5 and second.sum() > 3000  # both branches exercised
    assert chi_square_p_value(first, p0) > 0.001
    assert chi_square_p_value(second, p1) > 0.001


def test_verify_sampled_emits_the_target_distribution_deep_in_a_block_of_16():
    """Lossless at the end of a block of 16: with d1 .. d14 surely accepted, the 15th emitted token ~
    warp(row 14) and, when d15 was accepted, the bonus ~ warp(row 15), with d15 right about a
    quarter of the time. Pearson chi-square over 4,000 seeded trials, p > 0.001."""
    logits = (np.random.default_rng(4).standard_normal((16, 12)) * 0.5).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=5)  # 5 tokens keep mass: df = 4
    draft = np.arange(15) % 12
    logits[np.arange(14)] = -np.inf
    logits[np.arange(14), draft[:14]] = 0.0  # warp(row j) is one-hot on d(j+1), j < 14: accepted surely
    p14, p15 = sampler.warp(logits[14], params), sampler.warp(logits[15], params)
    draft[14] = np.argsort(-p14)[1]
    picker = Picker(params, sampler.new_rng(99))
    fifteenth, bonus = np.zeros(12, int), np.zeros(12, int)
    for _ in range(4_000):
        n, token = verify(draft, logits, picker)
        assert n >= 14
        fifteenth[draft[14] if n == 15 else token] += 1
        if n == 15:
            bonus[token] += 1
    assert 0.15 < fifteenth[draft[14]] / fifteenth.sum() < 0.5 and bonus.sum() > 600  # both branches
    assert chi_square_p_value(fifteenth, p14) > 0.001
    assert chi_square_p_value(bonus, p15) > 0.001


# ---- the step on tiny random models ------------------------------------------------------------



def check_caches(model, decoder, prompt):
    """``on_step`` check: the invariant, and target and draft caches equal to those of a fresh
    prefill of everything committed (the rollback left nothing of rejected tokens behind)."""
    def check(out, cache, state):
        assert state.draft_cache.length + len(state.pending) == cache.length == len(prompt) + len(out) - 1
        fresh = model.new_cache()
        full = forward(model, np.array(prompt + out[:-1]), fresh, taps=decoder.taps).taps  # [N, n*E]
        np.testing.assert_allclose(cache.keys(), fresh.keys(), atol=1e-4)
        np.testing.assert_allclose(cache.values(), fresh.values(), atol=1e-4)
        np.testing.assert_allclose(state.pending, full[state.draft_cache.length :], atol=1e-4)
        dc = decoder.draft.new_cache()
        decoder.draft.add_context(dc, full[: state.draft_cache.length], 0)
        np.testing.assert_allclose(state.draft_cache.keys(), dc.keys(), atol=1e-4)
    return check


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposer", ["random", "replay"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_speculative_equals_plain_decoding(tiny, params, proposer, block_size):
    """Token for token, greedy and seeded-sampled (one draw per emitted token in both), with a
    random draft (AL ~ 1) and with one replaying the baseline with every third position wrong,
    for blocks of 8 and of 16 (the public DFlash drafts')."""
    base = plain_generate(tiny, PROMPT, 40, params, seed=7)
    truth = dict(enumerate(base, start=len(PROMPT)))
    propose = replay_proposer(lambda p: truth.get(p, 0), 300, corrupt=lambda p: p % 3 == 0, drafted=block_size - 1)
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2], block_size=block_size),
                                 proposer=propose if proposer == "replay" else None)
    out, _, state = spec_generate(decoder, PROMPT, 40, params, seed=7, on_step=check_caches(tiny, decoder, PROMPT))
    assert out == base
    al = state.stats.acceptance_length
    assert (al > 2.0) if proposer == "replay" else (1.0 <= al < 1.5), al


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral", "gemma3", "phi3", "llama_llama3"])
def test_speculative_equals_plain_decoding_on_every_family(tmp_path, case):
    """DFlash over each family's tiny target (``family_files``: Q/K/V bias, QK-norm, sliding
    windows of 8, Gemma 3's norms, GeGLU and local RoPE base, LongRoPE, Llama 3's RoPE), float32:
    greedy, with a proposer replaying the baseline with every third position wrong, the tokens are
    plain decoding's and the caches after every step a fresh prefill's. The 50 positions pass every
    window and original context of the cases."""
    target = family_model(tmp_path, case)
    base = plain_generate(target, PROMPT, 40, GREEDY)
    truth = dict(enumerate(base, start=len(PROMPT)))
    propose = replay_proposer(lambda p: truth.get(p, 0), target.config.vocab_size, corrupt=lambda p: p % 3 == 0)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), proposer=propose)
    out, _, state = spec_generate(decoder, PROMPT, 40, GREEDY, on_step=check_caches(target, decoder, PROMPT))
    assert out == base
    assert state.stats.acceptance_length > 2.0, state.stats


def test_near_the_context_end_decoding_is_plain(tiny):
    prompt = (PROMPT * 30)[:285]  # 15 positions left in a context of 300
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]))
    out, cache, state = spec_generate(decoder, prompt, 15, GREEDY, on_step=check_caches(tiny, decoder, prompt))
    assert out == plain_generate(tiny, prompt, 15, GREEDY)
    assert 1 <= state.stats.steps <= 7 and cache.length <= 300


# ---- the engine on a scripted target ------------------------------------------------------------

def script_engine(make_engine, script, prompt_len=3, perfect=True, block_size=8, **kw):
    target = ScriptTarget(script, prompt_len)
    truth = (lambda p: script[p - prompt_len] if p - prompt_len < len(script) else EOS)
    proposer = replay_proposer(truth, 300, corrupt=(lambda p: False) if perfect else (lambda p: p % 4 == 0),
                               drafted=block_size - 1)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1], block_size=block_size), proposer=proposer)
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder, **kw)


LETTERS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]


def test_eos_inside_an_accepted_block_ends_the_output(make_engine):
    engine = script_engine(make_engine, LETTERS[:4] + [EOS] + LETTERS[4:])
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=50))
    events = list(handle)
    done = handle.result()
    assert (done.text, done.finish_reason, done.completion_tokens) == ("abcd", "stop", 4)
    assert done.token_ids == tuple(LETTERS[:4]) and sum(len(e.token_ids) for e in events) == 4
    s = done.stats
    # prefill gave "a"; one step drafted 7, all right; "b c d EOS" pushed, the rest never.
    assert (s.spec.steps, s.spec.drafted, s.spec.accepted, s.generated_tokens) == (1, 7, 4, 5)
    assert s.spec.acceptance_length == 4.0
    assert events[-1].stats == s


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 8, 9, 13, 16, 17, 25])
@pytest.mark.parametrize("perfect", [True, False])
def test_max_tokens_is_exact_inside_a_block(make_engine, max_tokens, perfect):
    engine = script_engine(make_engine, LETTERS, perfect=perfect)
    done = engine.submit([1, 2, 3], SamplingParams(max_tokens=max_tokens)).result()
    assert done.text == "abcdefghijklmnopqrstuvwxyz"[:max_tokens] and done.finish_reason == "length"
    assert done.completion_tokens == len(done.token_ids) == done.stats.generated_tokens == max_tokens
    s = done.stats
    assert s.spec.accepted + s.spec.steps >= max_tokens - 1 >= s.spec.accepted
    if perfect and max_tokens == 25:  # 1 from prefill + 3 steps of 8: AL = 8 (the bonus included)
        assert (s.spec.steps, s.spec.accepted, s.spec.acceptance_length) == (3, 21, 8.0)


def test_a_block_of_16_keeps_15_drafted_tokens_and_the_bonus(make_engine):
    """A draft of block size 16 whose proposals are all right: 1 token from prefill, then two
    steps that each verify 15 drafted tokens in one pass of 16 rows and keep them all and the
    bonus (AL 16); the third step is cut by max_tokens after 2 of its tokens."""
    engine = script_engine(make_engine, LETTERS * 2, block_size=16)
    steps = []
    engine.on_step = steps.append
    done = engine.submit([1, 2, 3], SamplingParams(max_tokens=35)).result()
    assert engine.idle(timeout=60)  # the last step's on_step may come after the result
    assert done.token_ids == tuple((LETTERS * 2)[:35]) and done.finish_reason == "length"
    s = done.stats.spec
    assert (s.steps, s.drafted, s.accepted, s.emitted) == (3, 45, 32, 34)
    assert [[(len(d.ids), d.planned) for d in t.records] for t in steps] == [[], *[[(15, 15)]] * 3]
    two = engine.submit([1, 2, 3], SamplingParams(max_tokens=33)).result().stats.spec
    assert (two.steps, two.drafted, two.accepted, two.acceptance_length) == (2, 30, 30, 16.0)


def test_on_step_reports_each_pass_with_its_drafts(make_engine):
    """The engine's per-step hook: one ``StepTiming`` per forward pass, with each decoding lane's
    ``StepRecord``: the prefill, then three whole blocks of 7 (25 tokens: 1 + 3 * 8); without a draft,
    every decoding step is ``PLAIN``."""
    engine = script_engine(make_engine, LETTERS)
    steps = []
    engine.on_step = steps.append
    assert engine.submit([1, 2, 3], SamplingParams(max_tokens=25)).result().stats.spec.steps == 3
    assert engine.idle(timeout=60)
    assert [[(len(d.ids), d.planned, d.gated) for d in t.records] for t in steps] == [[], *[[(7, 7, False)]] * 3]
    plain = make_engine(ScriptTarget(LETTERS, 3), FakeTokenizer(vocab_size=300), on_step=steps.append)
    steps.clear()
    assert plain.submit([1, 2, 3], SamplingParams(max_tokens=5)).result().text == "abcde"
    assert plain.idle(timeout=60)
    assert [len(t.records) for t in steps] == [0, 1, 1, 1, 1] and all(d is PLAIN for t in steps for d in t.records)


def test_stop_string_inside_a_block(make_engine):
    script = [ord(c) for c in "hello world, goodbye"]
    engine = script_engine(make_engine, script)
    params = SamplingParams(max_tokens=6, stop=("o w",))  # completes at token 7 > max_tokens: "length"
    assert engine.submit([1, 2, 3], params).result().text == "hello "
    params = SamplingParams(max_tokens=7, stop=("o w",))  # completes in the token that reaches max_tokens
    handle = engine.submit([1, 2, 3], params)
    streamed = "".join(e.text for e in handle)
    done = handle.result()
    assert streamed == done.text == "hell" and done.finish_reason == "stop"
    assert done.completion_tokens == len(done.token_ids) == 4  # "o" lies wholly in the stop string


def test_rollback_leaves_only_committed_tokens():
    """A target cache written with the fed ids: after every step (some drafts rejected) it holds
    exactly prompt + emitted tokens but the last (the anchor, not fed yet)."""
    target = ScriptTarget(LETTERS, 3)
    proposer = replay_proposer(lambda p: LETTERS[(p - 3) % 26], 300, corrupt=lambda p: p % 5 == 0)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), proposer=proposer)

    def check(out, cache, state):
        assert target.fed(cache) == [1, 2, 3] + out[:-1]

    out, _, state = spec_generate(decoder, [1, 2, 3], 20, GREEDY, on_step=check)
    assert out == LETTERS[:20] and state.stats.steps >= 3


def test_chunked_prefill_beside_speculative_decoding(make_engine, tiny, monkeypatch):
    """A 30-token prompt prefilled 4 tokens per step (its taps into the draft cache chunk by
    chunk; ``add_prompt`` asserts the invariant after each) while a request admitted with it
    decodes speculatively in the same passes: both give the plain greedy tokens."""
    engine = make_engine(tiny, FakeTokenizer(vocab_size=300), prefill_tokens=4,
                         speculative=SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2])))
    passes = []
    forward_batch = tiny.forward_batch
    monkeypatch.setattr(tiny, "forward_batch",
                        lambda rows, caches, **kw: passes.append(sorted(len(r) for r in rows)) or forward_batch(rows, caches, **kw))
    short, long = PROMPT[:3], (PROMPT * 3)[:30]
    with engine.held():  # both queued before the first step
        handles = [engine.submit(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in (short, long)]
    assert [h.result().token_ids for h in handles] == [tuple(plain_generate(tiny, p, 20, GREEDY)) for p in (short, long)]
    assert passes[:2] == [[3], [4, 8]]  # the long prompt's 4-token chunk did not fit beside the short one
    assert passes.count([4, 8]) == 7    # its 7 chunks of 4 tokens, each beside the short one's verify rows


def test_seeded_sampled_speculative_is_reproducible_and_equals_plain(make_engine, tiny):
    tok = FakeTokenizer(vocab_size=300)
    spec = make_engine(tiny, tok, speculative=SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2])))
    plain = make_engine(tiny, tok)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    first, second = (spec.submit(PROMPT, params).result() for _ in range(2))
    assert first.token_ids == second.token_ids and first.text == second.text
    assert first.token_ids == plain.submit(PROMPT, params).result().token_ids
    assert first.stats.spec.steps >= 1 and plain.submit(PROMPT, params).result().stats.spec is None


@pytest.mark.parametrize("suffix", [False, True], ids=["draft and prompt lookup", "and the suffix proposer"])
def test_choices_copy_the_draft_state_and_equal_plain_decoding(make_engine, tiny, suffix):
    """``n`` = 3 with a draft: each choice decodes speculatively from a copy of the prompt's draft
    context and proposers (a wrong copy would fail ``SpeculativeDecoder``'s invariant checks or
    change the drafts, not the tokens) and gives what plain decoding gives, greedy and seeded; with
    the suffix proposer, the sampled choices take proposals from the greedy ones, which finished
    before them."""
    tok = FakeTokenizer(vocab_size=300)
    spec = make_engine(tiny, tok, speculative=SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]),
                                                                 suffix=SuffixIndex(1000) if suffix else None))
    plain = make_engine(tiny, tok)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, max_tokens=24, ignore_eos=True)
    greedy_choices = [h.result() for h in spec.submit_choices(PROMPT, greedy, 3)]
    assert [d.token_ids for d in greedy_choices] == [plain.submit(PROMPT, greedy).result().token_ids] * 3
    sampled_choices = [h.result() for h in spec.submit_choices(PROMPT, sampled, 3)]
    assert [d.token_ids for d in sampled_choices] == [
        h.result().token_ids for h in plain.submit_choices(PROMPT, sampled, 3)]
    assert len({d.token_ids for d in sampled_choices}) == 3
    assert all(d.stats.spec.steps >= 1 for d in greedy_choices + sampled_choices)
    assert (sum(d.stats.spec.counts("suffix").steps for d in sampled_choices) >= 1) == suffix


# ---- prompt lookup beside the draft -------------------------------------------------------------

REPEATS = PROMPT * 3


def test_prompt_lookup_equals_plain_greedy_decoding(tiny):
    """A prompt that repeats itself: n-gram proposals are verified and some accepted, and the
    output is plain greedy decoding's token for token, as it is with the draft alone; the caches
    and the lookup stay in step (``check_caches``, ``SpeculativeDecoder._check``)."""
    base = plain_generate(tiny, REPEATS, 60, GREEDY)
    for ngram in (True, False):
        decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]), ngram=ngram)
        out, _, state = spec_generate(decoder, REPEATS, 60, GREEDY, on_step=check_caches(tiny, decoder, REPEATS))
        assert out == base
        s = state.stats
        assert (s.counts("ngram").accepted >= 1) if ngram else (s.counts("ngram").steps == 0 and not state.proposers), s


COPIED = LETTERS[:12]


def copy_engine(make_engine, **kw):
    """A scripted target that copies the prompt's 12 letters, with a random draft (its
    confidence is low: an n-gram match wins)."""
    target = ScriptTarget(COPIED, prompt_len=14)
    return make_engine(target, FakeTokenizer(vocab_size=300),
                       speculative=SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), **kw))


def test_ngram_stats_are_reported_apart_from_the_draft(make_engine):
    """Prefill gives a; step 1 finds no match ((l, a) occurs nowhere before): the draft's, all
    rejected; step 2 matches (a, b) in the prompt: c .. i accepted, bonus j (8 tokens); step 3
    matches (g, h, i, j): k, l accepted, and max_tokens ends the output there."""
    done = copy_engine(make_engine).submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
    assert done.token_ids == tuple(COPIED)
    d = done.stats.as_dict()
    assert {k: d[k] for k in ("spec_steps", "drafted_tokens", "accepted_tokens", "acceptance_length",
                              "draft_acceptance_length", "ngram_steps", "ngram_drafted_tokens",
                              "ngram_accepted_tokens", "ngram_acceptance_length")} == {
        "spec_steps": 3, "drafted_tokens": 21, "accepted_tokens": 9, "acceptance_length": 11 / 3,
        "draft_acceptance_length": 1.0, "ngram_steps": 2, "ngram_drafted_tokens": 14, "ngram_accepted_tokens": 9,
        "ngram_acceptance_length": 5.0}
    alone = copy_engine(make_engine, ngram=False).submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
    assert alone.token_ids == done.token_ids
    s = alone.stats.spec
    assert s.counts("ngram").steps == 0 and s.emitted == 11
    assert s.counts("draft").acceptance_length == s.acceptance_length == 11 / s.steps


def test_seeded_sampled_prompt_lookup_equals_plain(make_engine):
    """Sampled at temperature 1 from the scripted target's one-hot logits of 10.0 (the script's
    letter about 98.7% of the time): the seeded tokens with n-gram proposals are those of an engine
    without a draft, and some n-gram proposals were accepted."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    done = copy_engine(make_engine).submit([1, 2, *COPIED], params).result()
    plain = make_engine(ScriptTarget(COPIED, prompt_len=14), FakeTokenizer(vocab_size=300))
    assert done.token_ids == plain.submit([1, 2, *COPIED], params).result().token_ids
    assert done.stats.spec.counts("ngram").accepted >= 1, done.stats.spec


def test_the_policy_plan_bounds_the_ngram_proposal(make_engine):
    """K = 3 from the table: an n-gram proposal is at most 3 tokens; a context the table keeps plain
    (above 20 tokens) has no proposal at all, n-gram or draft."""
    table = PolicyTable(model="t", backend="cpu", buckets=[Bucket(max_context=20, speculate=True, draft_length=3),
                                                           Bucket(max_context=4096, speculate=False)])
    target = ScriptTarget(COPIED, prompt_len=14)
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, random_draft(target, taps=[0, 1]), policy=table))
    steps = []
    engine.on_step = steps.append
    done = engine.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
    assert engine.idle(timeout=60)
    assert done.token_ids == tuple(COPIED)
    drafts = [d for t in steps for d in t.records]
    assert any(d.proposer == "ngram" for d in drafts) and all(len(d.ids) <= d.planned == 3 for d in drafts if d.planned)
    assert drafts[-1] is PLAIN and done.stats.spec.counts("ngram").steps == sum(d.proposer == "ngram" for d in drafts)


def test_choose_prefers_the_proposal_expected_to_keep_more():
    """The draft's expected accepted tokens: 0.9 + 0.81 (its gated two); the lookup's: 1 + 0.8, a
    tie, 1 + 0.7."""
    draft = StepRecord(DRAFT[:2], 3, np.array([0.9, 0.9, 0.1], dtype=np.float32))
    more = Lookup(np.array([1, 2]), 2, np.array([1.0, 0.8], dtype=np.float32))
    assert choose(draft, {"ngram": more}).ids is more.ids and choose(draft, {"ngram": more}).proposer == "ngram"
    tie = Lookup(np.array([1, 2]), 2, draft.confidence[:2])
    assert tie.expected == expected_accepted(draft.confidence[:2])
    for lookup in (tie, Lookup(np.array([1, 2]), 2, np.array([1.0, 0.7], dtype=np.float32)), NO_LOOKUP):
        kept = choose(draft, {"ngram": lookup})
        assert kept.ids is draft.ids and kept.proposer is None and kept.lookups == {"ngram": lookup}
    assert choose(draft, {}).ids is draft.ids


# ---- n-gram-only steps where the policy plans plain decoding --------------------------------------

def plain_table(verify_ratio: list[float] | None, min_speedup: float = 1.1, speculate_from: int | None = None):
    """A table that speculates nowhere (or only above ``speculate_from`` tokens), with the given
    verify ratios in its plain bucket."""
    buckets = [Bucket(max_context=speculate_from or 4096, speculate=False, verify_ratio=verify_ratio)]
    if speculate_from is not None:
        buckets.append(Bucket(max_context=4096, speculate=True, cost_ratio=0.5, expected_al=3.0))
    return PolicyTable(model="t", backend="cpu", block_size=8, min_speedup=min_speedup, buckets=buckets)


CHEAP = [1.0] * 7  # a verify pass of any length costs a decode: the longest proposal pays best


def count_draft_passes(draft) -> list[int]:
    """Records the K of each draft pass of ``draft``."""
    asked = []
    draft_blocks = draft.draft_blocks
    draft.draft_blocks = lambda caches, anchors, n_drafts=None: asked.append(n_drafts) or draft_blocks(
        caches, anchors, n_drafts)
    return asked


def test_ngram_only_steps_where_the_table_speculates_nowhere(make_engine):
    """Speculation off everywhere, verify ratios of 1: prefill gives a; step 1 finds no match and
    decodes b plainly; step 2 matches (a, b): c .. i verified and accepted (rate 0.5 each: 1 +
    0.99 tokens for 1 decode), bonus j; step 3 matches (g, h, i, j): k, l accepted, max_tokens ends
    the output. The draft never runs. Without verify ratios every step is plain."""
    stats = {}
    for ratio in (CHEAP, None):
        target = ScriptTarget(COPIED, prompt_len=14)
        draft = random_draft(target, taps=[0, 1])
        asked = count_draft_passes(draft)
        engine = make_engine(target, FakeTokenizer(vocab_size=300),
                             speculative=SpeculativeDecoder(target, draft, policy=plain_table(ratio)))
        steps = []
        engine.on_step = steps.append
        done = engine.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
        assert engine.idle(timeout=60)
        assert done.token_ids == tuple(COPIED) and asked == []
        stats[ratio is None] = done.stats.as_dict()
        drafts = [d for t in steps for d in t.records]
        assert all(d.planned == 0 and not d.gated for d in drafts)
        if ratio is None:
            assert all(d is PLAIN for d in drafts) and len(drafts) == 11
        else:
            assert [(len(d.ids), d.proposer) for d in drafts] == [(0, None), (7, "ngram"), (7, "ngram")]
    assert {k: stats[False][k] for k in ("spec_steps", "drafted_tokens", "accepted_tokens", "acceptance_length",
                                         "draft_acceptance_length", "ngram_steps", "ngram_drafted_tokens",
                                         "ngram_accepted_tokens", "ngram_acceptance_length", "gated_steps",
                                         "spec_switches_off", "al_estimate")} == {
        "spec_steps": 2, "drafted_tokens": 14, "accepted_tokens": 9, "acceptance_length": 5.0,
        "draft_acceptance_length": None, "ngram_steps": 2, "ngram_drafted_tokens": 14, "ngram_accepted_tokens": 9,
        "ngram_acceptance_length": 5.0, "gated_steps": 0, "spec_switches_off": 0, "al_estimate": None}
    assert (stats[True]["spec_steps"], stats[True]["ngram_steps"], stats[True]["gated_steps"]) == (0, 0, 0)
    assert [stats[True][k] for k in ("acceptance_length", "draft_acceptance_length", "ngram_acceptance_length")
            ] == [None] * 3  # no AL over no step (a number would count the bonus token: at least 1)


@pytest.mark.parametrize("ratio, min_speedup, want", [
    # a third token is dear: each n-gram-only step verifies 2 (1 + 0.75 tokens for 1 decode)
    ([1.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0], 1.1, [(0, 0, False), (2, 2, True), (4, 2, True), (4, 2, True),
                                              (4, 2, True)]),
    # a margin of 2 that a proposal at the prior rate 0.5 misses (1.99 tokens for 1.2 decodes): plain
    # steps score the proposals of match lengths 2, 3, 4 (their first token kept: rate 0.67); then one
    # of 7 pays (2.94 tokens) and is accepted
    ([1.2] * 7, 2.0, [(0, 0, False), (2, 0, False), (3, 0, False), (4, 0, False), (4, 7, True)]),
])
def test_an_ngram_only_step_verifies_as_many_tokens_as_pay(make_engine, ratio, min_speedup, want):
    """Per step: the proposal's match length, the tokens verified, whether n-gram-only."""
    target = ScriptTarget(COPIED, prompt_len=14)
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, random_draft(target, taps=[0, 1]), policy=plain_table(ratio, min_speedup)))
    steps = []
    engine.on_step = steps.append
    done = engine.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
    assert engine.idle(timeout=60)
    assert done.token_ids == tuple(COPIED)
    drafts = [d for t in steps for d in t.records]
    assert [(d.lookups["ngram"].match if d.lookups else 0, len(d.ids), d.proposer == "ngram") for d in drafts] == want
    assert done.stats.spec.counts("ngram").steps == done.stats.spec.steps == sum(n for *_, n in want)


def test_seeded_sampled_ngram_only_steps_equal_plain(make_engine):
    """As ``test_seeded_sampled_prompt_lookup_equals_plain``, with a table that speculates nowhere:
    the same seeded tokens as an engine without a draft, and n-gram-only steps were accepted."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    target = ScriptTarget(COPIED, prompt_len=14)
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, random_draft(target, taps=[0, 1]), policy=plain_table(CHEAP)))
    done = engine.submit([1, 2, *COPIED], params).result()
    plain = make_engine(ScriptTarget(COPIED, prompt_len=14), FakeTokenizer(vocab_size=300))
    assert done.token_ids == plain.submit([1, 2, *COPIED], params).result().token_ids
    s = done.stats.spec
    assert s.counts("ngram").accepted >= 1 and s.counts("ngram").steps == s.steps >= 1, s


def test_ngram_only_steps_keep_the_draft_in_step(tiny):
    """A repeating prompt (30 tokens) on a tiny random model, whose greedy output runs into a
    repeated token from its 30th on, speculating only above 80 tokens: n-gram-only steps below,
    without a draft pass, then the draft's steps from the taps of everything committed
    (``check_caches`` after every step: target cache, pending taps and draft cache equal a fresh
    prefill's); the tokens are plain decoding's."""
    base = plain_generate(tiny, REPEATS, 60, GREEDY)
    draft = random_draft(tiny, taps=[0, 2])
    asked = count_draft_passes(draft)
    decoder = SpeculativeDecoder(tiny, draft, policy=plain_table(CHEAP, speculate_from=80))
    drafts = []
    prepare = decoder.prepare
    decoder.prepare = lambda lanes: drafts.extend(prepare(lanes)) or drafts[-len(lanes):]
    out, _, state = spec_generate(decoder, REPEATS, 60, GREEDY, on_step=check_caches(tiny, decoder, REPEATS))
    assert out == base
    planned = [d.planned > 0 for d in drafts]
    assert planned == sorted(planned) and len(asked) == sum(planned) >= 1  # plain plans, then the draft's
    ngram_only = sum(d.proposer == "ngram" and not d.planned for d in drafts)
    assert ngram_only >= 1 and state.stats.counts("ngram").steps >= ngram_only, (ngram_only, state.stats)


def test_a_decoder_whose_policy_never_drafts_keeps_no_draft_context(tiny, monkeypatch):
    """A table that speculates nowhere: the decoder asks the target for no taps and the draft's
    context stays empty (a draft that never runs needs none), n-gram-only steps still run and the
    tokens are plain decoding's; the same table speculating above 80 tokens asks for the taps."""
    asked = []
    forward_batch = tiny.forward_batch
    monkeypatch.setattr(tiny, "forward_batch", lambda *a, taps=(), **k: asked.append(taps) or forward_batch(
        *a, taps=taps, **k))
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]), policy=plain_table(CHEAP))
    out, _, state = spec_generate(decoder, REPEATS, 60, GREEDY)
    assert out == plain_generate(tiny, REPEATS, 60, GREEDY)
    assert decoder.taps == () and set(asked) == {()} and len(asked) > 1
    assert state.draft_cache.length == 0 and state.pending.shape == (0, 2 * tiny.config.hidden_size)
    assert state.stats.counts("ngram").steps >= 1
    assert SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]),
                              policy=plain_table(CHEAP, speculate_from=80)).taps == (0, 2)


# A verify cost curve of the shape measured on CPUs: 1.25 decodes for a 1-token step, 2.75 for 7.
SLOPED = [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75]
# Text of two tokens in no order: every 2-, 3- and 4-gram recurs, followed by either token.
NOISE_PROMPT = [1, 2, *(10 + int(c) for c in "10101101011000111111")]
NOISE = [10 + int(c) for c in "011100110010010011001111100100001000101001000001110101101001010001010111001110000111011"
                              "001111111001101111011000001111100"]


@pytest.mark.parametrize("prompt, script, want", [
    # n-gram-only steps of 1 token keep 1.35 a step here (73 tokens in 54 steps without the tracker),
    # 1.08 decodes' worth at 1.25 each: two windows of 8 that do not pay raise the bar (16 chances,
    # then 32), which the proposals priced like them do not clear
    (NOISE_PROMPT, NOISE, (21, 27, 2)),
    # a copy: whole 7-token proposals accepted, never backed off
    ([1, 2, *LETTERS[:20]], LETTERS[:20] * 3, (10, 58, 0)),
])
def test_a_request_backs_off_n_gram_only_steps_that_do_not_pay(prompt, script, want):
    """Plain everywhere with ``SLOPED`` costs: the n-gram-only steps (their count, tokens kept)
    and the request's back-offs (``LookupTracker``); the output is the script (plain decoding's)."""
    target = ScriptTarget(script, prompt_len=len(prompt))
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), policy=plain_table(SLOPED))
    out, _, state = spec_generate(decoder, prompt, len(script), GREEDY)
    ngram = state.stats.counts("ngram")
    assert out == script and (ngram.steps, ngram.emitted, state.lookups.backoffs) == want
    assert state.stats.steps == ngram.steps  # the draft never ran


def test_an_ngram_only_step_fits_its_rows_in_the_context():
    """A context of 20 tokens and a 14-token prompt: step 2's proposal (after (a, b)) is cut to the
    4 rows left after the anchor's, c .. f, all accepted with the bonus g at the last position."""
    target = ScriptTarget(COPIED, prompt_len=14, context=20)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), policy=plain_table(CHEAP))
    drafts = []
    prepare = decoder.prepare
    decoder.prepare = lambda lanes: drafts.extend(prepare(lanes)) or drafts[-len(lanes):]
    out, cache, _ = spec_generate(decoder, [1, 2, *COPIED], 7, GREEDY)
    assert out == COPIED[:7] and cache.length == 20
    assert [(len(d.ids), d.proposer) for d in drafts] == [(0, None), (4, "ngram")]


def test_a_preempted_speculative_sequence_rebuilds_its_draft_context_and_equals_plain(make_engine, tiny):
    """Three requests that grow to 2 blocks each in a pool of 3: the youngest are preempted, and
    when admitted again prefill their context, which rebuilds the draft's context from its taps;
    each ends with the tokens plain decoding gives, greedy and seeded."""
    from flm_runtime.scheduling.admission import kv_bytes_per_token

    tok = FakeTokenizer(vocab_size=300)
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]))
    per_token = kv_bytes_per_token(tiny.config, decoder.draft.config, np.dtype(tiny.kv_dtype).itemsize)
    spec = make_engine(tiny, tok, speculative=decoder, kv_budget=3 * 64 * per_token)
    plain = make_engine(tiny, tok)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[2:] + PROMPT[:2]]
    params = [SamplingParams(max_tokens=70, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=70, ignore_eos=True),
              SamplingParams(max_tokens=70, ignore_eos=True)]
    with spec.held():
        handles = [spec.submit(p, q) for p, q in zip(prompts, params)]
    assert [h.result().token_ids for h in handles] == [plain.submit(p, q).result().token_ids
                                                       for p, q in zip(prompts, params)]
    assert spec.stats()["preempted"] >= 1 and spec.stats()["kv_blocks_used"] == 0


# ---- the suffix proposer: continuations of earlier requests --------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_suffix_proposer_equals_plain_decoding(tiny, params):
    """An index that holds an earlier run of the same prompt: the suffix proposer's proposals are
    verified and accepted, the output is plain decoding's token for token (greedy and seeded), and
    the caches and proposers stay in step (``check_caches``, ``SpeculativeDecoder._check``)."""
    base = plain_generate(tiny, PROMPT, 40, params, seed=7)
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]), suffix=SuffixIndex(1000))
    decoder.finish(np.array(PROMPT), np.array(base))
    out, _, state = spec_generate(decoder, PROMPT, 40, params, seed=7, on_step=check_caches(tiny, decoder, PROMPT))
    assert out == base
    assert [p.name for p in state.proposers] == ["ngram", "suffix"]
    suffix = state.stats.counts("suffix")
    assert suffix.accepted >= 7 and suffix.acceptance_length > 2.0, state.stats


def first_two_emitted(decoder, state, params, proposer: str, proposal: list[int], trials: int = 20_000):
    """Counts ``[12]`` of the first and (after an accepted first token) second emitted token over
    ``trials`` seeded steps after the prompt ``[11, 10]``, each from a copy of the prompt's cache
    and ``state``, every step verifying ``proposer``'s ``proposal`` (the losslessness tests)."""
    picker = Picker(params, sampler.new_rng(1234))
    first, second = np.zeros(12, int), np.zeros(12, int)
    emitted: list[int] = []

    def emit(token: int) -> bool:
        emitted.append(token)
        return False

    prompt_cache = decoder.target.new_cache(16)
    anchor = picker.pick_and_accept(decoder.prefill(np.array([11, 10]), prompt_cache, state))
    for _ in range(trials):  # each trial continues from a copy of the prompt's cache and state
        emitted.clear()
        done = decoder.step(Lane(anchor, prompt_cache.copy(), state.copy(), picker, emit))
        assert done.record.proposer == proposer and done.record.ids.tolist() == proposal
        first[emitted[0]] += 1
        if done.accepted >= 1:
            second[emitted[1]] += 1
    return first, second


def test_the_suffix_proposer_emits_the_target_distribution():
    """Lossless with the suffix proposer: a target whose logits after the anchor are fixed random
    rows, a table that speculates nowhere (the draft never runs) and an index holding the prompt,
    the anchor and 7 tokens, the first of which the target gives about a quarter of the time:
    each trial's n-gram-only step verifies the suffix proposal, and its first emitted token ~
    warp(row 1) and, when the first proposed token was accepted, its second ~ warp(row 2).
    Pearson chi-square over 20,000 seeded trials; passes at p > 0.001 (deterministic: fixed
    seeds)."""
    rows = np.full((9, 12), -np.inf, dtype=np.float32)
    rows[0, 7] = 0.0  # the first token (the anchor) is 7
    rows[1:] = np.random.default_rng(3).standard_normal((8, 12)) * 0.5
    params = SamplingParams(temperature=0.8, top_k=5)  # 5 tokens keep mass: df = 4
    p1, p2 = sampler.warp(rows[1], params), sampler.warp(rows[2], params)
    proposal = [int(np.argsort(-p1)[1]), int(np.argsort(-p2)[0]), 0, 1, 2, 3, 4]
    target = ScriptTarget([], prompt_len=2, vocab=12, rows=rows)
    index = SuffixIndex(100)
    index.add([11, 10, 7, *proposal])
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), ngram=False, suffix=index,
                                 policy=plain_table(CHEAP))
    first, second = first_two_emitted(decoder, decoder.new_state(), params, "suffix", proposal)
    assert 0.15 < first[proposal[0]] / first.sum() < 0.5 and second.sum() > 3000  # both branches exercised
    assert chi_square_p_value(first, p1) > 0.001
    assert chi_square_p_value(second, p2) > 0.001


def suffix_engine(make_engine, **kw):
    """A scripted target that answers the 12 letters whatever the prompt, a random draft (its
    confidence is low), and a suffix index of 1000 tokens."""
    target = ScriptTarget(COPIED, prompt_len=14)
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, random_draft(target, taps=[0, 1]), suffix=SuffixIndex(1000), **kw))


QUESTION = list(range(20, 34))  # 14 tokens that do not hold the answer: prompt lookup finds nothing


def test_a_repeated_request_is_answered_from_the_suffix_index(make_engine):
    """The first request has only the draft (the index is empty, its prompt holds no letter); its
    prompt and answer then join the index. The second, the same: prefill gives a; step 1 matches
    the last 9 tokens (a pattern of at most 16 - 7) and proposes b .. h (probability 1, confidence
    the prior 0.5 each: 0.99 expected against the random draft's ~0), all accepted, bonus i; step 2
    proposes what the index holds after i: j, k, l, accepted, and max_tokens ends the output."""
    engine = suffix_engine(make_engine)
    first, second = (engine.submit(QUESTION, SamplingParams(max_tokens=12)).result() for _ in range(2))
    assert first.token_ids == second.token_ids == tuple(COPIED)
    assert first.stats.spec.counts("suffix").steps == first.stats.spec.counts("ngram").steps == 0
    d = second.stats.as_dict()
    assert {k: d[k] for k in ("spec_steps", "drafted_tokens", "accepted_tokens", "acceptance_length",
                              "draft_acceptance_length", "ngram_steps", "suffix_steps", "suffix_drafted_tokens",
                              "suffix_accepted_tokens", "suffix_acceptance_length")} == {
        "spec_steps": 2, "drafted_tokens": 10, "accepted_tokens": 10, "acceptance_length": 5.5,
        "draft_acceptance_length": None, "ngram_steps": 0, "suffix_steps": 2, "suffix_drafted_tokens": 10,
        "suffix_accepted_tokens": 10, "suffix_acceptance_length": 5.5}
    off = make_engine(ScriptTarget(COPIED, prompt_len=14), FakeTokenizer(vocab_size=300))
    assert off.submit(QUESTION, SamplingParams(max_tokens=12)).result().token_ids == second.token_ids


def test_seeded_sampled_suffix_proposals_equal_plain(make_engine):
    """Sampled at temperature 1 from the scripted target (the script's letter about 98.7% of the
    time): a repeated seeded request with suffix proposals gives an engine without a draft's
    tokens, and some suffix proposals were accepted."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    engine = suffix_engine(make_engine)
    first, second = (engine.submit(QUESTION, params).result() for _ in range(2))
    plain = make_engine(ScriptTarget(COPIED, prompt_len=14), FakeTokenizer(vocab_size=300))
    assert first.token_ids == second.token_ids == plain.submit(QUESTION, params).result().token_ids
    assert second.stats.spec.counts("suffix").accepted >= 1, second.stats.spec


def test_choose_takes_the_retrieval_proposal_expected_to_keep_most():
    """The draft's expected accepted tokens: 0.9 + 0.81; n-gram 1 + 0.8; suffix 1 + 0.9; a tie
    between the two goes to the earlier in the decoder's order."""
    draft = StepRecord(DRAFT[:2], 3, np.array([0.9, 0.9, 0.1], dtype=np.float32))
    ngram = Lookup(np.array([1, 2]), 2, np.array([1.0, 0.8], dtype=np.float32))
    suffix = Lookup(np.array([3, 4]), 5, np.array([1.0, 0.9], dtype=np.float32))
    got = choose(draft, {"ngram": ngram, "suffix": suffix})
    assert got.ids is suffix.ids and got.proposer == "suffix" and got.lookups == {"ngram": ngram, "suffix": suffix}
    assert choose(draft, {"ngram": suffix, "suffix": suffix._replace(ids=np.array([5, 6]))}).proposer == "ngram"
    assert choose(draft, {"ngram": NO_LOOKUP, "suffix": NO_LOOKUP}).proposer is None


# ---- grammar-aware proposals: cut at the first forbidden token, forced tokens at no draft cost -----

FAKE_GRAMMARS = GrammarCompiler(FakeTokenizer(vocab_size=300))
NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
               "additionalProperties": False}
ADA = [ord(c) for c in '{"name": "Ada"}']      # then EOS: the only token the grammar allows after '}'
BOT_ID = 258                                    # <|im_start|>: no JSON grammar allows it


def text_of(ids) -> str:
    return bytes(ids.tolist()).decode()


def json_engine(make_engine, script, **kw):
    """A scripted target that answers ``script`` (then EOS) to a 3-token prompt, without prompt
    lookup (its proposals would be exact but not hand-countable)."""
    target = ScriptTarget(script, prompt_len=3)
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, random_draft(target, taps=[0, 1]), ngram=False, **kw))


def submit_json(engine, params, schema=NAME_SCHEMA):
    return engine.submit([1, 2, 3], params, processors=[FAKE_GRAMMARS.processor(json_schema_grammar(schema))])


def records_of(engine) -> list:
    """The engine's steps (its ``on_step`` reports), as they come."""
    steps = []
    engine.on_step = steps.append
    return steps


def step_records(steps) -> list[tuple[str, list[bool], str | None, int]]:
    """Per decoding step: its verified text, which tokens were forced, its proposer, its K."""
    return [(text_of(d.ids), d.forced.tolist(), d.proposer, d.planned) for t in steps for d in t.records]


GRAMMAR_KEYS = ("spec_steps", "drafted_tokens", "accepted_tokens", "acceptance_length", "gated_steps",
                "forced_tokens", "forced_accepted_tokens", "draft_acceptance_length", "grammar_steps",
                "grammar_drafted_tokens", "grammar_accepted_tokens", "grammar_acceptance_length")


def test_forced_tokens_make_steps_where_the_table_speculates_nowhere(make_engine):
    """The table speculates nowhere (verify ratios of 1): the prefill gives '{'; step 1 verifies
    the 7 forced tokens '"name":' (of '"name": "', 7 rows at most) and the target adds ' '; step 2
    the forced '"', bonus 'A'; 'd', 'a' and '"' are plain steps (nothing forced inside the string,
    nor '"' after it, which could continue); the last the forced '}', bonus EOS. The draft never
    runs; the tokens, and their logprobs (0.0 for a forced token: the mask leaves it alone), are
    those of an engine without speculation."""
    target = ScriptTarget(ADA, prompt_len=3)
    draft = random_draft(target, taps=[0, 1])
    asked = count_draft_passes(draft)
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=SpeculativeDecoder(
        target, draft, policy=plain_table(CHEAP), ngram=False))
    steps = records_of(engine)
    params = SamplingParams(max_tokens=50, logprobs=True, top_logprobs=2)
    done = submit_json(engine, params).result()
    assert engine.idle(timeout=60)
    plain = submit_json(make_engine(ScriptTarget(ADA, prompt_len=3), FakeTokenizer(vocab_size=300)), params).result()
    assert done.token_ids == plain.token_ids == tuple(ADA) and done.finish_reason == "stop" and asked == []
    assert done.logprobs == plain.logprobs
    assert [lp.logprob for lp in done.logprobs[1:8]] == [0.0] * 7
    assert step_records(steps) == [('"name":', [True] * 7, "grammar", 0), ('"', [True], "grammar", 0),
                                   ("", [], None, 0), ("", [], None, 0), ("", [], None, 0),
                                   ("}", [True], "grammar", 0)]
    d = done.stats.as_dict()
    assert {k: d[k] for k in GRAMMAR_KEYS} == {
        "spec_steps": 3, "drafted_tokens": 9, "accepted_tokens": 9, "acceptance_length": 4.0, "gated_steps": 0,
        "forced_tokens": 9, "forced_accepted_tokens": 9, "draft_acceptance_length": None, "grammar_steps": 3,
        "grammar_drafted_tokens": 9, "grammar_accepted_tokens": 9, "grammar_acceptance_length": 4.0}


def test_forced_tokens_join_the_drafts_proposal_and_are_counted_apart(make_engine):
    """The draft replays the answer (K = 7 every step): step 1's proposal '"name":' is all forced
    (a "grammar" step, though the draft drafted the same); step 2's '"Ada"}' and EOS has '"' and
    '}' forced among the draft's own tokens (a draft step); EOS ends the output inside it."""
    truth = (lambda p: ADA[p - 3] if p - 3 < len(ADA) else EOS)
    engine = json_engine(make_engine, ADA, proposer=replay_proposer(truth, 300))
    steps = records_of(engine)
    done = submit_json(engine, SamplingParams(max_tokens=50)).result()
    assert done.token_ids == tuple(ADA) and done.finish_reason == "stop"
    assert [(d.ids.tolist(), d.forced.tolist(), d.proposer, d.planned) for t in steps for d in t.records] == [
        (ADA[1:8], [True] * 7, "grammar", 7),
        ([*ADA[9:], EOS], [True, False, False, False, False, True, False], None, 7)]
    s = done.stats.spec
    grammar, draft = s.counts("grammar"), s.counts("draft")
    assert (grammar.steps, grammar.drafted, grammar.accepted, grammar.emitted, grammar.forced) == (1, 7, 7, 8, 7)
    assert (draft.steps, draft.drafted, draft.accepted, draft.emitted, draft.forced, draft.forced_accepted) == (
        1, 7, 7, 7, 2, 2)
    assert (s.forced, s.forced_accepted) == (9, 9)


@pytest.mark.parametrize("j", range(6))
def test_a_proposal_is_cut_at_the_first_token_the_grammar_forbids(make_engine, j):
    """The draft replays '{"name": "abcdefgh"}' but drafts BOT at output 9 + j. Step 2, from the
    anchor ' ', proposes outputs 9 .. 15 ('"abcdef'): cut at its token j, it verifies j tokens
    (j + 1 target rows, not 8), all kept, and the target's own token after them; at j = 0 the
    forced '"' takes BOT's place (a "grammar" step of one token). The answer is the script."""
    script = [ord(c) for c in '{"name": "abcdefgh"}']
    truth = (lambda p: script[p - 3] if p - 3 < len(script) else EOS)
    target = ScriptTarget(script, prompt_len=3)
    rows = []
    forward_batch = target.forward_batch
    target.forward_batch = lambda token_rows, caches, **kw: rows.extend(len(r) for r in token_rows) or forward_batch(
        token_rows, caches, **kw)
    bad = replay_proposer(truth, 300)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), ngram=False, proposer=lambda c, a, start: [
        BOT_ID if p == 3 + 9 + j else t for p, t in zip(range(start + 1, start + 8), bad(c, a, start))])
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder)
    steps = records_of(engine)
    done = submit_json(engine, SamplingParams(max_tokens=50)).result()
    assert done.token_ids == tuple(script)
    second = [d for t in steps for d in t.records][1]
    want = max(j, 1)
    assert second.ids.tolist() == script[9:9 + want] and second.forced.tolist() == [True] + [False] * (want - 1)
    assert second.proposer == ("grammar" if j <= 1 else None)
    assert rows[:3] == [3, 8, want + 1]  # the prompt, step 1 (7 forced), step 2
    assert done.stats.spec.counts("grammar").steps == 1 + (j <= 1)  # j <= 1: step 2 verifies the forced '"' alone


CUSTOMER = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 6},
    "preferred_contact_method": {"enum": ["email", "telephone"]},
    "number_of_previous_orders": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["customer_full_name", "preferred_contact_method", "number_of_previous_orders"],
    "additionalProperties": False}


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=120),
                                    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=120)],
                         ids=["greedy", "sampled"])
def test_grammar_aware_proposals_equal_plain_decoding_on_a_tiny_model(make_engine, tiny, params):
    """A tiny random model held to a schema of long keys (each forced, one byte a token): with the
    draft every step (K = 7) and with forced-only steps where a table speculates nowhere, the
    tokens are plain decoding's (greedy and seeded); steps of forced tokens alone ran, and kept
    every forced token they verified."""
    tok = FakeTokenizer(vocab_size=300)
    want = submit_json(make_engine(tiny, tok), params, CUSTOMER).result()
    json.loads(want.text)
    for policy in (ALWAYS_SPECULATE, plain_table(CHEAP)):
        decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]), policy=policy)
        got = submit_json(make_engine(tiny, tok, speculative=decoder), params, CUSTOMER).result()
        assert got.token_ids == want.token_ids
        grammar = got.stats.spec.counts("grammar")
        assert grammar.steps >= 3 and grammar.accepted == grammar.drafted == grammar.forced, got.stats.spec


def test_grammar_aware_proposals_emit_the_target_distribution():
    """Lossless with forced tokens: two letters in a JSON array ('["c", "d"]'), a target whose
    logits are fixed random rows, and a stand-in draft that proposes '"', a letter the target gives
    about a quarter of the time, '", "' and its likeliest letter: the grammar forces the quotes
    and separators (rows 0, 2 .. 5), which are kept in every trial that reaches them, and the
    first letter ~ warp(masked row 2) and, when the proposed one was kept, the second ~
    warp(masked row 7). Pearson chi-square over 20,000 seeded trials; passes at p > 0.001
    (deterministic: fixed seeds)."""
    rows = (np.random.default_rng(3).standard_normal((10, 300)) * 0.5).astype(np.float32)
    params = SamplingParams(temperature=0.8)  # the grammar leaves 5 letters: df = 4
    grammar = json_schema_grammar({"type": "array", "items": {"enum": list("cdefg")}, "minItems": 2, "maxItems": 2})

    def masked(row):
        out = np.full(300, -np.inf, dtype=np.float32)
        out[ord("c"):ord("g") + 1] = row[ord("c"):ord("g") + 1]
        return sampler.warp(out, params)

    p1, p2 = masked(rows[2]), masked(rows[7])
    proposal = [ord(c) for c in '"?", "?']
    proposal[1], proposal[6] = int(np.argsort(-p1)[1]), int(np.argmax(p2))
    target = ScriptTarget([], prompt_len=3, rows=rows)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), ngram=False,
                                 proposer=lambda cache, anchor, start: np.array(proposal))
    rng = sampler.new_rng(1234)
    emitted: list[int] = []

    def emit(token: int) -> bool:
        emitted.append(token)
        return False

    def picker() -> Picker:  # the request's picker, its grammar past the first token
        p = Picker(params, rng, [FAKE_GRAMMARS.processor(grammar)])
        p.accept(ord("["))
        return p

    prompt_cache, prompt_state = target.new_cache(16), decoder.new_state()
    prompt_logits = decoder.prefill(np.array([1, 2, 3]), prompt_cache, prompt_state)
    assert Picker(params, sampler.new_rng(0), [FAKE_GRAMMARS.processor(grammar)]).pick(prompt_logits) == ord("[")
    first, second = np.zeros(300, int), np.zeros(300, int)
    for _ in range(20_000):  # each trial continues from a copy of the prompt's cache and state
        emitted.clear()
        done = decoder.step(Lane(ord("["), prompt_cache.copy(), prompt_state.copy(), picker(), emit))
        assert done.record.ids.tolist() == proposal and done.record.forced.tolist() == [True, False, *[True] * 4, False]
        assert emitted[0] == ord('"')
        first[emitted[1]] += 1
        if done.accepted >= 2:
            assert emitted[2:6] == [ord(c) for c in '", "']
            second[emitted[6]] += 1
        if done.accepted == 7:
            assert emitted[7] == ord('"')  # the bonus: forced too
    assert 0.15 < first[proposal[1]] / first.sum() < 0.5 and second.sum() > 3000  # both branches exercised
    assert chi_square_p_value(first, p1) > 0.001
    assert chi_square_p_value(second, p2) > 0.001
