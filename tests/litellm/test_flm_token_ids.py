"""vLLM's ``return_token_ids`` through ``litellm.completion`` on the embedded SmolLM2-135M: the
prompt's ids are the engine's encoding of the rendered chat, each choice's ids are the tokens the
engine delivered (as many as ``completion_tokens``: not the end-of-turn token, nor a stop string's
wholly-inside ones), streamed or not, with ``n`` choices, tool calls and a thought whose markers are
held back; an invalid value or a text completion is refused by name."""

from __future__ import annotations

import asyncio

import litellm
import pytest

from flm_runtime import SamplingParams, StreamEvent
from flm_runtime.sampling.sampler import choice_seed
from litellm_flm.llm import StreamChunks

from flm_fake_engine import TemplateTokenizer

MODEL = "flm/smollm2:135m"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
HI = [{"role": "user", "content": "Say hi."}]  # greedy: "Hello there! I'm here to help ..." (23 tokens)
IDS = {"extra_body": {"return_token_ids": True}}
# A template with a thinking switch, thinking unless told not to (Qwen3's way).
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}")
THOUGHT = "<think>\nIt is Paris.\n</think>\n\nParis."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def streamed_ids(chunks) -> tuple[list[int] | None, dict[int, list[int]]]:
    """The first chunk's ``prompt_token_ids`` and each choice's ``token_ids`` joined in order."""
    chunks = list(chunks)
    joined: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            joined.setdefault(choice.index, []).extend(getattr(choice, "token_ids", None) or [])
    return getattr(chunks[0], "prompt_token_ids", None), joined


def test_token_ids_are_the_engines_own_streamed_or_not(smollm2_engine):
    tok = smollm2_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))
    alone = smollm2_engine.submit(prompt, SamplingParams(temperature=0, max_tokens=16)).result()
    r = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, **IDS)
    assert r.prompt_token_ids == prompt
    assert r.choices[0].token_ids == list(alone.token_ids) and len(alone.token_ids) == 16
    assert tok.decode(r.choices[0].token_ids) == r.choices[0].message.content
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 16
    first, joined = streamed_ids(litellm.completion(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16,
                                                    stream=True, **IDS))
    assert (first, joined) == (prompt, {0: list(alone.token_ids)})


def test_each_of_n_sampled_choices_returns_its_own_tokens(smollm2_engine):
    ask = {"model": MODEL, "messages": QUESTION, "n": 2, "temperature": 0.9, "seed": 7, "max_tokens": 12, **IDS}
    r = litellm.completion(**ask)
    ids = [c.token_ids for c in r.choices]
    assert ids[0] != ids[1] and all(len(i) == 12 for i in ids)
    assert [smollm2_engine.tokenizer.decode(i) for i in ids] == [c.message.content for c in r.choices]
    _, joined = streamed_ids(litellm.completion(stream=True, **ask))
    assert joined == {0: ids[0], 1: ids[1]}


def test_a_tool_calls_tokens_are_returned_though_its_text_is_not_content(smollm2_engine):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
           "tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 60, **IDS}
    r = litellm.completion(**ask)
    [call] = r.choices[0].message.tool_calls
    text = smollm2_engine.tokenizer.decode(r.choices[0].token_ids)
    assert call.function.name == "get_weather" and call.function.arguments in text
    assert r.usage.completion_tokens == len(r.choices[0].token_ids)
    first, joined = streamed_ids(litellm.completion(stream=True, **ask))
    assert (first, joined) == (r.prompt_token_ids, {0: r.choices[0].token_ids})


def test_the_end_of_turn_token_is_not_returned_as_usage_does_not_count_it(smollm2_engine):
    """vLLM's ``token_ids`` end with the EOS token; ours are the delivered tokens (``completion_tokens``)."""
    tok = smollm2_engine.tokenizer
    ask = {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 40, **IDS}
    r = litellm.completion(**ask)
    ids = r.choices[0].token_ids
    assert r.choices[0].finish_reason == "stop"
    assert len(ids) == r.usage.completion_tokens < 40 and not set(ids) & tok.stop_token_ids
    assert tok.decode(ids) == r.choices[0].message.content
    assert streamed_ids(litellm.completion(stream=True, **ask)) == (r.prompt_token_ids, {0: ids})


@pytest.mark.parametrize("stop, content, beyond", [("there", "Hello ", "there"), (" there", "Hello", "")],
                         ids=["begins-inside-a-token", "whole-tokens"])
