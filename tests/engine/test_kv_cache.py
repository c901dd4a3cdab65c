"""KV cache growth and rollback."""

import numpy as np

from flm_runtime.core import KEY_TILE
from flm_runtime.kv_cache import KVCache


def test_growth_keeps_contents_and_trim_rolls_back():
    cache = KVCache.private(n_layers=2, n_kv_heads=3, head_dim=4, max_length=1000)
    assert cache.capacity == GROWTH_QUANTUM and cache.length == 0
    rng = np.random.default_rng(0)
    written = rng.standard_normal((2, 3, 600, 4)).astype(np.float32)
    for start in range(0, 600, 200):  # three appends of 200 positions force two reallocations
        cache.reserve(200)
        for layer in range(2):
            block = written[layer, :, start : start + 200]
            cache.write(layer, block, -block)
        cache.commit(200)
    assert cache.length == 600 and cache.capacity == 1000  # 256 -> 512 -> min(1024, context 1000)
    np.testing.assert_array_equal(cache.keys(), written)
    np.testing.assert_array_equal(cache.v[:, :, :600], -written)
    # keys in tiles of 16 positions, transposed (the attention kernel's layout)
    np.testing.assert_array_equal(cache.k[1, 2, 3, :, 5], written[1, 2, 3 * KEY_TILE + 5])

    cache.trim(590)  # a rejected speculative block: the next write overwrites from 590
    cache.reserve(1)
    for layer in range(2):
        cache.write(layer, np.ones((3, 1, 4), np.float32), np.ones((3, 1, 4), np.float32))
    cache.commit(1)
    assert cache.length == 591
    np.testing.assert_array_equal(cache.keys()[:, :, 590], 1.0)
    np.testing.assert_array_equal(cache.keys()[:, :, :590], written[:, :, :590])


def test_capacity_never_exceeds_context_length():
    cache = KVCache.private(n_layers=1, n_kv_heads=1, head_dim=2, max_length=300, capacity=10_000)
    assert cache.capacity == 300
    cache.reserve(300)
    try:
        cache.reserve(301)
    except AssertionError as e:
        assert "context length 300" in str(e)
    else:
        raise AssertionError("reserving past the context length must fail")


def test_a_copy_holds_the_same_positions_and_is_independent():
    cache = KVCache.private(n_layers=2, n_kv_heads=1, head_dim=4, max_length=1000)
    block = np.arange(2 * 1 * 5 * 4, dtype=np.float32).reshape(2, 1, 5, 4)
    cache.reserve(5)
    for layer in range(2):
        cache.write(layer, block[layer], -block[layer])
    cache.commit(5)
    copy = cache.copy()
    assert (copy.length, copy.capacity, copy.max_length) == (5, cache.capacity, 1000)
    np.testing.assert_array_equal(copy.keys(), block)
    np.testing.assert_array_equal(copy.v[:, :, :5], -block)
    copy.trim(2)
    copy.reserve(1)
    copy.write(0, np.full((1, 1, 4), 9.0, np.float32), np.zeros((1, 1, 4), np.float32))
    copy.commit(1)
    assert cache.length == 5
    np.testing.assert_array_equal(cache.keys(), block)  # the original is untouched
