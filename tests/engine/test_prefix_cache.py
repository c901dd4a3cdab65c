"""Prefix caching (``scheduling/prefix_cache.py``): a request whose prompt starts with tokens an
earlier sequence computed takes their full blocks from the pool and gets the tokens and logprobs it
gets cold, bit for bit (quantized weights), alone or beside a request that shares half its prefix;
the digests chain, the prompt's last token is always computed, and ``FLM_PREFIX_CACHE`` turns it
off."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.kv_cache import KVCache, KVPool
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling import prefix_cache
from flm_runtime.scheduling.engine import Engine
from flm_runtime.settings import Settings

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
STORY = (Path(__file__).parents[1] / "data" / "wizard_of_oz_ch1.txt").read_text()


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
    with engine.held():  # side by side, in the same steps
        handles = [engine.submit(p, GREEDY) for p in prompts]
    return [h.result() for h in handles]


def _whole_blocks(n: int, engine) -> int:
    return n // engine.pool.block_tokens * engine.pool.block_tokens


def test_a_second_turn_takes_the_first_from_the_cache_and_gets_the_cold_bits(engines, smollm2_tokenizer):
    cached, cold = engines
    first = _chat(smollm2_tokenizer, "Summarize this in one sentence:\n" + STORY[:700])
    [turn1] = _run(cached, [first])
    assert turn1.stats.cached_tokens == 0
    # The next turn: the whole history resent, as LiteLLM clients do, then a new question.
    second = np.concatenate([first, turn1.token_ids, smollm2_tokenizer.encode("\nAnd who is Toto?")])
    other = np.concatenate([second[:len(second) // 2], smollm2_tokenizer.encode(" Something else entirely.")])
    got = _run(cached, [second, other])  # side by side: one shares half of the other's prefix
    want = _run(cold, [second, other])
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
    # The first turn left the full blocks of its prompt and of every generated token but the last
    # (never fed); `other` shares them up to its half.
    assert got[0].stats.cached_tokens == _whole_blocks(len(first) + len(turn1.token_ids) - 1, cached) > 0
    assert got[1].stats.cached_tokens == _whole_blocks(len(second) // 2, cached) > 0
    assert all(w.stats.cached_tokens == 0 for w in want)
    assert cached.stats()["kv_cached_bytes"] > 0 and cold.stats()["kv_cached_bytes"] == 0
    assert cached.stats()["kv_blocks_used"] == cold.stats()["kv_blocks_used"] == 0


def test_n_choices_and_a_cancelled_request_leave_their_prefix(engines, smollm2_tokenizer):
    cached, cold = engines
    prompt = _chat(smollm2_tokenizer, "Write a very long poem about this:\n" + STORY[700:1400])
    stream = cached.submit(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for i, _event in enumerate(stream):
        if i == 3:
            stream.cancel()
            break
    deadline = time.monotonic() + 60
    while not stream.done and time.monotonic() < deadline:  # the engine drops it at its next step
        time.sleep(0.01)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=5, logprobs=True)
    got = [h.result() for h in cached.submit_choices(prompt, sampled, 3)]
    want = [h.result() for h in cold.submit_choices(prompt, sampled, 3)]
    assert [(g.token_ids, g.logprobs) for g in got] == [(w.token_ids, w.logprobs) for w in want]
    assert got[0].stats.cached_tokens == _whole_blocks(len(prompt) - 1, cached) > 0


def _pool_cache(pool, tokens):
    """A cache in ``pool`` holding ``tokens``, each position's values the token id."""
    cache = KVCache(pool, 1024)
    cache.reserve(len(tokens))
    values = np.repeat(np.asarray(tokens, dtype=np.float32)[None, :, None], 16, axis=2)  # [1, T, 16]
    cache.write(0, values, values)
    cache.commit(len(tokens))
    return cache


def test_take_finds_whole_blocks_up_to_the_first_miss_never_the_last_prompt_token():
    pool = KVPool(1, 1, 16, np.float16, n_blocks=8, block_tokens=16)
    tokens = np.arange(40)
    cache = _pool_cache(pool, tokens)
    prefix_cache.keep(cache, tokens)  # 2 full blocks registered (positions 0..31); the third is in part
    cache.release()
    assert pool.cached == 2 and pool.used == 0
    blocks, n = prefix_cache.take(pool, np.arange(100))
    assert n == 32 and len(blocks) == 2 and pool.used == 2
    taken = KVCache(pool, 1024)
    taken.adopt(blocks, n)
    assert np.array_equal(taken.values(0)[0, :, 0], np.arange(32, dtype=np.float16))
    taken.release()
    blocks, n = prefix_cache.take(pool, np.arange(32))  # the last token is never taken: one block
    assert n == 16
    pool.release(blocks)
    assert prefix_cache.take(pool, np.concatenate([[99], np.arange(1, 40)])) == ([], 0)  # block 0 differs
    changed = np.arange(40)
    changed[20] = 7  # the second block differs: only the first is taken
    blocks, n = prefix_cache.take(pool, changed)
    assert n == 16
    pool.release(blocks)
    assert pool.used == 0 and pool.cached == 2


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_flm_prefix_cache_turns_it_on_and_off(value, on):
    assert Settings(prefix_cache=value).prefix_cache_on() is on


def test_a_bad_flm_prefix_cache_is_refused():
    with pytest.raises(InvalidRequestError, match="FLM_PREFIX_CACHE"):
        Settings(prefix_cache="maybe").prefix_cache_on()
