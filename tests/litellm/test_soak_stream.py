"""The soak's stall detector, per-request accounting and plan, on fake streams with a fake clock:
gaps before the first token, between tokens and after the last one; tokens and verify passes
from the final usage; an error mid-stream is counted, not raised; a request that is not streamed
is judged by the engine's gaps; a cancelled stream is closed after its chunks; structured output that ends with
``stop`` must parse; the schedule's requests; resident memory growth between quarters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flm_bench import soak
from flm_bench.soak import Kind, Plan, Result, StallWatch, watch_stream


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(text="", finish=None, usage=None):
    delta = SimpleNamespace(content=text)
    return SimpleNamespace(choices=[SimpleNamespace(delta=delta, finish_reason=finish)], usage=usage)


def fake_stream(clock: FakeClock, steps):
    """Yields chunks after advancing the clock: ``steps`` = [(seconds before, chunk), ...]."""
    for wait, c in steps:
        clock.now += wait
        yield c


def test_stall_watch_counts_gaps_over_the_threshold():
    clock = FakeClock()
    w = StallWatch(10.0, clock)
    w.start()
    for wait in (2.0, 10.0, 10.5, 0.1):  # exactly the threshold is not a stall
        clock.now += wait
        w.mark()
    assert (w.stalls, w.max_gap) == (1, 10.5)


def test_watch_stream_marks_token_chunks_and_the_end_only():
    clock = FakeClock()
    steps = [(1.0, chunk("a")), (12.0, chunk("")), (1.0, chunk("b")), (30.0, chunk("", finish="stop"))]
    w = StallWatch(10.0, clock)
    got = list(watch_stream(fake_stream(clock, steps), w, lambda c: bool(c.choices[0].delta.content)))
    assert len(got) == 4
    # gaps: start->a 1 s, a->b 13 s (the empty chunk is no token), b->end 30 s
    assert (w.stalls, w.max_gap) == (2, 30.0)


def test_first_token_stall_is_a_stall():
    clock = FakeClock()
    w = StallWatch(5.0, clock)
    list(watch_stream(fake_stream(clock, [(6.0, chunk("x"))]), w, lambda c: True))
    assert w.stalls == 1


def usage(completion_tokens, accepted=None, rejected=None):
    details = None if accepted is None else SimpleNamespace(accepted_prediction_tokens=accepted,
                                                            rejected_prediction_tokens=rejected)
    return SimpleNamespace(prompt_tokens=30, completion_tokens=completion_tokens, completion_tokens_details=details)


def plan(stream=True, cancel_after=0, **params):
    return Plan(Kind("short", "greedy", stream), {"messages": [{"role": "user", "content": "hi"}], **params},
                cancel_after)


def send(fake, plan, result, **kw):
    """``one_request`` with ``fake`` as LiteLLM's completion and text completion; returns ``result``."""
    soak.one_request("flm/x", plan, result, completion=fake, text_completion=fake,
                     **{"stall_s": 10.0, "timeout": 60.0, "block_drafts": 7} | kw)
    return result


def test_one_request_counts_tokens_verify_passes_and_timing():
    clock = FakeClock()
    steps = [(0.5, chunk("Hel")), (0.2, chunk("lo")), (0.1, chunk("", finish="length")),
             (0.0, SimpleNamespace(choices=[], usage=usage(12, accepted=20, rejected=36)))]
    calls = []

    def completion(**kw):
        calls.append(kw)
        return fake_stream(clock, steps)

    r = send(completion, plan(max_tokens=12), Result(1, "short", "greedy", True, 12), clock=clock)
    assert calls[0]["stream"] is True and calls[0]["max_tokens"] == 12 and calls[0]["timeout"] == 60.0
    assert (r.completion_tokens, r.prompt_tokens, r.finish_reason) == (12, 30, "length")
    assert (r.verify_passes, r.accepted_tokens) == (8, 20)  # (20 + 36) drafted / 7 per pass
    assert r.ttft_s == pytest.approx(0.5) and r.seconds == pytest.approx(0.8)
    assert (r.stalls, r.error) == (0, "")


