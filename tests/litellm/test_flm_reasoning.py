"""Reasoning models: ``reasoning_effort`` / ``thinking`` turn a chat template's thinking switch on
or off, and the text between the markers comes back as ``reasoning_content``, streamed too.

The splitter is tested on its own (exact strings, every cut of the text); the handler through
LiteLLM against the FakeEngine, with a tiny Jinja template that has an ``enable_thinking`` switch
(rendered by the runtime's own renderer) and a reply, one character per token, that contains the
markers, so every marker is split across stream events.
"""

from __future__ import annotations

import ast
import asyncio
import inspect

import litellm
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.loading.chat_template import ThinkingFormat
from litellm_flm.params import REASONING_EFFORTS, parse_request
from flm_runtime.request import StreamEvent, TokenLogprob
from litellm_flm.llm import StreamChunks
from litellm_flm.reasoning import (Reasoning, ReasoningSplitter, split_reasoning, starts_inside_thinking,
                                   template_switch)

from flm_fake_engine import FakeTokenizer, TemplateTokenizer

MODEL = "flm/smollm2:135m"
QUESTION = [{"role": "user", "content": "Capital of France?"}]
# LiteLLM refuses reasoning_effort and thinking for any custom provider unless they are let by.
LET_BY = {"allowed_openai_params": ["reasoning_effort", "thinking"]}
THINK = ThinkingFormat()

# Qwen3's way: thinking is on unless the switch is false, which writes an empty block itself.
SWITCH_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# The other way (DeepSeek-R1's, Nemotron's): thinking on writes the start marker into the prompt.
INSIDE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
PROMPT = "<|user|>Capital of France?<|end|>\n<|assistant|>"
REPLY = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
REASONING, CONTENT = "The capital of France is Paris.", "Paris."


def split_in_pieces(text: str, pieces: list[str], *, inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, inside=inside)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


# --- the splitter ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, inside, reasoning, content",
    [
        (REPLY, False, REASONING, CONTENT),
        ("Paris.", False, None, "Paris."),  # no block: all content, as written
        ("\n\nParis.", False, None, "\n\nParis."),
        ("  <think>a\n b  \n</think>x ", False, "a\n b", "x "),  # whitespace inside the block stays
        ("<think>\n\n</think>\n\nParis.", False, None, "Paris."),  # an empty block is no reasoning
        ("Paris <think>is</think> big", False, None, "Paris <think>is</think> big"),  # a block not at the start
        ("<think>\nunclosed thought ", False, "unclosed thought", ""),  # a length cut while thinking
        ("<think>\nunclosed </thi", False, "unclosed </thi", ""),  # half a marker is text
        ("<thi", False, None, "<thi"),
        ("The capital is Paris.\n</think>\n\nParis.", True, "The capital is Paris.", "Paris."),
        (REPLY, True, REASONING, CONTENT),  # a start marker written again after the prompt's
        ("unclosed", True, "unclosed", ""),
        ("Paris.</think>", True, "Paris.", ""),
    ],
)
def test_split_reasoning_exact_strings(text, inside, reasoning, content):
    assert split_reasoning(text, THINK, inside=inside) == (reasoning, content)


@pytest.mark.parametrize("text, inside", [(REPLY, False), ("  <think>a \n</think>\n x", False),
                                          ("<think>\nunclosed </thi", False), ("a\n</think>\n\nb", True)])
def test_any_cut_gives_the_same_split(text, inside):
    whole = split_reasoning(text, THINK, inside=inside)
    expected = (whole[0] or "", whole[1])
    assert split_in_pieces(text, list(text), inside=inside) == expected  # one character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split_in_pieces(text, [text[:i], text[i:j], text[j:]], inside=inside) == expected, (i, j)


def test_markers_split_across_pieces_never_leak():
    pieces = ["<th", "ink>\nThe ans", "wer\n</", "thi", "nk>", "\n", "\nParis."]
    splitter = ReasoningSplitter(THINK)
    outs = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    assert outs == [("", ""), ("The ans", ""), ("wer", ""), ("", ""), ("", ""), ("", ""), ("", "Paris."), ("", "")]


