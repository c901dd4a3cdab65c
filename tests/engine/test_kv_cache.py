"""The paged KV cache (``kv_cache.py``): blocks taken as a cache grows and given back when it rolls
back or ends, a private pool's growth, copies that share full blocks, the block pool's references,
digests and least-recently-used reuse, and the digests' chaining."""

import numpy as np
import pytest

from flm_runtime.kv_cache import KEY_TILE
from flm_runtime.kv_cache import BlockPool, BlockTable, KVCache, KVPool, KVPoolExhausted, block_digests


def test_growth_keeps_contents_and_trim_rolls_back_and_gives_blocks_back():
    cache = KVCache.private(n_layers=2, n_kv_heads=3, head_dim=4, max_length=1000, block_tokens=64)
    assert cache.capacity == 0 and cache.length == 0 and cache.pool.n_blocks == 1
    rng = np.random.default_rng(0)
    written = rng.standard_normal((2, 3, 600, 4)).astype(np.float32)
    for start in range(0, 600, 200):  # three appends of 200 positions: the private pool grows twice
        cache.reserve(200)
        for layer in range(2):
            part = written[layer, :, start : start + 200]
            cache.write(layer, part, -part)
        cache.commit(200)
    assert cache.length == 600 and cache.capacity == 640 and len(cache.blocks) == 10
    assert cache.pool.n_blocks >= 10 and cache.pool.used == 10
    np.testing.assert_array_equal(cache.keys(), written)
    np.testing.assert_array_equal(cache.values(), -written)
    # keys in tiles of 16 positions, transposed (the attention kernel's layout): position 3 * 16 + 5
    # of head 2, layer 1, is lane 5 of tile 3 of the first block
    np.testing.assert_array_equal(cache.pool.k[1, cache.blocks[0], 2, 3, :, 5], written[1, 2, 3 * KEY_TILE + 5])

    cache.trim(590)  # a rejected speculative block: the next write overwrites from 590
    assert len(cache.blocks) == 10
    cache.trim(500)  # past a block edge: the blocks after 512 go back
    assert len(cache.blocks) == 8 and cache.pool.used == 8
    cache.reserve(1)
    for layer in range(2):
        cache.write(layer, np.ones((3, 1, 4), np.float32), np.ones((3, 1, 4), np.float32))
    cache.commit(1)
    assert cache.length == 501
    np.testing.assert_array_equal(cache.keys()[:, :, 500], 1.0)
    np.testing.assert_array_equal(cache.keys()[:, :, :500], written[:, :, :500])
    cache.release()
    assert cache.length == 0 and cache.pool.used == 0


def test_reserving_past_the_context_length_is_a_bug():
    cache = KVCache.private(n_layers=1, n_kv_heads=1, head_dim=2, max_length=300, capacity=10_000)
    assert cache.pool.n_blocks == 5  # the hint is clamped to the context: 300 positions in blocks of 64
    cache.reserve(300)
    with pytest.raises(AssertionError, match="context length 300"):
        cache.reserve(301)


def test_a_fixed_pool_runs_out_and_takes_nothing():
    pool = KVPool(1, 1, 4, np.float16, n_blocks=3, block_tokens=16)
    a, b = KVCache(pool, 1000), KVCache(pool, 1000)
    a.reserve(40)  # 3 blocks
    with pytest.raises(KVPoolExhausted):
        b.reserve(1)
    assert b.blocks == [] and pool.used == 3
    a.trim(0)
    b.reserve(17)
    assert len(b.blocks) == 2 and pool.used == 2


def test_fits_tells_whether_reserve_finds_its_blocks():
    pool = BlockPool(3, 16)
    a, b = BlockTable(pool, 1000), BlockTable(pool, 1000)
    assert a.fits(48) and not a.fits(49)
    a.reserve(40)
    a.commit(40)
    assert a.fits(8) and not a.fits(9) and not b.fits(1)
    assert BlockTable(BlockPool(0, 16, growable=True), 1000).fits(500)


def test_a_copy_with_no_block_left_for_its_last_block_is_none():
    pool = KVPool(1, 1, 4, np.float32, n_blocks=2, block_tokens=16)
    cache = KVCache(pool, 1000)
    cache.reserve(20)
    cache.commit(20)
    assert cache.copy() is None and pool.used == 2
    cache.trim(16)  # full blocks only: shared, nothing to copy
    assert cache.copy().blocks == cache.blocks


def test_a_copy_shares_the_full_blocks_and_copies_the_last():
    pool = KVPool(2, 1, 4, np.float32, n_blocks=8, block_tokens=16)
    cache = KVCache(pool, 1000)
    written = np.arange(2 * 20 * 4, dtype=np.float32).reshape(2, 1, 20, 4)
    cache.reserve(20)
    for layer in range(2):
        cache.write(layer, written[layer], -written[layer])
    cache.commit(20)
    copy = cache.copy()
    assert copy.blocks[0] == cache.blocks[0] and copy.blocks[1] != cache.blocks[1]  # 16 shared, 4 copied
    assert pool.used == 3
    np.testing.assert_array_equal(copy.keys(), written)
    np.testing.assert_array_equal(copy.values(), -written)
    copy.trim(18)
    copy.reserve(1)
    copy.write(0, np.full((1, 1, 4), 9.0, np.float32), np.zeros((1, 1, 4), np.float32))
    copy.commit(1)
    np.testing.assert_array_equal(cache.keys(), written)  # the original is untouched
    cache.release()
    assert pool.used == 2  # the shared block is the copy's still
    copy.release()
    assert pool.used == 0 and pool.available == 8


def test_registered_blocks_outlive_their_sequence_and_go_least_recently_used_first():
    pool = BlockPool(4, 16)
    first, second = pool.allocate(2)
    pool.register(first, b"a")
    pool.register(second, b"b")
    pool.register(second, b"other")  # a block keeps its first digest
    pool.release([first, second])
    assert (pool.cached, pool.available, pool.used) == (2, 4, 0)
    assert pool.lookup(b"a") == first and pool.lookup(b"other") is None
    assert (pool.cached, pool.used) == (1, 1)
    pool.release([first])  # `first` is now the most recently used
    fresh = pool.allocate(2)  # the free ones first
    assert set(fresh).isdisjoint({first, second}) and pool.cached == 2
    [reused] = pool.allocate(1)  # then the least recently used cached block, forgotten
    assert reused == second and pool.lookup(b"b") is None and pool.lookup(b"a") == first
    with pytest.raises(KVPoolExhausted):
        pool.allocate(1)


def test_a_growable_pool_grows_and_a_dropped_cache_gives_its_blocks_back():
    pool = KVPool(1, 1, 4, np.float16, n_blocks=1, block_tokens=16, growable=True)
    cache = KVCache(pool, 1000)
    cache.reserve(100)
    assert pool.n_blocks >= 7 and pool.used == 7 and pool.k.shape[1] == pool.n_blocks
    del cache
    assert pool.used == 0


def test_block_digests_name_the_whole_prefix():
    tokens = np.arange(40)
    digests = block_digests(tokens, 16)
    assert len(digests) == 2  # the last 8 tokens are not a full block
    assert block_digests(tokens[:32], 16) == digests
    changed = tokens.copy()
    changed[3] = 99
    other = block_digests(changed, 16)
    assert other[0] != digests[0] and other[1] != digests[1]  # the second block's tokens are the same
