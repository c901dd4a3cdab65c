"""Cancelling 50 of 100 in-flight streaming requests through ``litellm.acompletion``.

The 100 requests run on the embedded SmolLM2 through LiteLLM's real path (``litellm.acompletion``
-> ``FlmLLM.astreaming`` -> engine), on an engine of their own over the session's loaded model: the
process-wide engine queues 64 requests at most, and this test needs all 100 in flight at once. Half
of them (long, so none can finish first) have their asyncio task cancelled once all 100 are in the
engine and one of them is mid-stream; the other half (short, greedy) must complete with exactly the
tokens each gives alone, and the engine's stats must show no sequence, queued request or KV byte
left behind.
"""

from __future__ import annotations

import asyncio
import time

import litellm
import pytest

import litellm_flm.llm
from flm_runtime.scheduling.engine import Engine
from flm_runtime.scheduling.handle import RequestCancelledError

MODEL = "flm/smollm2:135m"
N_REQUESTS = 100
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Name a planet.",
             "What do bees make?"]
# A short system turn instead of the template's default one: 21 prompt tokens instead of 34 (each
# request's prefill is most of this test's time on a CPU).
SYSTEM = {"role": "system", "content": "Be brief."}
KEPT_TOKENS = 6        # greedy, each compared with the same request alone
CANCELLED_TOKENS = 400  # with ignore_eos: far more steps than the test takes before cancelling


@pytest.fixture
def engine(smollm2_engine):
    engine = Engine(smollm2_engine.model, smollm2_engine.tokenizer, name="smollm2:135m (cancellation test)",
                    default_sampling=smollm2_engine.default_sampling, max_queue=N_REQUESTS)
    yield engine
    engine.close()


def prompt_ids(engine, question: str) -> tuple[int, ...]:
    messages = [SYSTEM, {"role": "user", "content": question}]
    return tuple(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))


