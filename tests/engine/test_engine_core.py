"""Engine on fake models: streams, finish reasons, limits, errors, cancellation, concurrency."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from engine_fakes import BOT, EOS, FakeTokenizer, HashModel, ScriptModel

from flm_runtime.errors import (BackendUnavailableError, ContextLengthError, EngineFaultError, EngineOverloadedError,
                                InvalidRequestError, RequestTimeoutError)
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.handle import RequestCancelledError

SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=24)


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def idle(engine) -> bool:
    s = engine.stats()
    return s["active"] == 0 and s["queued"] == 0 and s["kv_tokens"] == 0


def test_stream_join_equals_result(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    handle = engine.submit([1, 2, 3], SAMPLED)
    events = list(handle)
    done = handle.result()
    assert "".join(e.text for e in events) == done.text
    assert tuple(t for e in events for t in e.token_ids) == done.token_ids
    assert [e.finish_reason for e in events][-1] == done.finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert [e.completion_tokens for e in events] == sorted(e.completion_tokens for e in events)
    # A second identical request, not streamed, gives the same completion.
    again = engine.submit([1, 2, 3], SAMPLED).result()
    assert (again.text, again.token_ids) == (done.text, done.token_ids)


def test_idle_waits_for_the_last_steps_hook_after_the_result(make_engine, tok):
    """A request's result reaches its caller before its last step's ``on_step`` returns;
    ``idle`` waits for that too, and gives up after its timeout while a step runs."""
    steps, inside = [], []

    def slow_hook(timing):
        inside.append(True)
        time.sleep(0.3)
        steps.append(timing)

    engine = make_engine(HashModel(), tok, on_step=slow_hook)
    engine.submit([1, 2, 3], SamplingParams(max_tokens=3)).result()
    wait_until(lambda: len(inside) == 3)  # the prefill and two decode steps have begun their hook
    assert len(steps) == 2 and not engine.idle(timeout=0.05)  # the last hook still sleeps
    assert engine.idle(timeout=10) and len(steps) == 3


def test_max_tokens_exact_and_stats(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    done = engine.submit([5] * 10, SamplingParams(max_tokens=17)).result()
    assert done.finish_reason == "length"
    assert done.completion_tokens == len(done.token_ids) == 17
    s = done.stats
    assert (s.prompt_tokens, s.completion_tokens, s.generated_tokens) == (10, 17, 17)
    assert 0 < s.ttft_s <= s.total_s and s.decode_tokens_per_s > 0
    assert 0 < s.max_gap_s <= s.decode_s and s.as_dict()["max_gap_s"] == s.max_gap_s


def test_eos_finishes_with_stop(make_engine, tok):
    script = [ord(c) for c in "Hi!"] + [EOS]
    done = make_engine(ScriptModel(script), tok).submit([1], SamplingParams(max_tokens=50)).result()
    assert (done.text, done.finish_reason, done.completion_tokens) == ("Hi!", "stop", 3)
    assert EOS not in done.token_ids and done.stats.generated_tokens == 4


def test_special_tokens_are_delivered_without_text(make_engine, tok):
    script = [ord("a"), BOT, ord("b"), EOS]
    done = make_engine(ScriptModel(script), tok).submit([1], SamplingParams(max_tokens=50)).result()
    assert (done.text, done.token_ids, done.completion_tokens) == ("ab", (ord("a"), BOT, ord("b")), 3)


def test_stop_string_never_shown_in_the_stream(make_engine):
    tok = FakeTokenizer(extra=[b"Hello", b"\n", b"\nUser", b":"])
    script = [tok.id_of("Hello"), ord("\n"), tok.id_of("\nUser"), tok.id_of(":"), ord(" ")]
    engine = make_engine(ScriptModel(script), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=5, stop=("\n\nUser:",)))
    events = list(handle)
    assert [e.text for e in events] == ["Hello", ""]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == 1
    assert handle.result().token_ids == (tok.id_of("Hello"),)


def test_stop_and_max_tokens_in_the_same_token_is_stop(make_engine):
    tok = FakeTokenizer(extra=[b"ab", b"cEND"])
    engine = make_engine(ScriptModel([tok.id_of("ab"), tok.id_of("cEND")]), tok)
    done = engine.submit([1], SamplingParams(max_tokens=2, stop=("END",))).result()
    assert (done.text, done.finish_reason, done.completion_tokens) == ("abc", "stop", 2)


def test_context_limits(make_engine, tok):
    engine = make_engine(HashModel(context=128), tok)
    with pytest.raises(ContextLengthError) as e:
        engine.submit([1] * 100, SamplingParams(max_tokens=29))
    assert (e.value.param, e.value.prompt_tokens, e.value.max_tokens, e.value.context_length) == ("messages", 100, 29, 128)
    # max_tokens unset: the message gives the prompt and the context, not a max_tokens nobody sent.
    for n_prompt in (128, 140):
        with pytest.raises(ContextLengthError) as e:
            engine.submit([1] * n_prompt, SamplingParams())
        assert str(e.value) == (f"this model's context length is 128 tokens; the prompt has {n_prompt} tokens, "
                                "which leaves no room for a completion")
        assert (e.value.param, e.value.prompt_tokens, e.value.max_tokens) == ("messages", n_prompt, None)
    done = engine.submit([1] * 100, SamplingParams(max_tokens=28)).result()
    assert done.completion_tokens == 28
    # max_tokens None: up to the context, then "length".
    done = engine.submit([1] * 120, SamplingParams()).result()
    assert (done.finish_reason, done.completion_tokens) == ("length", 8)



def test_a_context_length_below_the_models_caps_every_request(make_engine, tok):
    """A tag's ``context_length`` (llama-server's ``-c``): 64 of the model's 128 positions."""
    engine = make_engine(HashModel(context=128), tok, context_length=64)
    assert engine.context_length == 64
    with pytest.raises(ContextLengthError) as e:
        engine.submit([1] * 40, SamplingParams(max_tokens=25))
    assert (e.value.max_tokens, e.value.context_length) == (25, 64)
    done = engine.submit([1] * 40, SamplingParams()).result()  # unset: up to the 64
    assert (done.finish_reason, done.completion_tokens) == ("length", 24)
    with pytest.raises(InvalidRequestError, match=r"context_length=129 is more than the model's 128 positions") as e:
        make_engine(HashModel(context=128), tok, context_length=129)
    assert e.value.param == "context_length"

