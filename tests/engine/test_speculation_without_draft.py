"""Speculation on a tag without a draft (``SpeculativeDecoder(target, None, ...)``): n-gram-only
steps of prompt lookup and of a request's predicted output, exact against plain decoding (greedy
and seeded sampled), a request that asks for plain decoding, steps priced by the batch they join,
and prefix caching beside them (the proposers see the cached prefix)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import EOS, FakeTokenizer
from spec_fakes import PROMPT, ScriptTarget, plain_generate, spec_generate
from test_speculative import chi_square_p_value, first_two_emitted

from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.scheduling.engine import Engine
from flm_runtime.speculation.policy import ALONE, PLAIN_STEP, Bucket, PassLoad, PolicyTable, paying_step
from flm_runtime.speculation.speculative import SpeculativeDecoder

LETTERS = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]
COPIED = LETTERS[:12]
CHEAP = [1.0] * 7  # a verify pass of any length costs a decode: the longest proposal pays best
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=11)


def lookup_table(verify_ratio: list[float], min_speedup: float = 1.1) -> PolicyTable:
    """What ``estimate.lookup_table`` builds from a host's curve: one bucket that never drafts."""
    return PolicyTable(model="t", backend="cpu", block_size=len(verify_ratio) + 1, min_speedup=min_speedup,
                       buckets=[Bucket(max_context=4096, speculate=False, verify_ratio=verify_ratio)])


def draftless(target, verify_ratio=CHEAP, **kw) -> SpeculativeDecoder:
    return SpeculativeDecoder(target, None, policy=lookup_table(verify_ratio), block_size=len(verify_ratio) + 1, **kw)


def script_engine(make_engine, prompt_len: int = 14, **kw) -> Engine:
    target = ScriptTarget(COPIED, prompt_len=prompt_len)
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=draftless(target, **kw))
    engine.steps = []
    engine.on_step = engine.steps.append
    return engine


def step_kinds(engine) -> list[tuple[int, str | None]]:
    """Each decoding step's verified tokens and proposer (once the engine is idle: a request's
    result can reach the caller before its last step's ``on_step``)."""
    assert engine.idle(timeout=60)
    return [(len(r.ids), r.proposer) for t in engine.steps for r in t.records]


def test_without_a_draft_prompt_lookup_takes_ngram_only_steps(make_engine):
    """Prefill gives a; step 1 finds no match ((l, a) occurs nowhere before) and decodes b; step 2
    matches (a, b) in the prompt: c .. i verified and accepted, bonus j; step 3 matches (g, h, i,
    j): k, l accepted, and max_tokens ends the output. No taps are asked for."""
    engine = script_engine(make_engine)
    done = engine.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result()
    assert done.token_ids == tuple(COPIED)
    assert step_kinds(engine) == [(0, None), (7, "ngram"), (7, "ngram")]
    s = done.stats.spec
    assert (s.counts("ngram").drafted, s.counts("ngram").accepted, s.counts("draft").steps) == (14, 9, 0)
    assert engine.speculative.taps == () and engine.speculative.draft is None


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_without_a_draft_the_tokens_are_plain_decodings(tiny, params):
    """A random model on a prompt that repeats itself: the speculative tokens are plain decoding's,
    greedy and seeded sampled; greedy, prompt lookup's proposals were verified (sampled from a
    random model, the output rarely repeats the prompt)."""
    prompt = PROMPT * 3
    out, _, state = spec_generate(draftless(tiny), prompt, 60, params, seed=3)
    assert out == plain_generate(tiny, prompt, 60, params, seed=3)
    assert state.draft_cache is None and (params.temperature or state.stats.counts("ngram").accepted >= 1)


def test_a_request_that_asks_for_plain_decoding_gets_no_speculative_step(make_engine):
    engine = script_engine(make_engine)
    done = engine.submit([1, 2, *COPIED], SamplingParams(max_tokens=12, speculation=False)).result()
    assert done.token_ids == tuple(COPIED)
    assert step_kinds(engine) == [(0, None)] * 11 and done.stats.spec.steps == 0


def test_a_predicted_output_is_verified_never_trusted(make_engine):
    """A prompt that holds none of the output, a prediction of it with one wrong token (z for e):
    step 1, aligned at the prediction's start, verifies b c d z f g h and keeps b c d, bonus e;
    e leaves the prediction and no n-gram of (c, d, e) is in it: f decodes plainly, and (e, f)
    neither; at g, (f, g) finds the prediction again: h .. l accepted, and max_tokens ends there.
    The output is the target's; prediction tokens count as the prediction proposer's."""
    engine = script_engine(make_engine)
    predicted = [*COPIED[:4], ord("z"), *COPIED[5:]]
    done = engine.submit([1] * 14, SamplingParams(max_tokens=12, prediction=tuple(predicted))).result()
    assert done.token_ids == tuple(COPIED)
    assert step_kinds(engine) == [(7, "prediction"), (0, None), (0, None), (5, "prediction")]
    p = done.stats.spec.counts("prediction")
    assert (p.steps, p.drafted, p.accepted, p.emitted) == (2, 12, 8, 9)


