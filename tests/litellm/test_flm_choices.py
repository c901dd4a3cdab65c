"""``n`` choices and a ``length`` cut inside a character, on the real embedded model through
litellm's public API, with and without the DFlash draft.

The independent side of each comparison is the engine driven directly: one-choice requests with
the seed ``sampler.choice_seed`` gives each choice, and the token bytes of a longer greedy run.
"""

from __future__ import annotations

import litellm
import pytest

from flm_runtime.api import get_engine
from flm_runtime.sampling.sampler import choice_seed
from stream_choices import joined_choices

QUESTION = [{"role": "user", "content": "Name a colour and say why you like it."}]
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 16, "seed": 1234}


@pytest.fixture(scope="module", params=["smollm2:135m", "smollm2-dflash:135m"])
def tag(request, smollm2_gguf) -> str:
    get_engine(request.param)  # loaded once per module
    return request.param


def prompt_ids(engine, messages):
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def alone(tag: str, seed: int | None, **fields):
    """The engine's one-choice answer to QUESTION with ``seed``."""
    engine = get_engine(tag)
    params = engine.sampling_params(**{**fields, "seed": seed})
    return engine.submit(prompt_ids(engine, QUESTION), params, timeout=300).result()


def test_a_seeded_request_gives_the_same_choices_each_time(tag):
    first, second = (litellm.completion(model=f"flm/{tag}", messages=QUESTION, n=3, **SAMPLED) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in second.choices] == texts
    assert len(set(texts)) == 3  # sampled: the choices differ
    fields = {k: v for k, v in SAMPLED.items() if k != "seed"}
    singles = [alone(tag, choice_seed(SAMPLED["seed"], i), **fields) for i in range(3)]
    assert texts == [s.text for s in singles]  # choice i is the one-choice request seeded choice_seed(seed, i)
    assert [c.finish_reason for c in first.choices] == [s.finish_reason for s in singles]
    # The prompt is counted once; every choice's tokens are.
    assert first.usage.prompt_tokens == len(prompt_ids(get_engine(tag), QUESTION))
    assert first.usage.completion_tokens == sum(s.completion_tokens for s in singles)
    assert [s["prompt_tokens"] for s in first._hidden_params["flm_stats"]] == [first.usage.prompt_tokens] * 3


def test_greedy_choices_are_the_one_choice_answer(tag):
    r = litellm.completion(model=f"flm/{tag}", messages=QUESTION, n=3, temperature=0, max_tokens=16)
    one = alone(tag, None, temperature=0.0, max_tokens=16)
    assert [c.message.content for c in r.choices] == [one.text] * 3
    assert r.usage.completion_tokens == 3 * one.completion_tokens


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_stream_of_choices_equals_the_choices(tag, asynchronous):
    want = litellm.completion(model=f"flm/{tag}", messages=QUESTION, n=3, **SAMPLED)
    kw = dict(model=f"flm/{tag}", messages=QUESTION, n=3, stream=True, stream_options={"include_usage": True},
              **SAMPLED)
    chunks = [c async for c in await litellm.acompletion(**kw)] if asynchronous else list(litellm.completion(**kw))
    texts, finishes = joined_choices(chunks)
    assert texts == {c.index: c.message.content for c in want.choices}
    assert finishes == {c.index: c.finish_reason for c in want.choices}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens)


EMOJI = [{"role": "user", "content": "Reply with three emoji."}]


def test_a_length_cut_inside_an_emoji_ends_at_the_last_whole_one(smollm2_gguf):
    """Greedy, the answer is a run of 4-byte emoji of 2 tokens each; 64 tokens end half-way
    through one. The text ends at the last whole emoji; the half-emoji token was generated, so it
    is counted."""
    engine = get_engine("smollm2:135m")
    longer = engine.submit(prompt_ids(engine, EMOJI), engine.sampling_params(temperature=0.0, max_tokens=80)).result()
    cut = b"".join(engine.tokenizer.token_bytes(t) for t in longer.token_ids[:64])
    want = longer.text.encode()[: len(cut)].decode("utf-8", errors="ignore")  # drops the unfinished tail only
    assert len(want.encode()) < len(cut) and want.endswith("\N{GLOWING STAR}")
    r = litellm.completion(model="flm/smollm2:135m", messages=EMOJI, temperature=0, max_tokens=64, logprobs=True)
    assert r.choices[0].message.content == want
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 64)
    assert bytes(b for entry in r.choices[0].logprobs.content for b in entry.bytes) == cut  # past the text
    streamed = litellm.completion(model="flm/smollm2:135m", messages=EMOJI, temperature=0, max_tokens=64, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