@pytest.mark.parametrize("call, param", [
    (lambda e: e.submit([], SamplingParams()), "messages"),
    (lambda e: e.submit([1, 300], SamplingParams()), "messages"),
    (lambda e: e.submit([1], SamplingParams(), timeout=-1), "timeout"),
    (lambda e: e.submit([1], {"temperature": 0}), "params"),
    (lambda e: e.submit([1], SamplingParams(top_p=1.5)), "top_p"),
    (lambda e: e.submit([1], SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda e: e.submit([1], e.sampling_params(top_k=-2)), "top_k"),
])
def test_bad_requests_name_the_param(make_engine, tok, call, param):
    engine = make_engine(HashModel(), tok)
    with pytest.raises(InvalidRequestError) as e:
        call(engine)
    assert e.value.param == param


def test_cancel_frees_the_sequence_and_its_cache(make_engine, tok):
    model = HashModel(delay=0.005)
    engine = make_engine(model, tok)
    handle = engine.submit([1, 2], SamplingParams(max_tokens=100))
    stream = iter(handle)
    next(stream)
    assert engine.stats()["kv_tokens"] > 0 and engine.stats()["active"] == 1
    handle.cancel()
    list(stream)                                   # a cancelled stream just ends, no error
    wait_until(lambda: handle.done)
    assert idle(engine) and engine.stats()["cancelled"] == 1
    with pytest.raises(RequestCancelledError):
        handle.result()
    gc.collect()
    assert model.live_caches() == 0


def test_abandoning_a_sync_stream_cancels(make_engine, tok):
    engine = make_engine(HashModel(delay=0.005), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=100))
    for _ in handle:
        break
    gc.collect()
    with pytest.raises(RequestCancelledError):
        handle.result(timeout=10)
    assert idle(engine)


