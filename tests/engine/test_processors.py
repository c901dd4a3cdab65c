"""Penalties, logit bias and logprobs: exact values on hand-built logits (computed from the
definitions), and the same tokens and values through plain decoding, speculative decoding (forced
on, with long acceptances) and batches, streamed or not."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from engine_fakes import EOS, FakeTokenizer
from spec_fakes import PROMPT, ScriptTarget, random_draft, replay_proposer

from flm_runtime.backends import prefill
from flm_runtime.errors import InvalidRequestError
from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.sampling.picker import Picker
from flm_runtime.sampling.processors import FrequencyPresencePenalty, LogitBias, RepetitionPenalty, request_processors
from flm_runtime.speculation.speculative import SpeculativeDecoder

X = np.array([2.0, -1.0, 0.5, 0.0, 3.0], dtype=np.float32)  # binary fractions: the expected values are exact
GENERATED = [2, 2, 4]                                        # c = [0, 0, 2, 0, 1]


def processed(processor, accepted=GENERATED) -> np.ndarray:
    for token in accepted:
        processor.accept(token)
    return processor.process(X.copy())


# ---- the definitions, on hand-built logits ----------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # prompt [0, 1] and output 2, 2, 4: seen {0, 1, 2, 4}, each once; 3 unseen.
    got = processed(RepetitionPenalty(2.0, np.array([0, 1])))
    np.testing.assert_array_equal(got, [2.0 / 2, -1.0 * 2, 0.5 / 2, 0.0, 3.0 / 2])


def test_frequency_and_presence_penalties_count_the_generated_tokens_only():
    # x - c * frequency - (c > 0) * presence, c over the output; the prompt does not count.
    got = processed(FrequencyPresencePenalty(presence_penalty=0.5, frequency_penalty=0.25))
    np.testing.assert_array_equal(got, [2.0, -1.0, 0.5 - 2 * 0.25 - 0.5, 0.0, 3.0 - 1 * 0.25 - 0.5])


def test_negative_penalties_encourage_repeating():
    got = processed(FrequencyPresencePenalty(presence_penalty=-1.0, frequency_penalty=-0.5))
    np.testing.assert_array_equal(got, [2.0, -1.0, 0.5 + 2 * 0.5 + 1.0, 0.0, 3.0 + 0.5 + 1.0])


def test_logit_bias_adds_its_values():
    np.testing.assert_array_equal(processed(LogitBias({3: 1.5, 0: -100.0})), [-98.0, -1.0, 0.5, 1.5, 3.0])


def test_a_request_applies_bias_then_repetition_then_frequency_and_presence():
    """All four, through the request's picker: bias [2, -1, .5, 1.5, 3] -> repetition
    [1, -2, .25, 1.5, 1.5] -> frequency/presence [1, -2, .25 - .5 - .5, 1.5, 1.5 - .25 - .5]. Greedy
    picks the processed argmax (3, where the raw argmax is 4), and its logprobs are the
    log-softmax of the processed logits."""
    params = SamplingParams(logit_bias={3: 1.5}, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25, logprobs=True, top_logprobs=5)
    picker = Picker(params, sampler.new_rng(0), request_processors(params, np.array([0, 1]), 5))
    for token in GENERATED:
        picker.accept(token)
    want = np.array([1.0, -2.0, -0.75, 1.5, 0.75])
    log_softmax = want - math.log(np.exp(want).sum())
    assert picker.pick(X) == 3
    [record] = picker.pop_logprobs([3])
    assert record.token_id == 3 and record.logprob == pytest.approx(log_softmax[3], abs=1e-6)
    assert [t for t, _ in record.top] == [3, 0, 4, 2, 1]
    np.testing.assert_allclose([lp for _, lp in record.top], log_softmax[[3, 0, 4, 2, 1]], atol=1e-6)


def test_neutral_parameters_make_no_processor():
    params = SamplingParams(temperature=0.7, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                            logit_bias={})
    assert request_processors(params, np.array(PROMPT), 300) == []


def test_logit_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 300\): \[300\]") as e:
        request_processors(SamplingParams(logit_bias={5: 1.0, 300: -1.0}), np.array(PROMPT), 300)
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize("field, value, param", [
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -2.01, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("repetition_penalty", float("inf"), "repetition_penalty"),
    ("logit_bias", {5: 100.5}, "logit_bias"), ("logit_bias", {-1: 1.0}, "logit_bias"),
    ("logit_bias", {"5": 1.0}, "logit_bias"), ("logit_bias", [5], "logit_bias"),
    ("top_logprobs", 21, "top_logprobs"), ("top_logprobs", 3, "top_logprobs"),  # the latter without logprobs
    ("logprobs", 1, "logprobs"),
])
def test_out_of_range_values_name_the_parameter(field, value, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == param


# ---- logprobs of a position -------------------------------------------------------------------

Z = np.array([0.0, math.log(2), math.log(4), math.log(8), -np.inf, -50.0], dtype=np.float32)


def test_greedy_logprobs_are_the_log_softmax_and_draw_nothing():
    rng = sampler.new_rng(0)
    before = rng.bit_generator.state
    token, record = sampler.sample_with_logprob(Z, SamplingParams(), rng, top_n=2)
    assert token == 3 and rng.bit_generator.state == before
    total = 1 + 2 + 4 + 8 + math.exp(-50)
    assert record.logprob == pytest.approx(math.log(8 / total), abs=1e-6)
    assert [t for t, _ in record.top] == [3, 2]
    assert record.top[1][1] == pytest.approx(math.log(4 / total), abs=1e-6)


@pytest.mark.parametrize("temperature, weights", [(1.0, [2, 4, 8]), (0.5, [4, 16, 64])])
def test_sampled_logprobs_are_the_warped_distribution(temperature, weights):
    """top_k=3 keeps tokens 1-3 (weights ``exp(z / T)``); the 5 most likely are those, then the
    filtered-out ones by logit (0 before 5; 4 is impossible) at -inf. The token is ``sample``'s:
    the same single draw."""
    params = SamplingParams(temperature=temperature, top_k=3, seed=9)
    for seed in range(20):
        rng, twin = sampler.new_rng(seed), sampler.new_rng(seed)
        token, record = sampler.sample_with_logprob(Z, params, rng, top_n=5)
        assert token == sampler.sample(Z, params, twin) and rng.random() == twin.random()
        probs = dict(zip([1, 2, 3], np.array(weights) / sum(weights)))
        assert record.token_id == token and record.logprob == pytest.approx(math.log(probs[token]), abs=1e-6)
        assert [t for t, _ in record.top] == [3, 2, 1, 0, 5]
        np.testing.assert_allclose([lp for _, lp in record.top[:3]], np.log([probs[3], probs[2], probs[1]]),
                                   atol=1e-6)
        assert record.top[3][1] == record.top[4][1] == -np.inf


# ---- through the engine: speculative vs plain, batched vs alone, streamed vs not ---------------

def assert_same(got, want):
    """Same tokens, and logprobs equal within 1e-4 (the ids of the top lists exactly)."""
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert len(got.logprobs) == len(want.logprobs) == got.completion_tokens
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose([g.logprob, *(lp for _, lp in g.top)], [w.logprob, *(lp for _, lp in w.top)],
                                   atol=1e-4)


PENALISED = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={7: 5.0, 140: -100.0},
                 logprobs=True, top_logprobs=5, max_tokens=40, ignore_eos=True)
GREEDY = SamplingParams(**PENALISED)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7, **PENALISED)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposer", ["random", "replay"])
def test_speculative_equals_plain_with_penalties_bias_and_logprobs(make_engine, tiny, params, proposer):
    """Speculation forced on (the default policy verifies whole blocks at every step): the same
    tokens and logprobs as plain decoding, with a random draft (AL ~ 1) and with one replaying
    the plain output with every third position wrong (long acceptances: rows verified with the
    penalties' state after the tokens drafted before them)."""
    tok = FakeTokenizer(vocab_size=300)
    want = make_engine(tiny, tok).submit(PROMPT, params).result()
    truth = dict(enumerate(want.token_ids, start=len(PROMPT)))
    replay = replay_proposer(lambda p: truth.get(p, 0), 300, corrupt=lambda p: p % 3 == 0)
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2]),
                                 proposer=replay if proposer == "replay" else None)
    got = make_engine(tiny, tok, speculative=decoder).submit(PROMPT, params).result()
    assert_same(got, want)
    assert 140 not in got.token_ids
    al = got.stats.spec.acceptance_length
    assert (al > 2.0) if proposer == "replay" else (1.0 <= al < 1.5), al


