"""Logprobs, penalties and logit_bias through ``litellm.completion`` on the real embedded model,
plain (``smollm2:135m``) and with speculation forced on (``smollm2-dflash:135m`` with a policy
table that speculates at every step): OpenAI's shape, streamed and not, the same tokens and values
on both tags, and values equal to the log-softmax of the model's own logits computed here."""

from __future__ import annotations

import asyncio

import litellm
import numpy as np
import pytest

from flm_runtime.backends import decode, prefill
from flm_runtime.sampling.sampler import choice_seed

MODEL = "flm/smollm2:135m"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 12
LOGPROBS = {"logprobs": True, "top_logprobs": 5, "max_tokens": MAX_TOKENS}
PENALISED = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "extra_body": {"repetition_penalty": 1.2}}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}


def content(response, index: int = 0) -> list[dict]:
    return [e.model_dump() for e in response.choices[index].logprobs.content]


def streamed(chunks, index: int = 0) -> tuple[str, list[dict]]:
    """The text and the logprobs entries of choice ``index`` in a stream's chunks, in order."""
    text, entries = "", []
    for c in chunks:
        for choice in c.choices:
            if choice.index != index:
                continue
            text += choice.delta.content or ""
            lp = choice.logprobs
            if lp is not None:
                entries += [e if isinstance(e, dict) else e.model_dump()
                            for e in (lp["content"] if isinstance(lp, dict) else lp.content)]
    return text, entries


def assert_same_entries(got: list[dict], want: list[dict]) -> None:
    """Same tokens (and top tokens), log-probabilities within 1e-4."""
    def tokens(entries):
        return [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in entries]

    def values(entries):
        return [[e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in entries]

    assert tokens(got) == tokens(want)
    np.testing.assert_allclose(values(got), values(want), atol=1e-4)


@pytest.fixture(scope="module")
def greedy(smollm2_engine):
    return litellm.completion(model=MODEL, messages=QUESTION, temperature=0, **LOGPROBS)


def test_openai_shape_and_one_entry_per_completion_token(greedy, smollm2_engine):
    entries = content(greedy)
    assert len(entries) == greedy.usage.completion_tokens == MAX_TOKENS
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == greedy.choices[0].message.content
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 5
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen token is the most likely
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and tops[0] == e["logprob"] < 0


def test_greedy_values_are_the_log_softmax_of_the_model_logits(greedy, smollm2_engine, smollm2_model):
    """Recomputed here from the target itself: prefill the chat prompt, decode the delivered tokens."""
    tok = smollm2_engine.tokenizer
    ids = np.array(tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True)))
    cache = smollm2_model.new_cache(len(ids) + MAX_TOKENS)
    logits = prefill(smollm2_model, ids, cache).logits
    for e in content(greedy):
        z = logits.astype(np.float64)
        logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        token = int(np.argmax(z))
        assert tok.token_bytes(token) == bytes(e["bytes"])
        assert e["logprob"] == pytest.approx(logp[token], abs=1e-4)
        top5 = np.argsort(-logp, kind="stable")[:5]
        assert [t["bytes"] for t in e["top_logprobs"]] == [list(tok.token_bytes(int(t))) for t in top5]
        np.testing.assert_allclose([t["logprob"] for t in e["top_logprobs"]], logp[top5], atol=1e-4)
        logits = decode(smollm2_model, token, cache).logits


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
def test_stream_equals_non_stream(smollm2_engine, sampling):
    whole = litellm.completion(model=MODEL, messages=QUESTION, **PENALISED, **sampling, **LOGPROBS)
    text, entries = streamed(litellm.completion(model=MODEL, messages=QUESTION, stream=True, **PENALISED, **sampling,
                                                **LOGPROBS))
    assert text == whole.choices[0].message.content
    assert_same_entries(entries, content(whole))


def test_async_stream_equals_non_stream(greedy):
    async def run():
        stream = await litellm.acompletion(model=MODEL, messages=QUESTION, temperature=0, stream=True, **LOGPROBS)
        return [c async for c in stream]

    text, entries = streamed(asyncio.run(run()))
    assert text == greedy.choices[0].message.content
    assert_same_entries(entries, content(greedy))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, SAMPLED], ids=["greedy", "sampled"])