async def test_async_iteration_matches_sync(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    events = [e async for e in engine.submit([4, 5], SAMPLED).aiter()]
    sync = engine.submit([4, 5], SAMPLED).result()
    assert "".join(e.text for e in events) == sync.text
    assert (await engine.submit([4, 5], SAMPLED).aresult()).token_ids == sync.token_ids


async def test_async_stream_does_not_block_the_loop(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.002)

    task = asyncio.create_task(ticker())
    n = len([e async for e in engine.submit([1], SamplingParams(max_tokens=20)).aiter()])
    task.cancel()
    assert n >= 2 and ticks >= 20         # 20 steps of >= 10 ms: the loop kept ticking meanwhile


async def test_cancelling_the_async_task_cancels_the_request(make_engine, tok):
    engine = make_engine(HashModel(delay=0.005), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=100))
    first = asyncio.Event()

    async def consume():
        async for _ in handle.aiter():
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(wait_until, lambda: handle.done)
    assert handle.cancel_requested and engine.stats()["cancelled"] == 1
    await asyncio.to_thread(wait_until, lambda: idle(engine))


async def test_cancelling_aresult_cancels_the_request(make_engine, tok):
    engine = make_engine(HashModel(delay=0.005), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=200))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(handle.aresult(), 0.05)
    await asyncio.to_thread(wait_until, lambda: handle.done)
    assert engine.stats()["cancelled"] == 1


def test_timeout_raises_in_the_stream(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=1000), timeout=0.3)
    got = []
    with pytest.raises(RequestTimeoutError):
        for e in handle:
            got.append(e)
    assert 0 < len(got) < 1000
    assert engine.stats()["timed_out"] == 1 and idle(engine)


def test_timeout_while_queued(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, max_active=1)
    busy = engine.submit([1], SamplingParams(max_tokens=40))
    waiting = engine.submit([2], SamplingParams(max_tokens=5), timeout=0.05)
    with pytest.raises(RequestTimeoutError):
        waiting.result(timeout=10)
    assert busy.result().completion_tokens == 40


def test_failing_sequence_fails_only_its_request(make_engine, tok):
    model = HashModel(fail_when=lambda c: c.tokens[0] == 7 and c.length - c.prompt_length == 3)
    engine = make_engine(model, tok)
    bad = engine.submit([7, 1], SamplingParams(max_tokens=10))
    good = [engine.submit([8, i], SamplingParams(max_tokens=10)) for i in range(3)]
    with pytest.raises(EngineFaultError, match="RuntimeError: injected model failure") as info:
        list(bad)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert all(h.result().completion_tokens == 10 for h in good)
    assert engine.submit([9], SamplingParams(max_tokens=3)).result().completion_tokens == 3
    assert engine.stats()["failed"] == 1 and engine.stats()["finished"] == 4


def test_a_bug_while_finishing_fails_the_request_not_the_engine(make_engine, tok, monkeypatch):
    from flm_runtime.scheduling import engine as engine_module

    engine = make_engine(HashModel(), tok)
    with monkeypatch.context() as m:
        m.setattr(engine_module.Sequence, "completion", lambda self: 1 / 0)
        with pytest.raises(EngineFaultError) as info:
            engine.submit([1], SamplingParams(max_tokens=3)).result(timeout=10)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert engine.submit([1], SamplingParams(max_tokens=3)).result(timeout=10).completion_tokens == 3
    assert engine.stats()["failed"] == 1 and idle(engine)


def _prompts():
    return [[1, 2, 3], [40, 41], [7] * 9, [200, 100, 50, 25]]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20), SAMPLED], ids=["greedy", "seeded"])
def test_concurrent_requests_equal_each_alone(make_engine, tok, params):
    engine = make_engine(HashModel(), tok)
    alone = [engine.submit(p, params).result().token_ids for p in _prompts()]
    handles = [engine.submit(p, params) for p in _prompts()]
    together = [h.result().token_ids for h in handles]
    assert together == alone and len(set(alone)) == 4