def test_penalties_change_the_output(make_engine, tiny):
    """The same request without penalties and bias gives other tokens (the test above compares
    something the processors shaped); with a large repetition penalty no token repeats soon."""
    tok = FakeTokenizer(vocab_size=300)
    engine = make_engine(tiny, tok)
    base = dict(max_tokens=40, ignore_eos=True)
    plain = engine.submit(PROMPT, SamplingParams(**base)).result().token_ids
    assert plain != engine.submit(PROMPT, GREEDY).result().token_ids
    assert len(set(plain)) < 40  # the tiny model repeats itself greedily
    strong = engine.submit(PROMPT, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, **base)).result()
    assert len(set(strong.token_ids)) > len(set(plain))


def test_a_bias_of_minus_100_removes_the_greedy_token(make_engine, tiny):
    tok = FakeTokenizer(vocab_size=300)
    engine = make_engine(tiny, tok)
    first = prefill(tiny, np.array(PROMPT), tiny.new_cache(len(PROMPT))).logits  # [V] of the first position
    top, second = np.argsort(-first, kind="stable")[:2]
    base = engine.submit(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)).result().token_ids
    assert base[0] == top
    banned = engine.submit(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={int(top): -100})).result()
    assert banned.token_ids[0] == second and top not in banned.token_ids