async def wait_until(cond, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_cancelling_50_of_100_streams_leaves_nothing_behind(engine, monkeypatch):
    greedy = engine.sampling_params(temperature=0.0, max_tokens=KEPT_TOKENS)
    alone = {prompt_ids(engine, q): engine.submit(prompt_ids(engine, q), greedy).result() for q in QUESTIONS}

    submitted = []  # (prompt ids, params, handle) of every request LiteLLM hands the engine
    submit_choices = engine.submit_choices

    def recording_submit(ids, params, n, **kw):
        handles = submit_choices(ids, params, n, **kw)
        submitted.extend((tuple(ids), params, handle) for handle in handles)
        return handles

    monkeypatch.setattr(engine, "submit_choices", recording_submit)
    monkeypatch.setattr(litellm_flm.llm, "_get_engine", lambda tag, backend=None: engine)
    mid_stream = asyncio.Event()

    async def stream(i: int) -> tuple[str, int]:
        cancelled = i % 2 == 1
        extra = {"max_tokens": CANCELLED_TOKENS, "extra_body": {"ignore_eos": True}} if cancelled else \
            {"max_tokens": KEPT_TOKENS}
        question = QUESTIONS[i % len(QUESTIONS)]
        response = await litellm.acompletion(model=MODEL, messages=[SYSTEM, {"role": "user", "content": question}],
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             **extra)
        text, usage = "", None
        async for chunk in response:
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            usage = getattr(chunk, "usage", None) or usage
            if cancelled and text:
                mid_stream.set()
        return text, usage.completion_tokens

    tasks = [asyncio.create_task(stream(i)) for i in range(N_REQUESTS)]
    await wait_until(lambda: len(submitted) == N_REQUESTS)
    await asyncio.wait_for(mid_stream.wait(), 120)
    s = engine.stats()
    assert s["active"] + s["queued"] + s["finished"] - len(QUESTIONS) == N_REQUESTS  # all 100 in the engine
    for task in tasks[1::2]:
        task.cancel()
    kept = await asyncio.gather(*tasks[0::2])
    cancelled = await asyncio.gather(*tasks[1::2], return_exceptions=True)
    assert all(isinstance(c, asyncio.CancelledError) for c in cancelled)

    # The other 50 complete exactly as alone: the same text and count through LiteLLM, and the
    # same tokens in the engine.
    for i, got in zip(range(0, N_REQUESTS, 2), kept):
        reference = alone[prompt_ids(engine, QUESTIONS[i % len(QUESTIONS)])]
        assert got == (reference.text, reference.completion_tokens)
    short = [(ids, h) for ids, params, h in submitted if params.max_tokens == KEPT_TOKENS]
    long = [h for _, params, h in submitted if params.max_tokens == CANCELLED_TOKENS]
    assert len(short) == len(long) == N_REQUESTS // 2
    for ids, handle in short:
        done = handle.result(timeout=0)
        assert (done.token_ids, done.text) == (alone[ids].token_ids, alone[ids].text)
    await wait_until(lambda: all(h.done for h in long))
    for handle in long:
        with pytest.raises(RequestCancelledError):
            handle.result(timeout=0)

    # ... and nothing is left behind but what the prefix cache keeps, within the budget.
    stats = engine.stats()
    assert 0 <= stats.pop("kv_cached_bytes") <= engine.kv.budget
    assert stats == {
        "name": engine.name, "active": 0, "queued": 0, "kv_tokens": 0, "kv_block_tokens": engine.pool.block_tokens,
        "kv_blocks": engine.pool.n_blocks, "kv_blocks_used": 0, "kv_bytes": 0, "kv_budget_bytes": engine.kv.budget,
        "finished": len(QUESTIONS) + N_REQUESTS // 2, "failed": 0, "cancelled": N_REQUESTS // 2, "timed_out": 0,
        "preempted": 0, "draining": False}


# ---- a stream the caller stops reading ----------------------------------------------------------

def decode_steps(steps) -> int:
    """Steps that ran decode rows (a step of prompt chunks only has no drafts)."""
    return sum(bool(s.records) for s in steps)


LONG = {"max_tokens": CANCELLED_TOKENS, "extra_body": {"ignore_eos": True}, "temperature": 0}
# Steps a broken-off stream may still decode: the one in flight when the cancel lands, and one
# more if LiteLLM's logging thread still held the stream for a moment.
AFTER_BREAK = 2


def wait_idle(engine, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while engine.stats()["active"]:
        assert time.monotonic() < end, "the stream's sequence still runs"
        time.sleep(0.001)


@pytest.fixture
def quiet_engine(engine, monkeypatch):
    """``engine`` behind litellm, recording its steps."""
    steps = []
    engine.on_step = steps.append
    monkeypatch.setattr(litellm_flm.llm, "_get_engine", lambda tag, backend=None: engine)
    return engine, steps


def test_breaking_out_of_a_stream_frees_its_sequence(quiet_engine):
    engine, steps = quiet_engine
    for chunk in litellm.completion(model=MODEL, messages=[SYSTEM, {"role": "user", "content": QUESTIONS[0]}],
                                    stream=True, **LONG):
        if chunk.choices and chunk.choices[0].delta.content:
            break
    at_break = decode_steps(steps)
    wait_idle(engine)
    assert decode_steps(steps) - at_break <= AFTER_BREAK
    assert engine.stats()["cancelled"] == 1 and engine.stats()["kv_tokens"] == 0


async def test_breaking_out_of_an_async_stream_frees_its_sequence(quiet_engine):
    engine, steps = quiet_engine
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    async for chunk in await litellm.acompletion(model=MODEL, messages=messages, stream=True, **LONG):
        if chunk.choices and chunk.choices[0].delta.content:
            break
    at_break = decode_steps(steps)
    await wait_until(lambda: engine.stats()["active"] == 0, timeout=60)
    assert decode_steps(steps) - at_break <= AFTER_BREAK
    assert engine.stats()["cancelled"] == 1 and engine.stats()["kv_tokens"] == 0


def test_leaving_a_with_block_frees_a_stream_kept_in_a_variable(quiet_engine):
    """A stream object the caller keeps alive after ``break`` hears nothing of it (Python tells
    an iterator nothing on ``break``): closing it, as ``with`` does, frees the sequence."""
    engine, steps = quiet_engine
    with litellm.completion(model=MODEL, messages=[SYSTEM, {"role": "user", "content": QUESTIONS[1]}], stream=True,
                            n=2, **LONG) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
    at_close = decode_steps(steps)
    wait_idle(engine)
    assert decode_steps(steps) - at_close <= 1 and stream is not None  # closed, yet still referenced
    assert engine.stats()["cancelled"] == 2