def test_other_markers():
    fmt = ThinkingFormat(start="[THINK]", end="[/THINK]")
    assert split_reasoning("[THINK]plan[/THINK]done", fmt) == ("plan", "done")
    assert split_reasoning("<think>x</think>y", fmt) == (None, "<think>x</think>y")


def test_starts_inside_thinking():
    assert starts_inside_thinking(PROMPT + "<think>\n", THINK)
    assert not starts_inside_thinking(PROMPT + "<think>\n\n</think>\n\n", THINK)
    assert not starts_inside_thinking(PROMPT, THINK)


# --- the parameters --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "params, asked",
    [
        ({}, None),
        ({"reasoning_effort": "none"}, (False, "reasoning_effort")),
        ({"reasoning_effort": "minimal"}, (False, "reasoning_effort")),
        ({"reasoning_effort": "low"}, (True, "reasoning_effort")),
        ({"reasoning_effort": "high"}, (True, "reasoning_effort")),
        ({"reasoning_effort": "default"}, None),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, (True, "thinking")),
        ({"thinking": {"type": "disabled"}}, (False, "thinking")),
        ({"thinking": {"type": "adaptive"}}, None),
        ({"thinking": {"type": "adaptive"}, "reasoning_effort": "none"}, (False, "reasoning_effort")),
        ({"extra_body": {"reasoning_effort": "none"}}, (False, "reasoning_effort")),
        ({"reasoning_effort": "high", "thinking": {"type": "enabled"}}, (True, "reasoning_effort")),
    ],
)
def test_requested_thinking(params, asked):
    request = parse_request(QUESTION, {**params, "temperature": 0})
    assert request.thinking == asked
    assert request.sampling == {"temperature": 0}  # not sampling fields


@pytest.mark.parametrize(
    "params, name",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"thinking": True}, "thinking.type"),
        ({"thinking": {"type": "auto"}}, "thinking.type"),
        ({"thinking": {"type": "disabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "display": "omitted"}}, "thinking.display"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget": 10}}, "thinking.budget"),
        ({"reasoning_effort": "none", "thinking": {"type": "enabled"}}, "thinking"),
    ],
)
def test_bad_thinking_values_are_named(params, name):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(QUESTION, params)
    assert info.value.param == name


def test_every_reasoning_effort_litellm_knows_is_mapped():
    annotation = inspect.signature(litellm.completion).parameters["reasoning_effort"].annotation
    tree = ast.parse(annotation if isinstance(annotation, str) else repr(annotation), mode="eval")
    levels = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert levels == set(REASONING_EFFORTS)


def test_template_switch():
    assert template_switch(THINK, (False, "reasoning_effort"), drop=False) == {"enable_thinking": False}
    assert template_switch(THINK, None, drop=False) == {}
    assert template_switch(None, (False, "thinking"), drop=False) == {}  # off already
    assert template_switch(None, (True, "thinking"), drop=True) == {}
    with pytest.raises(InvalidRequestError) as info:
        template_switch(None, (True, "thinking"), drop=False)
    assert info.value.param == "thinking"


# --- through LiteLLM ---------------------------------------------------------------------------

@pytest.fixture
def thinking_engine(fake_engine):
    fake_engine.tokenizer = TemplateTokenizer(SWITCH_TEMPLATE)
    fake_engine.reply = REPLY
    return fake_engine


def prompt_of(engine, i: int = -1) -> str:
    return "".join(map(chr, engine.submitted[i][0]))


def parts(response) -> tuple[str | None, str]:
    """(reasoning_content, content) of a response's message (LiteLLM omits a None reasoning_content)."""
    message = response.choices[0].message
    return getattr(message, "reasoning_content", None), message.content


def joined(chunks) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a stream; no chunk carries a marker."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert not any(m in (getattr(d, "reasoning_content", None) or "") + (d.content or "")
                   for d in deltas for m in (THINK.start, THINK.end))
    return reasoning, content, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_reasoning_content_comes_back_apart(thinking_engine):
    r = litellm.completion(model=MODEL, messages=QUESTION, reasoning_effort="high", **LET_BY)
    assert parts(r) == (REASONING, CONTENT)
    assert prompt_of(thinking_engine) == PROMPT  # this template thinks unless told not to
    assert r.usage.completion_tokens == len(REPLY)  # every token, the markers' included


