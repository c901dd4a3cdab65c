"""Prefix caching (``scheduling/prefix_cache.py``): a request whose prompt starts with tokens a
finished sequence computed takes them from the cache and gets the tokens and logprobs it gets
cold, bit for bit (quantized weights), alone or beside a request that shares half its prefix;
the kept caches stay within the KV budget, least recently used first out."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flm_runtime.kv_cache import KVCache
from flm_runtime.errors import InvalidRequestError
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.engine import Engine
from flm_runtime.scheduling.prefix_cache import PrefixCache
from flm_runtime.settings import Settings

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def engines(smollm2_quantized, smollm2_tokenizer):
    cached = Engine(smollm2_quantized, smollm2_tokenizer, name="cached")
    cold = Engine(smollm2_quantized, smollm2_tokenizer, name="cold", prefix_cache=False)
    yield cached, cold
    cached.close()
    cold.close()


def _chat(tokenizer, text):
    return np.array(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                   add_generation_prompt=True)))


def _run(engine, prompts):
    handles = [engine.submit(p, GREEDY) for p in prompts]
    return [h.result() for h in handles]


def test_a_second_turn_takes_the_first_from_the_cache_and_gets_the_cold_bits(engines, smollm2_tokenizer):
    cached, cold = engines
    first = _chat(smollm2_tokenizer, "Name three rivers of Europe and say where each one flows.")
    [turn1] = _run(cached, [first])
    assert turn1.stats.cached_tokens == 0
    # The next turn: the whole history resent, as LiteLLM clients do, then a new question.
    second = np.concatenate([first, turn1.token_ids, smollm2_tokenizer.encode("\nAnd which is the longest?")])
    other = np.concatenate([second[:len(second) // 2], smollm2_tokenizer.encode(" Something else entirely.")])
    got = _run(cached, [second, other])  # side by side: one shares half of the other's prefix
    want = _run(cold, [second, other])
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
    # The cache held the first turn's prompt and every generated token but the last (never fed).
    assert got[0].stats.cached_tokens == len(first) + len(turn1.token_ids) - 1
    assert 0 < got[1].stats.cached_tokens <= len(second) // 2
    assert all(w.stats.cached_tokens == 0 for w in want)
    assert cached.stats()["kv_cached_bytes"] > 0 and cold.stats()["kv_cached_bytes"] == 0


def test_a_cancelled_request_leaves_its_prefix(engines, smollm2_tokenizer):
    cached, _ = engines
    prompt = _chat(smollm2_tokenizer, "Write a very long poem about the sea, the wind and the gulls.")
    stream = cached.submit(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for i, _event in enumerate(stream):
        if i == 3:
            stream.cancel()
            break
    deadline = time.monotonic() + 60
    while not stream.done and time.monotonic() < deadline:  # the engine drops it at its next step
        time.sleep(0.01)
    again = cached.submit(prompt, GREEDY).result()
    assert again.stats.cached_tokens == len(prompt) - 1


def test_a_request_that_reserves_the_whole_budget_still_takes_its_prefix(smollm2_quantized, smollm2_tokenizer):
    prompt = _chat(smollm2_tokenizer, "Name a colour.")
    n, new = 4, 300  # each reservation above the 256 positions a kept cache holds at least
    engine = Engine(smollm2_quantized, smollm2_tokenizer, name="small",
                    kv_budget=n * (len(prompt) + new) * (2 * 30 * 3 * 64 * 2))  # n sequences' K and V, float16
    try:
        assert engine.kv.budget == engine.kv.need(len(prompt), new) * n
        engine.submit(prompt, SamplingParams(max_tokens=new, temperature=0.0)).result()
        choices = engine.submit_choices(prompt, SamplingParams(max_tokens=new, temperature=0.0), n)
        first = [c.result() for c in choices][0]
        assert first.stats.cached_tokens == len(prompt) - 1  # taken before the kept caches made room
        assert engine.stats()["kv_cached_bytes"] > 0
    finally:
        engine.close()


def _cache(tokens, capacity=32):
    cache = KVCache.private(1, 1, 16, 1024, capacity, np.float16)
    cache.reserve(len(tokens))
    cache.write(0, np.full((1, len(tokens), 16), 1.0), np.arange(len(tokens) * 16, dtype=np.float32).reshape(1, -1, 16))
    cache.commit(len(tokens))
    return cache


def test_the_longest_shared_prefix_is_copied_but_never_the_last_prompt_token():
    kept = PrefixCache()
    kept.keep(np.arange(10), _cache(np.arange(10)))
    kept.keep(np.array([0, 1, 2, 7, 7]), _cache(np.arange(5)))
    cache, n = kept.take(np.arange(20), capacity=40)
    assert n == 10 and cache.length == 10 and cache.capacity >= 40
    assert np.array_equal(cache.v[0, 0, :10], np.arange(160, dtype=np.float16).reshape(10, 16))
    _, n = kept.take(np.arange(10), capacity=40)
    assert n == 9  # the prompt's last token is computed again: its logits give the first token
    assert kept.take(np.array([5, 6]), capacity=8) == (None, 0)


def test_a_later_turn_replaces_the_earlier_and_the_least_recently_used_go_first():
    kept = PrefixCache()
    kept.keep(np.arange(10), _cache(np.arange(10)))
    kept.keep(np.arange(15), _cache(np.arange(15)))  # the same chat, one turn on
    assert len(kept) == 1
    kept.keep(np.arange(5), _cache(np.arange(5)))  # held already by the longer one
    assert len(kept) == 1
    kept.keep(np.array([9, 9, 9]), _cache(np.arange(3)))
    kept.take(np.array([0, 1, 2, 3]), capacity=8)  # the first is used: the other is the oldest now
    kept.evict_to(kept.nbytes - 1)
    assert len(kept) == 1 and kept.take(np.array([9, 9, 9, 9]), capacity=8) == (None, 0)
    kept.evict_to(0)
    assert len(kept) == 0 and kept.nbytes == 0


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_flm_prefix_cache_turns_it_on_and_off(value, on):
    assert Settings(prefix_cache=value).prefix_cache_on() is on


def test_a_bad_flm_prefix_cache_is_refused():
    with pytest.raises(InvalidRequestError, match="FLM_PREFIX_CACHE"):
        Settings(prefix_cache="maybe").prefix_cache_on()
