"""End to end on the real embedded model (smollm2:135m), through litellm's public API.

Slow on CPU (tens of tokens/s): few tests, small ``max_tokens``, one engine for the whole process
(``get_engine`` caches it), and the greedy reference computed once per module. The independent
side of each comparison is the engine itself, driven directly (prompt ids from the model's own
chat template and tokenizer; delivered token ids from the engine's ``Completion``).
"""

from __future__ import annotations

import asyncio

import litellm
import pytest

from flm_runtime.api import get_engine

TAG = "smollm2:135m"
MODEL = f"flm/{TAG}"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return get_engine(TAG)


def prompt_ids(engine, messages):
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def reference(engine):
    """The greedy answer to QUESTION, straight from the engine."""
    params = engine.sampling_params(temperature=0.0, max_tokens=GREEDY["max_tokens"])
    return engine.submit(prompt_ids(engine, QUESTION), params, timeout=300).result()


def test_completion_answers_and_counts_real_tokens(engine, reference):
    r = litellm.completion(model=MODEL, messages=QUESTION, **GREEDY)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert text == reference.text
    assert r.usage.prompt_tokens == len(prompt_ids(engine, QUESTION))
    assert r.usage.completion_tokens == len(reference.token_ids) == reference.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == reference.finish_reason


def _joined(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_stream_equals_non_stream(reference):
    chunks = list(
        litellm.completion(model=MODEL, messages=QUESTION, stream=True, stream_options={"include_usage": True}, **GREEDY)
    )
    assert _joined(chunks) == reference.text
    assert chunks[-1].usage.completion_tokens == reference.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        reference.finish_reason
    ]


async def test_async_stream_and_acompletion_equal_non_stream(reference):
    r = await litellm.acompletion(model=MODEL, messages=QUESTION, **GREEDY)
    assert r.choices[0].message.content == reference.text
    stream = await litellm.acompletion(model=MODEL, messages=QUESTION, stream=True, **GREEDY)
    assert _joined([c async for c in stream]) == reference.text


async def test_concurrent_requests_match_alone_and_leave_the_loop_free(reference):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    try:
        results = await asyncio.gather(*(litellm.acompletion(model=MODEL, messages=QUESTION, **GREEDY) for _ in range(2)))
    finally:
        tick_task.cancel()
    assert [r.choices[0].message.content for r in results] == [reference.text] * 2
    assert ticks >= 5  # the event loop kept running while the engine worked (a blocked loop: ~1)


def test_max_tokens_gives_length():
    r = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_stop_string(reference):
    words = reference.text.split()
    assert len(words) >= 3, reference.text
    stop = " " + words[2]  # a stop string the greedy answer reaches
    cut = reference.text[: reference.text.index(stop)]
    r = litellm.completion(model=MODEL, messages=QUESTION, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = list(litellm.completion(model=MODEL, messages=QUESTION, stop=[stop], stream=True, **GREEDY))
    assert _joined(chunks) == cut


# Prompts on which greedy smollm2:135m writes characters of 2-3 tokens each (checked by hand on
# the engine: Hangul, emoji, and Chinese cut by max_tokens in the middle of a character).
MULTIBYTE_PROMPTS = {
    "korean": [{"role": "user", "content": "Translate to Korean: thank you"}],
    "emoji": [{"role": "user", "content": "Give me three emoji that show happiness."}],
    "chinese": [{"role": "system", "content": "You always answer in Chinese."}, {"role": "user", "content": "你好"}],
}


@pytest.mark.parametrize("messages", MULTIBYTE_PROMPTS.values(), ids=MULTIBYTE_PROMPTS.keys())
def test_every_chunk_is_whole_characters(engine, messages):
    # Byte-level BPE splits CJK and emoji over several tokens: a chunk must never hold part of a
    # character, and the stream must join to the non-stream text.
    kw = {"temperature": 0, "max_tokens": 24}
    full = litellm.completion(model=MODEL, messages=messages, **kw)
    text = full.choices[0].message.content
    assert any(ord(ch) > 0x7F for ch in text), f"the model wrote no multi-byte character: {text!r}"
    chunks = list(litellm.completion(model=MODEL, messages=messages, stream=True, **kw))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text
    cut_short = full.choices[0].finish_reason == "length"
    for i, piece in enumerate(pieces):
        piece.encode("utf-8")  # no lone surrogates
        # U+FFFD only as the very last character, where max_tokens cut a character short.
        body = piece[:-1] if cut_short and i == len(pieces) - 1 else piece
        assert "\ufffd" not in body, (i, piece)


def test_same_seed_same_sample():
    kw = {"temperature": 1.0, "max_tokens": 8, "seed": 1234}
    a = litellm.completion(model=MODEL, messages=QUESTION, **kw).choices[0].message.content
    b = litellm.completion(model=MODEL, messages=QUESTION, **kw).choices[0].message.content
    assert a == b


def test_context_overflow(engine):
    long = [{"role": "user", "content": "hello " * engine.context_length}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=MODEL, messages=long, max_tokens=4)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=MODEL, messages=QUESTION, max_tokens=engine.context_length)


