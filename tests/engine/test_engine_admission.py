"""Admission control on fake models: the KV memory budget (refused alone, waiting when momentarily
full), the bounded queue, timeouts while waiting, the stats that show nothing is left behind, the
stats log line, and the limits read from the environment.

The fake models' geometry (``engine_fakes.fake_config``: 1 layer, 1 KV head of width 4) makes one
position 2 * 1 * 1 * 4 * 4 = 32 bytes of float32 K and V.
"""

from __future__ import annotations

import json
import logging

import pytest
from engine_fakes import HashModel
from spec_fakes import ScriptTarget, random_draft
from test_engine_core import idle, wait_until

from flm_runtime.core import LlamaConfig
from flm_runtime.errors import EngineOverloadedError, InvalidRequestError, KVBudgetError, RequestTimeoutError
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling import admission
from flm_runtime.settings import Settings
from flm_runtime.speculation.speculative import SpeculativeDecoder

BYTES_PER_TOKEN = 32  # the fake models' float32 K and V of one position


def test_kv_bytes_per_token_of_smollm2_with_and_without_a_draft():
    # SmolLM2-135M (docs/design.md, "The embedded model"): 30 layers, 3 KV heads of 64; a 1-layer
    # draft of the same heads.
    target = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    draft = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
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
    assert s["kv_budget_bytes"] == 4 * 2048 * BYTES_PER_TOKEN
    assert (s["active"], s["queued"], s["kv_tokens"], s["kv_bytes"], s["kv_reserved_bytes"]) == (0, 0, 0, 0, 0)


def test_a_request_that_cannot_fit_alone_is_refused_naming_max_tokens(make_engine, tok):
    engine = make_engine(HashModel(), tok, kv_budget=100 * BYTES_PER_TOKEN)
    with pytest.raises(KVBudgetError) as e:
        engine.submit([1] * 10, SamplingParams(max_tokens=91))
    err = e.value
    assert (err.param, err.prompt_tokens, err.max_tokens) == ("max_tokens", 10, 91)
    assert (err.need_bytes, err.budget_bytes) == (101 * 32, 3200)
    assert str(err) == ("engine 'fake': the prompt (10 tokens) and max_tokens (91) may need 3,232 bytes of KV "
                        "cache (32 bytes per token), more than the engine's whole KV budget of 3,200 bytes "
                        "(100 tokens); lower max_tokens or raise FLM_KV_BUDGET")
    assert engine.submit([1] * 10, SamplingParams(max_tokens=90)).result(timeout=10).completion_tokens == 90
    assert idle(engine) and engine.stats()["failed"] == 0


def test_max_tokens_unset_is_cut_by_a_budget_smaller_than_the_context(make_engine, tok):
    engine = make_engine(HashModel(context=2048), tok, kv_budget=100 * BYTES_PER_TOKEN)
    done = engine.submit([1] * 10, SamplingParams()).result(timeout=10)
    assert (done.finish_reason, done.completion_tokens) == ("length", 90)


def test_the_speculative_reservation_counts_the_draft_and_the_verify_block(make_engine, tok):
    target = ScriptTarget([5] * 50, prompt_len=10)
    spec = SpeculativeDecoder(target, random_draft(target, taps=[0]))
    engine = make_engine(target, tok, speculative=spec, kv_budget=1000)
    # target 2 * 2 layers * 1 head * 4 * 4 B = 64 B; the 1-layer draft 32 B; 7 verify positions more
    assert engine.kv.bytes_per_token == 96
    with pytest.raises(KVBudgetError) as e:
        engine.submit([1] * 10, SamplingParams(max_tokens=20))
    assert e.value.need_bytes == (10 + 20 + 7) * 96


def test_requests_wait_while_the_budget_is_full_then_all_complete(make_engine, tok):
    model = HashModel(delay=0.01)
    engine = make_engine(model, tok, kv_budget=100 * BYTES_PER_TOKEN)  # room for two 50-token requests
    handles = [engine.submit([i + 1] * 10, SamplingParams(max_tokens=40)) for i in range(3)]
    wait_until(lambda: engine.stats()["active"] == 2)
    s = engine.stats()
    assert (s["active"], s["queued"], s["kv_reserved_bytes"]) == (2, 1, 2 * 50 * BYTES_PER_TOKEN)
    assert s["kv_bytes"] == s["kv_tokens"] * BYTES_PER_TOKEN > 0
    assert [h.result(timeout=30).completion_tokens for h in handles] == [40, 40, 40]
    assert idle(engine) and engine.stats()["kv_reserved_bytes"] == engine.stats()["kv_bytes"] == 0
    assert engine.stats()["finished"] == 3


def test_the_first_in_line_is_not_overtaken_by_smaller_requests(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=100 * BYTES_PER_TOKEN)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=40))           # 50 tokens reserved
    wait_until(lambda: engine.stats()["active"] == 1)
    large = engine.submit([2] * 10, SamplingParams(max_tokens=80))             # 90: waits for `running`
    small = engine.submit([3] * 2, SamplingParams(max_tokens=2))               # 4 would fit, but is behind
    assert (engine.stats()["active"], engine.stats()["queued"]) == (1, 2)
    assert [h.result(timeout=30).completion_tokens for h in (running, large, small)] == [40, 80, 2]
    # admitted in arrival order, and `large` only once `running` had ended (perf_counter seconds)
    ended = running.t_submit + running.result().stats.total_s
    assert ended <= admitted(large) <= admitted(small)


def admitted(handle) -> float:
    """``time.perf_counter()`` at which the engine admitted the request."""
    return handle.t_submit + handle.result().stats.queue_s


def test_queue_full_while_the_budget_is_full_is_refused_at_once(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=60 * BYTES_PER_TOKEN, max_queue=2)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=40))
    wait_until(lambda: engine.stats()["active"] == 1)
    waiting = [engine.submit([2] * 10, SamplingParams(max_tokens=40)) for _ in range(2)]
    with pytest.raises(EngineOverloadedError) as e:
        engine.submit([3] * 10, SamplingParams(max_tokens=40))
    assert str(e.value) == ("engine 'fake' is full: 2 requests waiting (max_queue=2), 1 running (max_active=16), "
                            "1,600 of 1,920 KV bytes reserved; retry later")
    for h in (running, *waiting):
        h.cancel()
    wait_until(lambda: idle(engine))
    assert engine.stats()["cancelled"] == 3 and engine.stats()["kv_reserved_bytes"] == 0


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
    engine = make_engine(HashModel(delay=0.01), tok, kv_budget=60 * BYTES_PER_TOKEN)
    running = engine.submit([1] * 10, SamplingParams(max_tokens=40))
    waiting = engine.submit([2] * 10, SamplingParams(max_tokens=40), timeout=0.05)
    with pytest.raises(RequestTimeoutError):
        waiting.result(timeout=10)
    assert running.result(timeout=30).completion_tokens == 40
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
        "name": "fake", "active": 0, "queued": 0, "kv_tokens": 0, "kv_bytes": 0, "kv_reserved_bytes": 0,
        "kv_budget_bytes": 4 * 2048 * BYTES_PER_TOKEN, "kv_cached_bytes": 0, "finished": 1, "failed": 0,
        "cancelled": 0, "timed_out": 0}


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
