"""Fill-in-the-middle through LiteLLM's text completion, on ``qwen2.5-coder:0.5b`` (a model with FIM
tokens) and ``smollm2:135m`` (one without).

A coding assistant asks for the text between a prefix (``prompt``) and a ``suffix``, or templates the
FIM prompt itself and sends it as a raw prompt: both must reach the engine as the same token ids
(``tests/data/qwen2.5_coder_0.5b_llama_cpp_fim.json``: llama.cpp's ids of the hand-templated prompt)
and give the same completion.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import litellm
import pytest

from flm_runtime import api
from flm_runtime.api import get_engine
from flm_runtime.sampling.sampler import choice_seed

TAG = "qwen2.5-coder:0.5b"
MODEL = f"flm/{TAG}"
LLAMA_CPP = json.loads((Path(__file__).resolve().parents[1] / "data" / "qwen2.5_coder_0.5b_llama_cpp_fim.json")
                       .read_text(encoding="utf-8"))
TEMPLATED = LLAMA_CPP["cases"][0]["text"]  # <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>
TEMPLATED_IDS = LLAMA_CPP["cases"][0]["ids"]
PREFIX = "def fib(n):\n    if n < 2:\n        return n\n    return "
SUFFIX = "\n\n\nprint(fib(10))\n"
MIDDLE = "fib(n-1) + fib(n-2)\n\n"  # the greedy fill-in; it then ends with <|endoftext|>
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = 151659, 151661, 151660  # <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def engine(qwen_coder_gguf):
    """The engine of ``TAG`` with the default (quantized) weights, whatever the suite's
    ``FLM_WEIGHTS``: every assertion here is an equality between two paths, or the greedy fill-in,
    which our runs gave the same on float32 and default weights (2026-12-07); float32 took minutes longer.
    It lives in a runtime of its own, put in place of the process's for this module, so that no
    target an earlier test loaded is reused and no later test gets this one."""
    runtime = api.Runtime()
    with pytest.MonkeyPatch.context() as env:
        env.setattr(api, "default_runtime", runtime)
        with pytest.MonkeyPatch.context() as weights:
            weights.setenv("FLM_WEIGHTS", "auto")
            engine = get_engine(TAG)
        assert engine.model.quantized
        yield engine
    runtime.close()


def test_the_templated_prompt_is_tokenized_with_the_fim_tokens_as_single_ids(engine):
    assert TEMPLATED == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    tok = engine.tokenizer
    assert tok.encode(TEMPLATED) == tok.encode_fim(PREFIX, SUFFIX) == TEMPLATED_IDS
    assert TEMPLATED_IDS == [FIM_PREFIX, *tok.encode(PREFIX), FIM_SUFFIX, *tok.encode(SUFFIX), FIM_MIDDLE]


def test_a_suffix_fills_the_gap_as_the_hand_templated_prompt_does(engine):
    r = litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    raw = litellm.text_completion(model=MODEL, prompt=TEMPLATED, **GREEDY)
    assert [(c.text, c.finish_reason) for c in r.choices] == [(c.text, c.finish_reason) for c in raw.choices] \
        == [(MIDDLE, "stop")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (raw.usage.prompt_tokens, raw.usage.completion_tokens) \
        == (len(TEMPLATED_IDS), len(engine.tokenizer.encode(MIDDLE)))


def test_a_streamed_fill_in_equals_the_whole_one(engine):
    whole = litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY)

    async def astream():
        stream = await litellm.atext_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)
        return [c async for c in stream]

    for chunks in (list(litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)),
                   asyncio.run(astream())):
        assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
            (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_n_choices_of_several_prompts_each_fill_their_own_gap(engine):
    """Every prompt takes the suffix; choice ``p * n + i`` is what prompt ``p`` alone gives with
    choice ``i``'s seed, and each prompt's tokens count once."""
    prefixes = [PREFIX, "def area(r):\n    return "]
    sampled = {"temperature": 0.8, "max_tokens": 12, "seed": 7}
    r = litellm.text_completion(model=MODEL, prompt=prefixes, suffix=SUFFIX, n=2, **sampled)
    alone = [litellm.text_completion(model=MODEL, prompt=p, suffix=SUFFIX, **{**sampled, "seed": choice_seed(7, i)})
             for p in prefixes for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode_fim(p, SUFFIX)) for p in prefixes)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = list(litellm.text_completion(model=MODEL, prompt=prefixes, suffix=SUFFIX, n=2, stream=True, **sampled))
    texts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.text or "")
    assert texts == {c.index: c.text for c in r.choices}


@pytest.mark.parametrize("end", ["<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"])
def test_the_fim_end_tokens_end_the_fill_in_unseen(engine, end):
    # Forced as the first token: it ends the completion at once instead of repeating to max_tokens.
    forced = {"logit_bias": {str(engine.tokenizer.token_to_id(end)): 100}, "temperature": 0, "max_tokens": 4}
    r = litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **forced)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 0)
    chunks = list(litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=True, **forced))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == ""


def test_suffix_in_extra_body_and_an_empty_prefix(engine):
    top = litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    extra = litellm.text_completion(model=MODEL, prompt=PREFIX, extra_body={"suffix": SUFFIX}, **GREEDY)
    assert extra.choices[0].text == top.choices[0].text == MIDDLE
    # A gap at the start of a file: only the suffix is known.
    empty = litellm.text_completion(model=MODEL, prompt="", suffix=SUFFIX, temperature=0, max_tokens=2)
    assert engine.tokenizer.encode_fim("", SUFFIX) == [FIM_PREFIX, FIM_SUFFIX, *engine.tokenizer.encode(SUFFIX),
                                                       FIM_MIDDLE]
    assert empty.usage.prompt_tokens == len(engine.tokenizer.encode_fim("", SUFFIX))


def test_a_model_without_fim_tokens_refuses_a_suffix_by_name(smollm2_gguf):
    with pytest.raises(litellm.BadRequestError, match="no FIM prefix/suffix/middle token") as info:
        litellm.text_completion(model="flm/smollm2:135m", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
    assert info.value.body["param"] == "suffix"


@pytest.mark.parametrize("call", [
    lambda: litellm.completion(model=MODEL, messages=[{"role": "user", "content": "hi"}], suffix=SUFFIX, max_tokens=2),
    lambda: litellm.text_completion(model=MODEL, prompt=PREFIX, suffix=5, max_tokens=2),
], ids=["on a chat", "not a string"])
def test_a_misplaced_or_mistyped_suffix_is_refused_by_name(call):
    with pytest.raises(litellm.BadRequestError) as info:
        call()
    assert info.value.body["param"] == "suffix"