def test_batched_equals_alone(make_engine, tiny):
    """Four requests with their own processors and seeds, decoding speculatively in the same
    passes, give each the tokens and logprobs it gives alone."""
    tok = FakeTokenizer(vocab_size=300)
    engine = make_engine(tiny, tok, speculative=SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2])))
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:], [9, 9, 9]]
    params = [GREEDY, SAMPLED, SamplingParams(repetition_penalty=0.8, logprobs=True, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, logit_bias={5: 3.0}, logprobs=True, top_logprobs=20,
                             max_tokens=30, ignore_eos=True)]
    alone = [engine.submit(p, q).result() for p, q in zip(prompts, params)]
    with engine.held():  # all queued before the first step
        handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
    for handle, want in zip(handles, alone):
        assert_same(handle.result(), want)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_each_choice_has_its_own_processors_and_logprobs(make_engine, tiny, speculative):
    """``n`` = 3 with penalties, bias and logprobs: each choice's penalties count its own tokens
    (shared state would change the others' tokens), and choice ``i`` gives the tokens and logprobs
    of the one-choice request seeded ``choice_seed(seed, i)``."""
    tok = FakeTokenizer(vocab_size=300)
    decoder = SpeculativeDecoder(tiny, random_draft(tiny, taps=[0, 2])) if speculative else None
    engine = make_engine(tiny, tok, speculative=decoder)
    choices = [h.result() for h in engine.submit_choices(PROMPT, SAMPLED, 3)]
    alone = [engine.submit(PROMPT, dataclasses.replace(SAMPLED, seed=sampler.choice_seed(SAMPLED.seed, i))).result()
             for i in range(3)]
    assert len({done.token_ids for done in choices}) == 3
    for got, want in zip(choices, alone):
        assert_same(got, want)  # one entry per delivered token, each choice its own


def script_engine(make_engine, script):
    target = ScriptTarget(script, 3)
    truth = (lambda p: script[p - 3] if p - 3 < len(script) else EOS)
    decoder = SpeculativeDecoder(target, random_draft(target, taps=[0, 1]), proposer=replay_proposer(truth, 300))
    return make_engine(target, FakeTokenizer(vocab_size=300), speculative=decoder)


# ScriptTarget's rows are one-hot logits of 10.0 over 300 tokens.
SCRIPT_LOGPROB = 10.0 - math.log(math.exp(10.0) + 299)


@pytest.mark.parametrize("stop, max_tokens, text", [((), 50, "abcd"), (("c",), 50, "ab"), ((), 3, "abc")])
def test_stopped_and_trimmed_tokens_get_no_entries_streamed_or_not(make_engine, stop, max_tokens, text):
    """EOS after "abcd" (not delivered), a stop string, max_tokens inside a block: one entry per
    delivered token, the stream's entries joined equal the result's."""
    script = [ord(c) for c in "abcd"] + [EOS] + [ord(c) for c in "efgh"]
    engine = script_engine(make_engine, script)
    params = SamplingParams(stop=stop, max_tokens=max_tokens, logprobs=True, top_logprobs=2)
    handle = engine.submit([1, 2, 3], params)
    events = list(handle)
    done = handle.result()
    assert done.text == text and done.completion_tokens == len(text) == len(done.logprobs)
    assert all(len(e.logprobs) == len(e.token_ids) for e in events)
    assert tuple(r for e in events for r in e.logprobs) == done.logprobs
    assert [r.token_id for r in done.logprobs] == [ord(c) for c in text]
    for r in done.logprobs:
        assert r.logprob == pytest.approx(SCRIPT_LOGPROB, abs=1e-6)
        assert r.top == ((r.token_id, r.logprob), (0, pytest.approx(-10.0 + SCRIPT_LOGPROB, abs=1e-6)))


def test_without_logprobs_nothing_is_recorded(make_engine):
    engine = script_engine(make_engine, [ord(c) for c in "abc"])
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=3))
    assert all(e.logprobs is None for e in handle) and handle.result().logprobs is None