def test_one_request_counts_an_error_and_goes_on():
    clock = FakeClock()

    def broken(**kw):
        yield chunk("a")
        raise RuntimeError("engine went away")

    r = send(broken, plan(), Result(2, "long", "sampled", True, 8), block_drafts=0, clock=clock)
    assert r.error == "RuntimeError: engine went away" and r.completion_tokens == 0 and r.verify_passes == 0


class ClosableStream:
    """A fake LiteLLM stream that records ``close()`` and stops yielding once closed."""

    def __init__(self, clock, steps):
        self.chunks, self.closed, self.read = fake_stream(clock, steps), False, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        self.read += 1
        return next(self.chunks)

    def close(self):
        self.closed = True


def test_a_cancelled_stream_is_closed_after_its_chunks():
    clock = FakeClock()
    stream = ClosableStream(clock, [(0.1, chunk("a")), (0.1, chunk("")), (0.1, chunk("b")), (0.1, chunk("c"))])
    r = send(lambda **kw: stream, plan(cancel_after=2), Result(3, "cancelled", "sampled", True, 99), clock=clock)
    assert stream.closed and stream.read == 3  # "a", the empty chunk, "b": closed before "c"
    assert (r.finish_reason, r.completion_tokens, r.error) == ("cancelled", 0, "")
    assert r.seconds == pytest.approx(0.3) and r.ttft_s == pytest.approx(0.1)


def test_a_request_not_streamed_is_judged_by_the_engines_gaps():
    clock = FakeClock()
    calls = []

    def answer(seconds, stats):
        def completion(**kw):
            calls.append(kw)
            clock.now += seconds
            message = SimpleNamespace(content="Paris.")
            return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")],
                                   usage=usage(3, accepted=6, rejected=1), _hidden_params={"flm_stats": stats})
        return completion

    # 40 s to the answer, tokens every half second from 0.5 s on: no stall, though the client waited
    steady = {"ttft_s": 0.5, "max_gap_s": 0.5, "generated_tokens": 79, "decode_tokens_per_s": 2.0, "total_s": 39.8}
    r = send(answer(40.0, steady), plan(stream=False, max_tokens=8), Result(4, "short", "greedy", False, 8),
             clock=clock)
    assert calls[0]["stream"] is False and "stream_options" not in calls[0]
    assert (r.completion_tokens, r.verify_passes, r.accepted_tokens, r.finish_reason) == (3, 1, 6, "stop")
    assert (r.stalls, r.ttft_s, r.seconds) == (0, 40.0, 40.0)
    assert r.max_gap_s == pytest.approx(0.7)  # the first token: 0.5 s in the engine, 0.2 s outside it
    # 12 s, one gap of 10.5 s between two tokens inside the engine: one stall (at 10 s)
    stuck = {"ttft_s": 0.5, "max_gap_s": 10.5, "generated_tokens": 3, "decode_tokens_per_s": 2 / 11.0, "total_s": 12.0}
    r = send(answer(12.0, stuck), plan(stream=False, max_tokens=8), Result(5, "short", "greedy", False, 8),
             clock=clock)
    assert (r.stalls, r.max_gap_s) == (1, 10.5)


def test_engine_gaps_split_a_request_that_was_not_streamed():
    stats = {"ttft_s": 2.0, "max_gap_s": 1.5, "generated_tokens": 11, "decode_tokens_per_s": 2.0, "total_s": 7.25}
    assert soak.engine_gaps(stats, elapsed_s=7.5) == pytest.approx((2.25, 1.5, 0.25))
    assert soak.engine_gaps(stats | {"ttft_s": None}, elapsed_s=7.5) == (7.5, 0.0, 0.0)  # no token at all


