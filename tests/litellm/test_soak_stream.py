"""The soak's stall detector and per-request accounting, on fake streams with a fake clock:
gaps before the first token, between tokens and after the last one; tokens and verify passes
from the final usage; an error mid-stream is counted, not raised."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flm_bench.soak import Result, StallWatch, one_request, watch_stream


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


def test_one_request_counts_tokens_verify_passes_and_timing():
    clock = FakeClock()
    steps = [(0.5, chunk("Hel")), (0.2, chunk("lo")), (0.1, chunk("", finish="length")),
             (0.0, SimpleNamespace(choices=[], usage=usage(12, accepted=20, rejected=36)))]
    calls = []

    def completion(**kw):
        calls.append(kw)
        return fake_stream(clock, steps)

    r = one_request(completion, "flm/x", "hi", {"max_tokens": 12}, Result(1, "short", "greedy", 12),
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

    r = one_request(broken, "flm/x", "hi", {}, Result(2, "long", "sampled", 8), stall_s=10.0, timeout=60.0,
                    block_drafts=0, clock=clock)
    assert r.error == "RuntimeError: engine went away" and r.completion_tokens == 0 and r.verify_passes == 0
