"""Admission control on fake models: the KV pool (refused alone, waiting when momentarily full,
preemption when it runs out mid-decode), the bounded queue, timeouts while waiting, the stats that show nothing is left behind, the
stats log line, and the limits read from the environment.

The fake models' geometry (``engine_fakes.fake_config``: 1 layer, 1 KV head of width 4) makes one
position 2 * 1 * 1 * 4 * 4 = 32 bytes of float32 K and V; their pools have blocks of 16 positions.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from engine_fakes import HashModel
from spec_fakes import ScriptTarget, random_draft
from test_engine_core import idle, wait_until

from flm_runtime.errors import EngineOverloadedError, InvalidRequestError, KVBudgetError, RequestTimeoutError
from flm_runtime.model_config import ModelConfig
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling import admission
from flm_runtime.settings import Settings
from flm_runtime.speculation.speculative import SpeculativeDecoder

BYTES_PER_TOKEN = 32  # the fake models' float32 K and V of one position


def test_kv_bytes_per_token_of_smollm2_with_and_without_a_draft():
    # SmolLM2-135M (docs/design.md, "The embedded model"): 30 layers, 3 KV heads of 64; a 1-layer
    # draft of the same heads.
    target = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    draft = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    assert admission.kv_bytes_per_token(target) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert admission.kv_bytes_per_token(target, draft) == 46_080 + 2 * 1 * 3 * 64 * 4
    assert admission.default_kv_budget(8192, 46_080) == 1_509_949_440  # 4 full contexts
    # a quantized target's float16 cache: half the target's bytes, the draft's stay float32
    assert admission.kv_bytes_per_token(target, draft, target_itemsize=2) == 23_040 + 2 * 1 * 3 * 64 * 4


def test_default_budget_is_four_contexts_and_idle_stats_are_zero(make_engine, tok):
    engine = make_engine(HashModel(context=2048), tok)
    assert engine.kv.bytes_per_token == BYTES_PER_TOKEN
    s = engine.stats()
    assert (s["kv_budget_bytes"], s["kv_blocks"], s["kv_block_tokens"]) == (4 * 2048 * BYTES_PER_TOKEN, 512, 16)
    assert (s["active"], s["queued"], s["kv_tokens"], s["kv_blocks_used"], s["kv_bytes"]) == (0, 0, 0, 0, 0)


def test_a_request_that_cannot_fit_alone_is_refused_naming_max_tokens(make_engine, tok):
    engine = make_engine(HashModel(), tok, kv_budget=100 * BYTES_PER_TOKEN)  # 6 blocks of 16 positions
    with pytest.raises(KVBudgetError) as e:
        engine.submit([1] * 10, SamplingParams(max_tokens=87))  # 97 positions: 7 blocks
    err = e.value
    assert (err.param, err.prompt_tokens, err.max_tokens) == ("max_tokens", 10, 87)
    assert (err.need_bytes, err.budget_bytes) == (7 * 16 * 32, 3200)
    assert str(err) == ("engine 'fake': the prompt (10 tokens) and max_tokens (87) may need 3,584 bytes of KV "
                        "cache (32 bytes per token), more than the engine's whole KV budget of 3,200 bytes "
                        "(100 tokens); lower max_tokens or raise FLM_KV_BUDGET")
    assert engine.submit([1] * 10, SamplingParams(max_tokens=86)).result(timeout=10).completion_tokens == 86
    assert idle(engine) and engine.stats()["failed"] == 0


def test_max_tokens_unset_is_cut_by_a_budget_smaller_than_the_context(make_engine, tok):
    engine = make_engine(HashModel(context=2048), tok, kv_budget=100 * BYTES_PER_TOKEN)
    done = engine.submit([1] * 10, SamplingParams()).result(timeout=10)
    assert (done.finish_reason, done.completion_tokens) == ("length", 6 * 16 - 10)


def test_the_speculative_budget_counts_the_draft_and_the_verify_block(make_engine, tok):
    target = ScriptTarget([5] * 50, prompt_len=10)
    spec = SpeculativeDecoder(target, random_draft(target, taps=[0]))
    engine = make_engine(target, tok, speculative=spec, kv_budget=3 * 16 * 96)
    # target 2 * 2 layers * 1 head * 4 * 4 B = 64 B; the 1-layer draft 32 B; 7 verify positions more
    assert engine.kv.bytes_per_token == 96 and engine.stats()["kv_blocks"] == 3
    with pytest.raises(KVBudgetError) as e:
        engine.submit([1] * 10, SamplingParams(max_tokens=40))
    assert e.value.need_bytes == 4 * 16 * 96  # 10 + 40 + 7 positions: 4 blocks


def test_running_out_of_blocks_preempts_and_every_request_gets_its_output_alone(make_engine, tok):
    """Three requests that grow to 4 blocks each in a pool of 6: all are admitted on their first
    block, the youngest are preempted as the oldest grow, recompute their context when admitted
    again, and each gives exactly what it gives alone in a large pool."""
    prompts = [[i + 1, 7, 3 * i + 2, 9, 4, 11, 5, 13, 2, i + 40] for i in range(3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=11)
    alone = make_engine(HashModel(), tok)
    want = [alone.submit(p, params).result(timeout=30) for p in prompts]
    engine = make_engine(HashModel(delay=0.002), tok, kv_budget=6 * 16 * BYTES_PER_TOKEN)
    with engine.held():
        handles = [engine.submit(p, params) for p in prompts]
    got = [h.result(timeout=60) for h in handles]
    assert [(g.token_ids, g.text) for g in got] == [(w.token_ids, w.text) for w in want]
    assert [(g.finish_reason, g.stats.generated_tokens) for g in got] == [("length", 40)] * 3
    stats = engine.stats()
    assert stats["preempted"] >= 1 and stats["finished"] == 3 and idle(engine)
    assert stats["kv_blocks_used"] == 0


def test_32_requests_without_max_tokens_are_all_admitted_under_the_default_budget(make_engine, tok):
    """Admission counts the blocks a request holds, not its worst case: 32 requests that may each
    run to the end of an 8,192-token context all run at once in a pool of 4 contexts."""
    engine = make_engine(HashModel(context=8192, delay=0.01), tok)
    with engine.held():
        handles = [engine.submit([i + 1] * 20, SamplingParams(ignore_eos=True)) for i in range(32)]
    wait_until(lambda: engine.stats()["active"] == 32)
    assert engine.stats()["queued"] == 0
    for h in handles:
        h.cancel()
    wait_until(lambda: idle(engine))
    assert engine.stats()["cancelled"] == 32 and engine.stats()["preempted"] == 0


def test_the_first_in_line_is_not_overtaken_by_smaller_requests(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=6 * 16 * BYTES_PER_TOKEN)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=40, ignore_eos=True))  # 1 block, then up to 4
    wait_until(lambda: engine.stats()["active"] == 1)
    large = engine.submit([2] * 70, SamplingParams(max_tokens=20, ignore_eos=True))    # 5 blocks: waits for `running`
    small = engine.submit([3] * 2, SamplingParams(max_tokens=2, ignore_eos=True))      # 1 would fit, but is behind
    assert (engine.stats()["active"], engine.stats()["queued"]) == (1, 2)
    assert [h.result(timeout=30).stats.generated_tokens for h in (running, large, small)] == [40, 20, 2]
    # admitted in arrival order, and `large` only once `running` had ended (perf_counter seconds)
    ended = running.t_submit + running.result().stats.total_s
    assert ended <= admitted(large) <= admitted(small)


def admitted(handle) -> float:
    """``time.perf_counter()`` at which the engine admitted the request."""
    return handle.t_submit + handle.result().stats.queue_s


def test_queue_full_while_the_pool_is_full_is_refused_at_once(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=3 * 16 * BYTES_PER_TOKEN, max_queue=2)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=30))
    wait_until(lambda: engine.stats()["active"] == 1)
    waiting = [engine.submit([2] * 40, SamplingParams(max_tokens=4)) for _ in range(2)]  # 3 blocks each
    with pytest.raises(EngineOverloadedError) as e:
        engine.submit([3] * 10, SamplingParams(max_tokens=4))
    assert re.fullmatch(r"engine 'fake' is full: 2 requests waiting \(max_queue=2\), 1 running \(max_active=64\), "
                        r"[123] of 3 KV blocks in use; retry later", str(e.value))
    for h in (running, *waiting):
        h.cancel()
    wait_until(lambda: idle(engine))
    assert engine.stats()["cancelled"] == 3 and engine.stats()["kv_blocks_used"] == 0


def test_a_burst_fills_the_free_slots_before_the_queue(make_engine, tok):
    """Requests that free slots will take at the next step hold no queue place: with 16 slots and a
    queue of 2, a burst of 18 is accepted at once, and the 19th is refused."""
    engine = make_engine(HashModel(delay=0.01), tok, max_active=16, max_queue=2)
    burst = [engine.submit([i + 1] * 4, SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(18)]
    with pytest.raises(EngineOverloadedError, match="is full: 2 requests waiting"):
        engine.submit([99] * 4, SamplingParams(max_tokens=6))
    done = [h.result(timeout=30) for h in burst]
    assert [(d.finish_reason, d.stats.generated_tokens) for d in done] == [("length", 6)] * 18


def test_timeout_while_waiting_for_kv_leaves_nothing_behind(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=3 * 16 * BYTES_PER_TOKEN)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=30))
    wait_until(lambda: engine.stats()["active"] == 1)
    waiting = engine.submit([2] * 40, SamplingParams(max_tokens=4), timeout=0.05)
    with pytest.raises(RequestTimeoutError):
        waiting.result(timeout=10)
    assert running.result(timeout=30).completion_tokens == 30
    assert engine.stats()["timed_out"] == 1 and idle(engine)


def test_each_request_end_logs_the_engine_stats(make_engine, tok, caplog):
    engine = make_engine(HashModel(), tok)
    with caplog.at_level(logging.INFO, logger="flm_runtime.scheduling.engine"):
        engine.submit([1, 2], SamplingParams(max_tokens=3)).result(timeout=10)
        wait_until(lambda: len(caplog.records) == 1)
    message = caplog.records[0].getMessage()
    head, stats = message.split(" engine stats ")
    assert head == "request finished;"
    assert json.loads(stats) == engine.stats() == {
        "name": "fake", "active": 0, "queued": 0, "kv_tokens": 0, "kv_block_tokens": 16, "kv_blocks": 512,
        "kv_blocks_used": 0, "kv_bytes": 0, "kv_budget_bytes": 4 * 2048 * BYTES_PER_TOKEN, "kv_cached_bytes": 0,
        "finished": 1, "failed": 0, "cancelled": 0, "timed_out": 0, "preempted": 0, "draining": False}


@pytest.mark.parametrize("environ, limits", [
    ({}, {}),
    ({"FLM_KV_BUDGET": "1000000", "FLM_MAX_QUEUE": " 8 "}, {"kv_budget": 1_000_000, "max_queue": 8}),
    ({"FLM_KV_BUDGET": ""}, {}),
])
def test_limits_from_env(environ, limits):
    assert Settings.from_env(environ).engine_limits() == limits


@pytest.mark.parametrize("environ, name", [({"FLM_KV_BUDGET": "1.5GB"}, "FLM_KV_BUDGET"),
                                           ({"FLM_MAX_QUEUE": "0"}, "FLM_MAX_QUEUE")])
def test_bad_env_limits_name_the_variable(environ, name):
    with pytest.raises(InvalidRequestError) as e:
        Settings.from_env(environ).engine_limits()
    assert e.value.param == name and repr(environ[name].strip()) in str(e.value)


@pytest.mark.parametrize("kw", [{"kv_budget": 0}, {"max_queue": -1}, {"max_active": 2.5}, {"prefill_tokens": 0}])
def test_bad_engine_limits_name_the_parameter(tok, kw):
    from flm_runtime.scheduling.engine import Engine

    with pytest.raises(InvalidRequestError) as e:
        Engine(HashModel(), tok, name="bad", **kw)
    assert e.value.param == next(iter(kw))