@pytest.mark.parametrize("text, finish, error", [
    ('{"name": "Paris", "country": "France", "number": 2}', "stop", ""),
    ('{"name": "Paris", "country": "France"}', "stop", "ValueError: structured output"),
    ('{"name": "Par', "stop", "JSONDecodeError"),
    ('{"name": "Par', "length", ""),  # cut by max_tokens: not checked
])
def test_structured_output_that_stops_must_parse_with_its_keys(text, finish, error):
    clock = FakeClock()
    steps = [(0.1, chunk(text[:5])), (0.1, chunk(text[5:], finish=finish))]
    r = send(lambda **kw: fake_stream(clock, steps), plan(response_format=soak.RESPONSE_FORMAT),
             Result(5, "structured", "greedy", True, 64), block_drafts=0, clock=clock)
    assert r.error.startswith(error) and bool(r.error) == bool(error)


def plan_args(schedule="chat"):
    return SimpleNamespace(schedule=schedule, long_tokens=2048, short_tokens=128, cancel_after=32, seed=10)


DEFAULTS = SimpleNamespace(temperature=0.2, top_p=0.9, top_k=0)


def test_request_plan_cycles_the_chat_schedule():
    plans = [soak.request_plan(i, plan_args(), DEFAULTS, lambda j: f"<excerpt {j}>", {}) for i in range(16)]
    assert [p.kind for p in plans] == list(soak.CHAT) * 2
    assert [(p.request["max_tokens"], p.cancel_after) for p in plans[:8]] == [
        (2048, 0), (128, 0), (128, 0), (128, 0), (2048, 0), (2048, 32), (128, 0), (128, 0)]
    long_greedy, short_sampled, document, structured, _, cancelled, *_ = plans
    user = {"messages": [{"role": "user", "content": soak.LONG_PROMPTS[0]}]}
    assert long_greedy.request == user | {"max_tokens": 2048, "temperature": 0.0}
    assert short_sampled.request == {"messages": [{"role": "user", "content": soak.SHORT_PROMPTS[0]}],
                                     "max_tokens": 128, "temperature": 0.2, "top_p": 0.9, "seed": 11}
    assert structured.request["response_format"] == soak.RESPONSE_FORMAT and structured.request["seed"] == 13
    assert cancelled.request["ignore_eos"] is True and "ignore_eos" not in long_greedy.request
    assert document.request["messages"] == [{"role": "user",
                                             "content": soak.documents.SUMMARY_INSTRUCTION + "<excerpt 0>"}]
    assert plans[10].request["messages"][0]["content"].endswith("<excerpt 1>")  # each turn a new excerpt
    assert plans[8].request["messages"] == [{"role": "user", "content": soak.LONG_PROMPTS[1]}]
    assert all(p.task is None and p.next(soak.workloads.Answer("x")) is None for p in plans)


def test_request_plan_cycles_the_coding_schedule_over_the_workload_tasks():
    tasks = soak.coding_tasks(512, 64)
    assert {k: len(v) for k, v in tasks.items()} == {"edit": 14, "fim": 7, "agent": 8}
    plans = [soak.request_plan(i, plan_args("coding"), DEFAULTS, lambda j: "", tasks) for i in range(16)]
    assert [p.kind for p in plans] == list(soak.CODING) * 2
    edit, fim, agent, structured, edit_sampled, cancelled, *_ = plans
    assert edit.task is tasks["edit"][0] and edit.request == tasks["edit"][0].request | {"temperature": 0.0}
    assert edit.request["max_tokens"] == 512 and fim.request["max_tokens"] == soak.workloads.FIM_MAX_TOKENS
    assert fim.request["suffix"] and fim.request["seed"] == 11 and agent.request["tools"]
    assert plans[8].task is tasks["edit"][1] and edit_sampled.task is tasks["edit"][0]
    assert structured.request["response_format"] == soak.RESPONSE_FORMAT and structured.task is None
    assert cancelled.request["messages"] == tasks["edit"][0].request["messages"] and cancelled.cancel_after == 32
    assert cancelled.request["ignore_eos"] is True and cancelled.task is None