@pytest.mark.parametrize("bad, name", [({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k")])
def test_bad_param_names_it(engine, bad, name):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=QUESTION, **bad)
    assert name in str(info.value)


def test_image_content_is_refused(engine):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=messages, max_tokens=2)
    assert "messages" in str(info.value)


def test_timeout_is_enforced_by_the_engine(engine):
    # litellm does not enforce timeouts for custom handlers: the engine's deadline does, and the
    # request leaves nothing behind.
    # ignore_eos: 2,000 tokens take far longer than either timeout on any machine (the short
    # answer alone could finish within 0.3 s on a fast one).
    long = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}
    timed_out = engine.stats()["timed_out"]
    with pytest.raises(litellm.Timeout):
        litellm.completion(model=MODEL, messages=QUESTION, temperature=0, timeout=0.05, **long)
    stream = litellm.completion(model=MODEL, messages=QUESTION, temperature=0, timeout=0.3, stream=True, **long)
    with pytest.raises(litellm.Timeout):
        for _ in stream:
            pass
    s = engine.stats()
    assert s["timed_out"] == timed_out + 2
    assert (s["active"], s["queued"], s["kv_tokens"], s["kv_blocks_used"]) == (0, 0, 0, 0)


RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_text_completion_continues_the_raw_text_batched_as_alone(engine):
    alone = [engine.submit(engine.tokenizer.encode(p), engine.sampling_params(temperature=0.0, max_tokens=12),
                           timeout=300).result() for p in RAW_PROMPTS]
    r = litellm.text_completion(model=MODEL, prompt=RAW_PROMPTS, temperature=0, max_tokens=12)
    assert [c.text for c in r.choices] == [a.text for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.finish_reason for a in alone]
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in RAW_PROMPTS)
    assert r.usage.completion_tokens == sum(a.completion_tokens for a in alone)
    # A continuation, not a chat answer: the chat template's reply to the same text differs.
    chat = litellm.completion(model=MODEL, messages=[{"role": "user", "content": RAW_PROMPTS[0]}],
                              temperature=0, max_tokens=12)
    assert chat.choices[0].message.content != r.choices[0].text
    streamed = litellm.text_completion(model=MODEL, prompt=RAW_PROMPTS[1], temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text or "" for c in streamed) == alone[1].text


def test_text_completion_refuses_logprobs_by_name_or_drops_them(engine):
    for legacy in (True, 1, 0):  # the legacy API's integer logprobs too, 0 included
        with pytest.raises(litellm.BadRequestError, match="logprobs are not supported on text completions"):
            litellm.text_completion(model=MODEL, prompt=RAW_PROMPTS[0], temperature=0, max_tokens=4, logprobs=legacy)
    dropped = litellm.text_completion(model=MODEL, prompt=RAW_PROMPTS[0], temperature=0, max_tokens=4,
                                      logprobs=True, drop_params=True)
    plain = litellm.text_completion(model=MODEL, prompt=RAW_PROMPTS[0], temperature=0, max_tokens=4)
    assert dropped.choices[0].text == plain.choices[0].text