def test_thinking_off_renders_the_switch_off(thinking_engine):
    thinking_engine.reply = "Paris."
    for off in ({"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}},
                {"extra_body": {"reasoning_effort": "none"}}):
        r = litellm.completion(model=MODEL, messages=QUESTION, **off, **LET_BY)
        assert prompt_of(thinking_engine) == PROMPT + "<think>\n\n</think>\n\n"
        assert parts(r) == (None, "Paris.")


def test_unset_leaves_the_template_default(thinking_engine):
    r = litellm.completion(model=MODEL, messages=QUESTION)
    assert prompt_of(thinking_engine) == PROMPT
    assert parts(r) == (REASONING, CONTENT)


def test_stream_equals_non_stream(thinking_engine):
    full = litellm.completion(model=MODEL, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024},
                              **LET_BY)
    chunks = list(litellm.completion(model=MODEL, messages=QUESTION, stream=True,
                                     stream_options={"include_usage": True},
                                     thinking={"type": "enabled", "budget_tokens": 1024}, **LET_BY))
    assert joined(chunks) == (REASONING, CONTENT, "stop")
    assert parts(full) == (REASONING, CONTENT)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == len(REPLY)
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].delta.role for c in chunks if c.choices][0] == "assistant"
    built = litellm.stream_chunk_builder(chunks, messages=QUESTION)
    assert parts(built) == (REASONING, CONTENT)


def test_async_stream_equals_non_stream(thinking_engine):
    async def run():
        stream = await litellm.acompletion(model=MODEL, messages=QUESTION, stream=True, reasoning_effort="low",
                                           **LET_BY)
        full = await litellm.acompletion(model=MODEL, messages=QUESTION, reasoning_effort="low", **LET_BY)
        return [c async for c in stream], full

    chunks, full = asyncio.run(run())
    assert joined(chunks) == (*parts(full), "stop")
    assert joined(chunks) == (REASONING, CONTENT, "stop")


@pytest.mark.parametrize("max_tokens, reasoning", [(23, "The capital of"), (8, None), (3, None)])
def test_length_cut_while_thinking(thinking_engine, max_tokens, reasoning):
    """REPLY[:23] is "<think>\\nThe capital of " (the space before the cut is dropped); REPLY[:8]
    only the start marker and its newline; REPLY[:3] half the marker."""
    full = litellm.completion(model=MODEL, messages=QUESTION, max_tokens=max_tokens)
    chunks = list(litellm.completion(model=MODEL, messages=QUESTION, max_tokens=max_tokens, stream=True,
                                     stream_options={"include_usage": True}))
    content = "<th" if max_tokens == 3 else ""  # an output that ends before its marker is complete is content
    assert parts(full) == (reasoning, content)
    assert full.choices[0].finish_reason == "length"
    assert joined(chunks) == (reasoning or "", content, "length")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == max_tokens


def test_template_that_opens_the_block_itself(fake_engine):
    fake_engine.tokenizer = TemplateTokenizer(INSIDE_TEMPLATE)
    fake_engine.reply = "The capital of France is Paris.\n</think>\n\nParis."
    full = litellm.completion(model=MODEL, messages=QUESTION, reasoning_effort="medium", **LET_BY)
    assert prompt_of(fake_engine) == PROMPT + "<think>\n"
    chunks = list(litellm.completion(model=MODEL, messages=QUESTION, stream=True, reasoning_effort="medium", **LET_BY))
    assert parts(full) == (REASONING, CONTENT)
    assert joined(chunks) == (REASONING, CONTENT, "stop")
    fake_engine.reply = "Paris."
    off = litellm.completion(model=MODEL, messages=QUESTION, reasoning_effort="none", **LET_BY)
    assert prompt_of(fake_engine) == PROMPT + "<think></think>"
    assert parts(off) == (None, "Paris.")


def test_raw_text_completion_is_not_split(thinking_engine):
    r = litellm.text_completion(model=MODEL, prompt="Once", max_tokens=len(REPLY))
    assert r.choices[0].text == REPLY


# --- a model without a switch -------------------------------------------------------------------