def test_speculative_tag_gives_the_same_tokens_and_values(smollm2_engine, speculation_forced, sampling):
    """Penalties, bias and logprobs on the DFlash tag, speculating at every step: the plain tag's
    tokens and logprobs (within 1e-4)."""
    bias = {"logit_bias": {"28": 2.0, "314": -3.0}}
    plain = litellm.completion(model=MODEL, messages=QUESTION, **PENALISED, **bias, **sampling, **LOGPROBS)
    spec = litellm.completion(model=speculation_forced, messages=QUESTION, **PENALISED, **bias, **sampling, **LOGPROBS)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert_same_entries(content(spec), content(plain))
    stats = spec._hidden_params["flm_stats"]
    assert stats["spec_steps"] >= 1 and stats["drafted_tokens"] == 7 * stats["spec_steps"]
    assert stats["accepted_tokens"] >= 1  # rows past the first of a block were verified and kept


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_of_n_choices_has_its_own_penalties_and_logprobs(smollm2_engine, stream):
    """``n=3`` with a presence penalty and ``top_logprobs=2``: each choice's entries are as many as
    its completion tokens, and choice ``i`` is the one-choice request seeded ``choice_seed(seed,
    i)`` with the same penalty: the same text, tokens and top tokens, values within 1e-4. Streamed,
    each choice's text and entries come under its own index."""
    ask = dict(model=MODEL, messages=QUESTION, temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS,
               presence_penalty=0.8, logprobs=True, top_logprobs=2)
    seed = SAMPLED["seed"]
    singles = [litellm.completion(**ask, seed=choice_seed(seed, i)) for i in range(3)]
    if stream:
        chunks = list(litellm.completion(**ask, n=3, seed=seed, stream=True, stream_options={"include_usage": True}))
        got = [streamed(chunks, i) for i in range(3)]
        assert chunks[-1].usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    else:
        r = litellm.completion(**ask, n=3, seed=seed)
        assert [c.index for c in r.choices] == [0, 1, 2]
        got = [(c.message.content, content(r, c.index)) for c in r.choices]
        assert r.usage.completion_tokens == sum(len(entries) for _, entries in got)
    assert len({text for text, _ in got}) == 3  # sampled: the choices differ
    for (text, entries), single in zip(got, singles):
        assert len(entries) == single.usage.completion_tokens and all(len(e["top_logprobs"]) == 2 for e in entries)
        assert text == single.choices[0].message.content
        assert_same_entries(entries, content(single))


def test_a_bias_of_minus_100_removes_the_greedy_token(greedy, smollm2_engine):
    first = content(greedy)[0]
    [tok_id] = smollm2_engine.tokenizer.encode(first["token"])
    assert smollm2_engine.tokenizer.token_bytes(tok_id) == bytes(first["bytes"])
    r = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, logit_bias={str(tok_id): -100}, **LOGPROBS)
    entries = content(r)
    assert first["token"] not in [e["token"] for e in entries]
    assert entries[0]["token"] == first["top_logprobs"][1]["token"]  # the runner-up takes its place


def test_penalties_discourage_repeating(smollm2_engine):
    """A long list asked for greedily repeats tokens; strong presence and frequency penalties leave
    fewer repeated tokens."""
    ask = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    plain = litellm.completion(model=MODEL, messages=ask, temperature=0, max_tokens=24, logprobs=True)
    penalised = litellm.completion(model=MODEL, messages=ask, temperature=0, max_tokens=24, logprobs=True,
                                   presence_penalty=2.0, frequency_penalty=2.0)
    repeats = [len(r.choices[0].logprobs.content) - len({e.token for e in r.choices[0].logprobs.content})
               for r in (plain, penalised)]
    assert repeats[1] < repeats[0], repeats


@pytest.mark.parametrize("extra, name", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"logit_bias": {"42": 150}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # outside the vocabulary
])
def test_out_of_range_values_are_bad_requests_naming_them(smollm2_engine, extra, name):
    with pytest.raises(litellm.BadRequestError, match=name):
        litellm.completion(model=MODEL, messages=QUESTION, max_tokens=2, **extra)