def test_decoding_sequences_share_one_batched_step(make_engine, tok):
    """Continuous batching: each step runs every active sequence (prompt chunk or decode row) in
    one ``forward_batch`` call; a finished sequence leaves the batch and a late one joins it."""
    model = HashModel(delay=0.002)
    engine = make_engine(model, tok)
    budgets = [6, 12, 18]
    handles = [engine.submit([i + 1], SamplingParams(max_tokens=n)) for i, n in enumerate(budgets)]
    wait_until(lambda: any(len(p) == 3 for p in model.passes))
    late = engine.submit([9], SamplingParams(max_tokens=5))
    assert [h.result().stats.generated_tokens for h in handles + [late]] == budgets + [5]
    # every token is one sequence's part of one call: the first from its (1-token) prompt's
    # chunk, the others from decode rows
    sizes = [len(p) for p in model.passes]
    assert sum(sizes) == sum(budgets) + 5
    assert sizes[-1] == 1 and max(sizes) <= 4
    assert idle(engine)


def test_chunked_prefill_shares_passes_with_decoding(make_engine, tok):
    """Chunked prefill: a 350-token prompt enters the cache in chunks of at most ``prefill_tokens``
    (100), the LM head asked only for the last chunk's last row; while it prefills, a request
    already decoding gets its decode row into each of those passes (it does not wait for the
    whole prompt), and the long request's tokens equal its tokens alone."""
    model = HashModel(delay=0.002)
    engine = make_engine(model, tok, prefill_tokens=100)
    long_prompt = [(7 * i) % 250 + 1 for i in range(350)]
    alone = engine.submit(long_prompt, SamplingParams(max_tokens=5)).result().token_ids
    assert model.passes == [[(100, 0)]] * 3 + [[(50, 1)]] + [[(1, 1)]] * 4
    n0 = len(model.passes)
    runner = engine.submit([3], SamplingParams(max_tokens=2000))
    wait_until(lambda: len(model.passes) > n0 + 2)  # the runner is decoding
    late = engine.submit(long_prompt, SamplingParams(max_tokens=5))
    assert late.result().token_ids == alone
    runner.cancel()
    chunked = [p for p in model.passes[n0:] if any(rows > 1 for rows, _ in p)]
    assert chunked == [[(100, 0), (1, 1)]] * 3 + [[(50, 1), (1, 1)]]
    wait_until(lambda: idle(engine))


def test_requests_progress_concurrently(make_engine, tok):
    model = HashModel(delay=0.002)
    engine = make_engine(model, tok)
    handles = [engine.submit([i + 1], SamplingParams(max_tokens=30)) for i in range(4)]
    first_done = min(h.result().stats.total_s for h in handles)
    ttft = max(h.result().stats.ttft_s for h in handles)
    assert ttft < first_done                   # all four started before any finished


def test_queue_full_is_overloaded(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, max_active=1, max_queue=1)
    running = engine.submit([1], SamplingParams(max_tokens=50))
    wait_until(lambda: engine.stats()["active"] == 1)
    queued = engine.submit([2], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloadedError):
        engine.submit([3], SamplingParams(max_tokens=2))
    running.cancel()
    assert queued.result(timeout=10).completion_tokens == 2


def test_close_fails_pending_and_refuses_new(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=1000))
    wait_until(lambda: engine.stats()["active"] == 1)
    engine.close()
    with pytest.raises(BackendUnavailableError):
        handle.result(timeout=10)
    with pytest.raises(BackendUnavailableError):
        engine.submit([1], SamplingParams(max_tokens=2))


def test_stream_can_be_consumed_once(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    handle = engine.submit([1], SamplingParams(max_tokens=3))
    assert len(list(handle)) >= 1
    with pytest.raises(RuntimeError):
        iter(handle)
    assert handle.result().completion_tokens == 3


def test_model_default_sampler_applies_to_unset_fields(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    params = engine.sampling_params(temperature=None, max_tokens=4, seed=1)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 64, 0.95)
