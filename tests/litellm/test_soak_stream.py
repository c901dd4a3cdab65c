"""The soak's stall detector, per-request accounting and plan, on fake streams with a fake clock:
gaps before the first token, between tokens and after the last one; tokens and verify passes
from the final usage; an error mid-stream is counted, not raised; a request that is not streamed
is one gap; a cancelled stream is closed after its chunks; structured output that ends with
``stop`` must parse; the schedule's requests; resident memory growth between quarters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flm_bench import soak
from flm_bench.soak import Kind, Plan, Result, StallWatch, one_request, watch_stream


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
    return Plan(Kind("short", "greedy", stream), [{"role": "user", "content": "hi"}], params, cancel_after)


def test_one_request_counts_tokens_verify_passes_and_timing():
    clock = FakeClock()
    steps = [(0.5, chunk("Hel")), (0.2, chunk("lo")), (0.1, chunk("", finish="length")),
             (0.0, SimpleNamespace(choices=[], usage=usage(12, accepted=20, rejected=36)))]
    calls = []

    def completion(**kw):
        calls.append(kw)
        return fake_stream(clock, steps)

    r = one_request(completion, "flm/x", plan(max_tokens=12), Result(1, "short", "greedy", True, 12),
                    stall_s=10.0, timeout=60.0, block_drafts=7, clock=clock)
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

    r = one_request(broken, "flm/x", plan(), Result(2, "long", "sampled", True, 8), stall_s=10.0, timeout=60.0,
                    block_drafts=0, clock=clock)
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
    r = one_request(lambda **kw: stream, "flm/x", plan(cancel_after=2), Result(3, "cancelled", "sampled", True, 99),
                    stall_s=10.0, timeout=60.0, block_drafts=7, clock=clock)
    assert stream.closed and stream.read == 3  # "a", the empty chunk, "b": closed before "c"
    assert (r.finish_reason, r.completion_tokens, r.error) == ("cancelled", 0, "")
    assert r.seconds == pytest.approx(0.3) and r.ttft_s == pytest.approx(0.1)


def test_a_request_not_streamed_is_one_gap():
    clock = FakeClock()
    calls = []

    def completion(**kw):
        calls.append(kw)
        clock.now += 12.0
        message = SimpleNamespace(content="Paris.")
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")],
                               usage=usage(3, accepted=6, rejected=1))

    r = one_request(completion, "flm/x", plan(stream=False, max_tokens=8), Result(4, "short", "greedy", False, 8),
                    stall_s=10.0, timeout=60.0, block_drafts=7, clock=clock)
    assert calls[0]["stream"] is False and "stream_options" not in calls[0]
    assert (r.completion_tokens, r.verify_passes, r.accepted_tokens, r.finish_reason) == (3, 1, 6, "stop")
    assert (r.stalls, r.max_gap_s, r.ttft_s) == (1, 12.0, 12.0)  # 12 s before the answer: one stall


@pytest.mark.parametrize("text, finish, error", [
    ('{"name": "Paris", "country": "France", "number": 2}', "stop", ""),
    ('{"name": "Paris", "country": "France"}', "stop", "ValueError: structured output"),
    ('{"name": "Par', "stop", "JSONDecodeError"),
    ('{"name": "Par', "length", ""),  # cut by max_tokens: not checked
])
def test_structured_output_that_stops_must_parse_with_its_keys(text, finish, error):
    clock = FakeClock()
    steps = [(0.1, chunk(text[:5])), (0.1, chunk(text[5:], finish=finish))]
    r = one_request(lambda **kw: fake_stream(clock, steps), "flm/x", plan(response_format=soak.RESPONSE_FORMAT),
                    Result(5, "structured", "greedy", True, 64), stall_s=10.0, timeout=60.0, block_drafts=0,
                    clock=clock)
    assert r.error.startswith(error) and bool(r.error) == bool(error)


def test_request_plan_cycles_the_schedule():
    args = SimpleNamespace(long_tokens=2048, short_tokens=128, cancel_after=32, seed=10)
    defaults = SimpleNamespace(temperature=0.2, top_p=0.9, top_k=0)
    plans = [soak.request_plan(i, args, defaults, lambda j: f"<excerpt {j}>") for i in range(16)]
    assert [p.kind for p in plans] == list(soak.SCHEDULE) * 2
    assert [(p.params["max_tokens"], p.cancel_after) for p in plans[:8]] == [
        (2048, 0), (128, 0), (128, 0), (128, 0), (2048, 0), (2048, 32), (128, 0), (128, 0)]
    long_greedy, short_sampled, document, structured, _, cancelled, *_ = plans
    assert long_greedy.params == {"max_tokens": 2048, "temperature": 0.0}
    assert short_sampled.params == {"max_tokens": 128, "temperature": 0.2, "top_p": 0.9, "seed": 11}
    assert structured.params["response_format"] == soak.RESPONSE_FORMAT and structured.params["seed"] == 13
    assert cancelled.params["ignore_eos"] is True and "ignore_eos" not in long_greedy.params
    assert document.messages == [{"role": "user", "content": soak.documents.SUMMARY_INSTRUCTION + "<excerpt 0>"}]
    assert plans[10].messages[0]["content"].endswith("<excerpt 1>")  # each turn summarizes a new excerpt
    assert plans[8].messages == [{"role": "user", "content": soak.LONG_PROMPTS[1]}]


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