def test_model_without_switch_refuses_thinking_on(fake_engine):
    assert fake_engine.tokenizer.thinking is None
    for on, name in (({"reasoning_effort": "high"}, "reasoning_effort"),
                     ({"thinking": {"type": "enabled"}}, "thinking")):
        with pytest.raises(litellm.BadRequestError, match=name):
            litellm.completion(model=MODEL, messages=QUESTION, **on, **LET_BY)
        with pytest.raises(litellm.BadRequestError, match=name):
            list(litellm.completion(model=MODEL, messages=QUESTION, stream=True, **on, **LET_BY))
    assert fake_engine.submitted == []


def test_model_without_switch_answers_with_drop_params_or_thinking_off(fake_engine):
    plain = litellm.completion(model=MODEL, messages=QUESTION).choices[0].message
    assert not hasattr(plain, "reasoning_content")  # LiteLLM leaves the field out when it is None
    for params in ({"reasoning_effort": "high", "drop_params": True}, {"reasoning_effort": "none"},
                   {"thinking": {"type": "disabled"}}):
        r = litellm.completion(model=MODEL, messages=QUESTION, **params, **LET_BY)
        assert parts(r) == (None, plain.content)
        assert prompt_of(fake_engine) == prompt_of(fake_engine, 0)


def test_litellm_itself_refuses_or_drops_without_allowed_openai_params(fake_engine):
    """What LiteLLM 1.110.2 does before the handler: the same for every custom provider."""
    with pytest.raises(litellm.BadRequestError, match="reasoning_effort"):
        litellm.completion(model=MODEL, messages=QUESTION, reasoning_effort="high")
    r = litellm.completion(model=MODEL, messages=QUESTION, reasoning_effort="high", drop_params=True)
    assert r.choices[0].message.content == fake_engine.reply


def test_a_router_deployment_lets_the_parameters_through(thinking_engine):
    """The proxy's way: allowed_openai_params in the deployment's litellm_params."""
    router = litellm.Router(model_list=[{"model_name": "local", "litellm_params": {"model": MODEL, **LET_BY}}],
                            num_retries=0)
    thinking_engine.reply = "Paris."
    r = router.completion(model="local", messages=QUESTION, reasoning_effort="none")
    assert prompt_of(thinking_engine) == PROMPT + "<think>\n\n</think>\n\n"
    assert parts(r) == (None, "Paris.")


@pytest.mark.parametrize("reply", [REPLY, REPLY[:REPLY.index("Paris.\n</think>") + len("Paris.\n</think>\n\n")]],
                         ids=["whole", "cut-after-the-end-marker"])
def test_stream_chunks_send_each_logprob_once_in_order_while_markers_are_held(reply):
    """Two choices, the reply one character per token with logprobs, their events interleaved:
    while a choice's splitter holds text back around the markers, its entries wait too, and each
    token's entry comes out exactly once, in order, under its own choice's index (the markers'
    tokens included: they are completion tokens), also when the last tokens give no text."""
    reasoning = Reasoning.of_prompt(THINK, PROMPT)
    chunks = StreamChunks("m", reasoning, n=2, total=2, token_bytes=FakeTokenizer().token_bytes)
    sent, text_before = {0: [], 1: []}, {0: [], 1: []}
    for i, ch in enumerate(reply):
        last = i == len(reply) - 1
        for c in (0, 1):
            event = StreamEvent(ch, (ord(ch),), "stop" if last else None, 5, i + 1,
                                logprobs=(TokenLogprob(ord(ch), -0.01 * i - c),))
            for chunk in chunks(c, event):
                if isinstance(chunk, dict):  # choice 1's sibling finish: no text, no logprobs
                    continue
                choice = chunk.choices[0]
                delta, lp = choice.delta, choice.logprobs
                text_before[choice.index].append((getattr(delta, "reasoning_content", None) or "")
                                                 + (delta.content or ""))
                sent[choice.index] += [(e.token, e.logprob) for e in (lp.content if lp is not None else [])]
    for c in (0, 1):
        assert sent[c] == [(ch, pytest.approx(-0.01 * i - c)) for i, ch in enumerate(reply)]
        assert "".join(text_before[c]) == "".join(reasoning.split(reply))