def test_a_predicted_output_keeps_the_target_distribution():
    """Lossless with the prediction proposer and no draft: a target whose logits after the anchor
    are fixed random rows, a prediction aligned at the anchor whose first token the target gives
    about a quarter of the time: each trial verifies it, and its first emitted token ~ warp(row 1)
    and, when that token was the predicted one, its second ~ warp(row 2). Pearson chi-square over
    20,000 seeded trials; passes at p > 0.001 (deterministic: fixed seeds)."""
    rows = np.full((9, 12), -np.inf, dtype=np.float32)
    rows[0, 7] = 0.0  # the first token (the anchor) is 7
    rows[1:] = np.random.default_rng(3).standard_normal((8, 12)) * 0.5
    params = SamplingParams(temperature=0.8, top_k=5)  # 5 tokens keep mass: df = 4
    p1, p2 = sampler.warp(rows[1], params), sampler.warp(rows[2], params)
    predicted = [int(np.argsort(-p1)[1]), int(np.argsort(-p2)[0]), 0, 1, 2, 3, 4]
    target = ScriptTarget([], prompt_len=2, vocab=12, rows=rows)
    decoder = draftless(target, ngram=False)
    first, second = first_two_emitted(decoder, decoder.new_state(prediction=(7, *predicted)), params, "prediction",
                                      predicted)
    assert 0.15 < first[predicted[0]] / first.sum() < 0.5 and second.sum() > 3000  # both branches exercised
    assert chi_square_p_value(first, p1) > 0.001
    assert chi_square_p_value(second, p2) > 0.001


def test_a_proposal_pays_less_the_fuller_the_pass():
    """A curve of a quarter decode per row: alone, 7 sure tokens are 8 tokens for 2.75 decodes; in
    a pass of 8 lanes they add 7 rows to 8 (2.75 -> 4.5 decodes) for 15 tokens instead of 8, which
    still pays (1.15x); in a pass of 32 the same rows barely pay for themselves (1.02x) and the
    step decodes plainly."""
    curve = [1.0 + 0.25 * n for n in range(1, 8)]
    sure = np.ones(7, dtype=np.float32)
    alone = paying_step(sure, curve, 1.1, ALONE)
    assert (alone.length, alone.speedup, alone.gained) == (7, 8 / 2.75, 7.0)
    eight = paying_step(sure, curve, 1.1, PassLoad(8, 8.0))
    assert eight.length == 7 and eight.speedup == pytest.approx(15 / 8 * 2.75 / 4.5)
    assert paying_step(sure, curve, 1.1, PassLoad(32, 32.0)) is PLAIN_STEP


def test_lanes_of_one_pass_price_their_proposals_against_the_rows_before_them(make_engine):
    """The copying request on a curve where a row costs a tenth of a decode: alone, its proposal
    at (a, b) pays, 2 tokens of it (1.75 tokens expected for 1.2 decodes); eight side by side, its proposals
    would slow all eight for 1 token more and each decodes plainly there; later, as their records
    learn, the first lanes' proposals pay and the rows they add leave the later lanes plain.
    Every output is the script."""
    curve = [1.0 + 0.1 * n for n in range(1, 8)]
    alone = script_engine(make_engine, verify_ratio=curve)
    assert alone.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)).result().token_ids == tuple(COPIED)
    assert [len(r.ids) for r in alone.steps[2].records] == [2]  # steps[0]: the prefill, no decoding lane
    batch = script_engine(make_engine, verify_ratio=curve)
    with batch.held():
        handles = [batch.submit([1, 2, *COPIED], SamplingParams(max_tokens=12)) for _ in range(8)]
    assert all(h.result().token_ids == tuple(COPIED) for h in handles)
    verified = [[len(r.ids) for r in t.records] for t in batch.steps[1:]]
    assert verified[1] == [0] * 8
    mixed = [v for v in verified if 0 < sum(n > 0 for n in v) < len(v)]
    assert mixed and all(v == sorted(v, reverse=True) for v in mixed), verified


def test_the_proposers_see_a_prefix_taken_from_the_cache(smollm2_quantized, smollm2_tokenizer):
    """The same code-copying request twice through an engine without a draft: the second takes its
    prompt's whole blocks from the prefix cache, and its proposers, told of the cached tokens,
    propose and keep what the first's did; both outputs are plain decoding's."""
    source = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 4
    prompt = np.array(smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this code exactly:\n" + source}], add_generation_prompt=True)))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = Engine(smollm2_quantized, smollm2_tokenizer, name="plain", prefix_cache=False)
    engine = Engine(smollm2_quantized, smollm2_tokenizer, name="lookup", speculative=draftless(smollm2_quantized))
    try:
        want = plain.submit(prompt, params).result().token_ids
        first, second = (engine.submit(prompt, params).result() for _ in range(2))
    finally:
        plain.close()
        engine.close()
    assert first.token_ids == second.token_ids == want
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens > len(prompt) // 2
    assert second.stats.spec.counts("ngram") == first.stats.spec.counts("ngram")
    assert first.stats.spec.counts("ngram").accepted > 0


def test_a_request_that_ends_inside_a_step_leaves_what_it_output_to_the_prefix_cache(make_engine):
    """A scripted target (made batch-invariant, so the prefix cache is on) that answers a b c EOS d
    e, a prompt that holds that answer: step 2 verifies c EOS d e .. from the prompt and accepts
    them, the output ends at EOS, and the cache, which holds d and e too, is trimmed to what the
    request fed before the prefix cache keeps it; the same request again takes its prompt from the
    cache and gets the same answer."""
    answer = [*COPIED[:3], EOS, *COPIED[3:6]]
    target = ScriptTarget(answer, prompt_len=40)
    target.batch_invariant = True
    engine = make_engine(target, FakeTokenizer(vocab_size=300), speculative=draftless(target))
    prompt = [*range(1, 34), *answer]
    first = engine.submit(prompt, SamplingParams(max_tokens=12)).result()
    again = engine.submit(prompt, SamplingParams(max_tokens=12)).result()
    assert first.token_ids == again.token_ids == tuple(COPIED[:3]) and first.finish_reason == "stop"
    assert first.stats.spec.counts("ngram").accepted >= 2 and again.stats.cached_tokens > 0