def test_a_conversation_goes_on_with_its_sampler():
    tasks = soak.coding_tasks(512, 64)
    fim = soak.request_plan(1, plan_args("coding"), DEFAULTS, lambda j: "", tasks)
    pauses = [fim]
    while (nxt := pauses[-1].next(soak.workloads.Answer("x = 1"))) is not None:
        pauses.append(nxt)
    assert len(pauses) == soak.workloads.FIM_PAUSES and [p.answered for p in pauses] == list(range(6))
    assert [p.request["prompt"] for p in pauses] == [r["prompt"] for r in (fim.task.request, *fim.task.next_requests)]
    assert all(p.request["seed"] == 11 and p.request["temperature"] == 0.2 for p in pauses)
    agent = soak.request_plan(2, plan_args("coding"), DEFAULTS, lambda j: "", tasks)
    assert agent.next(soak.workloads.Answer("It is sunny.")) is None  # no tool call: the conversation ends
    called = agent.next(soak.workloads.Answer(None, (("get_weather", '{"city": "Lisbon"}'),)))
    assert [m["role"] for m in called.request["messages"][-2:]] == ["assistant", "tool"]
    assert called.request["temperature"] == 0.0 and called.answered == 1


def test_a_text_completion_goes_to_text_completion_and_a_tool_call_is_a_token():
    clock = FakeClock()
    text_chunk = SimpleNamespace(choices=[SimpleNamespace(text="ab", finish_reason=None)], usage=None)
    calls = []

    def completion(**kw):
        calls.append(kw)
        return fake_stream(clock, [(0.5, text_chunk), (0.2, chunk("", finish="length"))])

    fim = Plan(Kind("fim", "greedy", True), {"prompt": "def f(", "suffix": "\n", "max_tokens": 4})
    r = Result(6, "fim", "greedy", True, 4)
    answer = soak.one_request("flm/x", fim, r, stall_s=10.0, timeout=60.0, block_drafts=0, clock=clock,
                              completion=lambda **kw: pytest.fail("a text completion went to completion"),
                              text_completion=completion)
    assert calls[0]["prompt"] == "def f(" and calls[0]["suffix"] == "\n"
    assert answer.content == "ab" and r.ttft_s == pytest.approx(0.5) and r.error == ""
    delta = SimpleNamespace(content=None, tool_calls=[SimpleNamespace(index=0)])
    assert soak._has_token(SimpleNamespace(choices=[SimpleNamespace(delta=delta, finish_reason=None)]))
    assert not soak._has_token(chunk(""))


def test_document_excerpts_are_distinct_windows_of_the_shipped_documents(smollm2_engine):
    tokenizer = smollm2_engine.tokenizer
    excerpt = soak.document_excerpts(tokenizer, 40)
    ids = [t for d in soak.documents.load_documents() for t in tokenizer.encode(d.text)]
    assert excerpt(0) == tokenizer.decode(ids[:40])
    assert excerpt(2) == tokenizer.decode(ids[2 * soak.DOCUMENT_STRIDE:2 * soak.DOCUMENT_STRIDE + 40])
    with pytest.raises(ValueError, match="--document-tokens"):
        soak.document_excerpts(tokenizer, len(ids) + 1)


def test_rss_growth_compares_the_first_and_last_quarters():
    results = [Result(i, "short", "greedy", True, 1, rss_mb=mb) for i, mb in enumerate([100, 300, 200, 200, 102, 106])]
    assert soak.rss_growth(results) == pytest.approx(0.06)  # quarters of one request: 100 -> 106
    readings = [100, 110, 0, 0, 0, 0, 105, 105]
    results = [Result(i, "short", "greedy", True, 1, rss_mb=mb) for i, mb in enumerate(readings)]
    assert soak.rss_growth(results) == pytest.approx(0.0)  # quarters of two: 105 -> 105