def test_a_stop_strings_tokens_are_returned_as_far_as_they_are_delivered(smollm2_engine, stop, content, beyond):
    """Greedy, the answer begins "Hello there!": the token " there" is delivered when the stop
    string begins inside it, not when it lies wholly inside the stop string."""
    ask = {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 8, "stop": [stop], **IDS}
    r = litellm.completion(**ask)
    ids = r.choices[0].token_ids
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("stop", content)
    assert len(ids) == r.usage.completion_tokens and smollm2_engine.tokenizer.decode(ids) == content + beyond
    assert streamed_ids(litellm.completion(stream=True, **ask)) == (r.prompt_token_ids, {0: ids})


def test_the_thinking_tokens_and_markers_held_back_are_returned(fake_engine):
    """The reasoning splitter holds the markers' text back; their tokens still ride, in order, so a
    thinking answer's ids (one character per token) join to the whole reply, streamed or not."""
    fake_engine.tokenizer = TemplateTokenizer(THINKING_TEMPLATE)
    fake_engine.reply = THOUGHT
    every = [ord(c) for c in THOUGHT]
    ask = {"model": MODEL, "messages": QUESTION, "n": 2, **IDS}
    r = litellm.completion(**ask)
    assert [(c.message.reasoning_content, c.message.content, c.token_ids) for c in r.choices] == [
        ("It is Paris.", "Paris.", every)] * 2
    assert streamed_ids(litellm.completion(stream=True, **ask))[1] == {0: every, 1: every}

    async def astream():
        return [chunk async for chunk in await litellm.acompletion(stream=True, **ask)]

    assert streamed_ids(asyncio.run(astream())) == (r.prompt_token_ids, {0: every, 1: every})


def test_the_prompt_ids_open_the_stream_when_a_choice_ends_before_any_text(fake_engine):
    """Choice 0 holds its start marker back while choice 1 ends at once with no token: a sibling's
    finish cannot carry the prompt's ids, so choice 1's role opens the stream with them."""
    fake_engine.tokenizer = TemplateTokenizer(THINKING_TEMPLATE)
    fake_engine.seeded_replies = {7: THOUGHT, choice_seed(7, 1): ""}
    ask = {"model": MODEL, "messages": QUESTION, "n": 2, "seed": 7, **IDS}
    prompt = litellm.completion(**ask).prompt_token_ids
    chunks = list(litellm.completion(stream=True, **ask))
    assert (chunks[0].choices[0].index, chunks[0].choices[0].delta.role) == (1, "assistant")
    assert streamed_ids(chunks) == (prompt, {0: [ord(c) for c in THOUGHT], 1: []})
    assert [c for c in chunks if getattr(c, "prompt_token_ids", None) is not None] == [chunks[0]]


def test_without_the_switch_no_ids_are_returned(smollm2_engine):
    r = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    assert getattr(r, "prompt_token_ids", None) is None and getattr(r.choices[0], "token_ids", None) is None


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_value_that_is_not_a_boolean_is_refused_by_name(fake_engine, value):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=QUESTION, extra_body={"return_token_ids": value})
    assert info.value.body["param"] == "return_token_ids" and fake_engine.submitted == []


def test_a_text_completion_refuses_token_ids_unless_unsupported_ones_are_dropped(fake_engine):
    with pytest.raises(litellm.BadRequestError, match="return_token_ids is not supported on text completions"):
        litellm.text_completion(model=MODEL, prompt="Once upon a time", max_tokens=4, **IDS)
    assert fake_engine.submitted == []
    r = litellm.text_completion(model=MODEL, prompt="Once upon a time", max_tokens=4, drop_params=True, **IDS)
    assert r.choices[0].text == "Pari" and getattr(r, "prompt_token_ids", None) is None


def test_stream_chunks_carry_token_ids_with_their_text_and_the_prompt_on_the_first():
    """A token with no text (a special token) rides a chunk of its own; ids held with text that is
    held back go with that text; the prompt's ids are on the first chunk only."""
    chunks = StreamChunks("smollm2:135m", None, prompt_ids=[1, 2, 3])
    [first] = chunks(0, StreamEvent("Pa", (80, 97), None, 3, 2))
    assert (first.prompt_token_ids, first.choices[0].token_ids) == ([1, 2, 3], [80, 97])
    [special] = chunks(0, StreamEvent("", (258,), None, 3, 3))
    assert (special.choices[0].delta.content, special.choices[0].token_ids) == (None, [258])
    assert getattr(special, "prompt_token_ids", None) is None
    last, finish = chunks(0, StreamEvent("", (), "stop", 3, 3))
    assert getattr(last.choices[0], "token_ids", None) is None and getattr(finish.choices[0], "token_ids", None) is None
