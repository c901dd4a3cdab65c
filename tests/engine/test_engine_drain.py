"""Graceful drain (``Engine.drain``, ``Runtime.drain``): a submit during the drain is refused with
``EngineDrainingError``, the requests already running or queued finish with their whole output, or
end with that error at the bound, and the engine closes with every block of its KV pool free."""

from __future__ import annotations

import threading

import pytest
from engine_fakes import HashModel
from test_engine_core import wait_until

from flm_runtime.api import Runtime
from flm_runtime.registry import DEFAULT_TAG
from flm_runtime.errors import BackendUnavailableError, EngineDrainingError, InvalidRequestError
from flm_runtime.request import SamplingParams
from flm_runtime.settings import DRAIN_TIMEOUT_S, Settings

PROMPTS = [[1, 2, 3], [40, 41], [7] * 9, [200, 100, 50, 25]]
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


def test_a_drain_refuses_new_requests_and_lets_the_submitted_ones_finish(make_engine, tok):
    alone = [r.token_ids for r in (make_engine(HashModel(), tok).submit(p, PARAMS).result() for p in PROMPTS)]
    engine = make_engine(HashModel(delay=0.005), tok, max_active=3)  # the fourth waits in the queue
    with engine.held():
        handles = [engine.submit(p, PARAMS) for p in PROMPTS]
    finished = []
    drainer = threading.Thread(target=lambda: finished.append(engine.drain(timeout=120)))
    drainer.start()
    wait_until(lambda: engine.stats()["draining"])
    with pytest.raises(EngineDrainingError, match="shutting down and takes no new request"):
        engine.submit([1], PARAMS)
    assert [h.result(timeout=120).token_ids for h in handles] == alone
    drainer.join(timeout=120)
    assert finished == [True]
    stats = engine.stats()
    assert (stats["finished"], stats["failed"], stats["kv_blocks_used"]) == (4, 0, 0)
    assert engine.pool.available == engine.pool.n_blocks
    with pytest.raises(BackendUnavailableError, match="is closed"):
        engine.submit([1], PARAMS)


def test_the_drain_bound_ends_the_requests_left(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok)
    running = engine.submit([1], SamplingParams(max_tokens=2000, ignore_eos=True))
    wait_until(lambda: engine.stats()["active"] == 1)
    assert engine.drain(timeout=0.1) is False
    with pytest.raises(EngineDrainingError, match="shut down before the request finished: it drained for 0.1 s"):
        running.result(timeout=10)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.pool.available == engine.pool.n_blocks


def test_a_drain_frees_the_prefix_cache_blocks_too(make_engine, smollm2_quantized, smollm2_tokenizer):
    engine = make_engine(smollm2_quantized, smollm2_tokenizer, name="drained")
    prompt = smollm2_tokenizer.encode("Once upon a time " * 40)
    engine.submit(prompt, SamplingParams(max_tokens=2)).result(timeout=120)
    assert engine.stats()["kv_cached_bytes"] > 0
    assert engine.drain(timeout=10) is True
    stats = engine.stats()
    assert (stats["kv_blocks_used"], stats["kv_cached_bytes"]) == (0, 0)
    assert engine.pool.available == engine.pool.n_blocks


def test_a_runtime_drain_drains_its_engines_and_loads_no_new_one(smollm2_gguf):
    runtime = Runtime(Settings())
    try:
        engine = runtime.get_engine(DEFAULT_TAG)
        ids = engine.tokenizer.encode("The capital of France is")
        handles = [engine.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True)) for n in (8, 12)]
        assert runtime.drain() is True
        assert [h.result(timeout=10).completion_tokens for h in handles] == [8, 12]
        assert engine.stats()["kv_blocks_used"] == 0 and engine.pool.available == engine.pool.n_blocks
        with pytest.raises(EngineDrainingError, match=f"shutting down and serves no new request for '{DEFAULT_TAG}'"):
            runtime.get_engine(DEFAULT_TAG)
        with pytest.raises(BackendUnavailableError, match="is closed"):
            engine.submit(ids, PARAMS)
    finally:
        runtime.close()


def test_the_drain_bound_setting():
    assert Settings().drain_timeout() == DRAIN_TIMEOUT_S
    assert Settings(drain_timeout_s="2.5").drain_timeout() == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(InvalidRequestError, match=f"FLM_DRAIN_TIMEOUT_S must be a non-negative number of "
                                                      f"seconds, got '{bad}'"):
            Settings(drain_timeout_s=bad).drain_timeout()
