"""The compiled kernels a layer runs (``runtime/flm_runtime/kernels/elementwise.py``, ``attention.py``): the vectorizing exp, and the attention
kernel against numpy's ``cpu.attention`` over a ``KVCache`` and, with a sliding window and a scale
of its own, against a masked softmax, bit-identical whatever blocks hold the context."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from flm_runtime.kv_cache import KVCache, KVPool
from flm_runtime.kernels import attention, cpu, elementwise


@numba.njit
def _exp_all(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = elementwise.exp(x[i])
    return out


@numba.njit
def _glu_rows(gate_up, gelu):
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    for i in range(gate_up.shape[0]):
        elementwise.glu_row(gate_up, out, i, gelu)
    return out


@numba.njit
def _store_kv_rows(k, v, k_pool, v_pool, table, start):
    for t in range(k.shape[0]):
        attention.store_kv_row(k, v, k_pool, v_pool, table, start, t)


@numba.njit
def _qk_norm_rows(qkv, q_norm, k_norm, h, hkv, d, eps):
    out = qkv.copy()
    for i in range(out.shape[0]):
        elementwise.qk_norm_row(out, q_norm, k_norm, h, hkv, d, eps, i)
    return out


def test_exp_is_within_two_ulp_and_clamps_outside_float32_range():
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    got, want = _exp_all(x), np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2 * 2.0**-23
    edges = _exp_all(np.array([-1e30, -100, 100, 1e30], dtype=np.float32))
    assert np.array_equal(edges, _exp_all(np.array([-87, -87, 88, 88], dtype=np.float32)))
    assert np.all(np.isfinite(edges)) and edges[0] > 0


@pytest.mark.parametrize("gelu", [False, True])
def test_the_compiled_glu_matches_numpy(gelu):
    """SwiGLU and GeGLU (the compiled one as ``g * sigmoid(2y)``) against ``cpu.glu`` (GeGLU with
    ``tanh``, Hugging Face's ``gelu_pytorch_tanh``), over gates from -12 to 12."""
    rng = np.random.default_rng(4)
    gate_up = np.concatenate([np.linspace(-12, 12, 3 * 97, dtype=np.float32).reshape(3, 97),
                              rng.standard_normal((3, 97)).astype(np.float32)], axis=1)
    got, want = _glu_rows(gate_up, gelu), cpu.glu(gate_up.astype(np.float64), gelu)
    assert got.dtype == np.float32 and got.shape == (3, 97)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_compiled_qk_norm_matches_numpy():
    """RMSNorm of each of 3 query and 2 key heads of a fused QKV row, the values left as they are."""
    rng = np.random.default_rng(5)
    h, hkv, d = 3, 2, 16
    qkv = (3 * rng.standard_normal((4, (h + 2 * hkv) * d))).astype(np.float32)
    q_norm, k_norm = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    got = _qk_norm_rows(qkv, q_norm, k_norm, h, hkv, d, np.float32(1e-6))
    np.testing.assert_allclose(got, cpu.qk_norm(qkv, q_norm, k_norm, h, hkv, d, 1e-6), rtol=1e-6, atol=1e-6)
    assert np.array_equal(got[:, (h + hkv) * d:], qkv[:, (h + hkv) * d:])
    heads = got[:, :(h + hkv) * d].reshape(4, h + hkv, d) / np.concatenate([[q_norm] * h, [k_norm] * hkv])
    np.testing.assert_allclose(np.mean(heads.astype(np.float64) ** 2, axis=-1), 1, rtol=1e-4)


def _scale(head_dim: int) -> np.float32:
    """Llama's softmax scale, ``D ** -0.5`` (``cpu.attention``'s)."""
    return np.float32(head_dim**-0.5)


def _cache_of(k: np.ndarray, v: np.ndarray, dtype: type = np.float32, block_tokens: int = 64) -> KVCache:
    """A one-layer cache of ``dtype`` holding ``k``, ``v`` ``[Hkv, N, D]``."""
    cache = KVCache.private(1, k.shape[0], k.shape[2], max_length=4096, dtype=dtype, block_tokens=block_tokens)
    cache.reserve(k.shape[1])
    cache.write(0, k, v)
    cache.commit(k.shape[1])
    return cache


@pytest.mark.parametrize("head_dim", [8, 64, 80])  # 80: a last block of 16 columns; 8: part of one
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h, hkv", [(6, 2), (4, 1)])  # query heads a key-value head: 3 (one group), 4 (3 + 1)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_kernel_matches_numpy_and_is_row_invariant(head_dim, causal, h, hkv, dtype):
    rng = np.random.default_rng(head_dim)
    t = 8
    for n in (1, 15, 16, 17, 130, 301):  # partial and whole key tiles, odd and even positions
        k = rng.standard_normal((hkv, n, head_dim)).astype(np.float32)
        v = rng.standard_normal((hkv, n, head_dim)).astype(np.float32)
        q = rng.standard_normal((min(t, n), h, head_dim)).astype(np.float32)
        rows, start = q.shape[0], n - q.shape[0]
        cache = _cache_of(k, v, dtype)
        got = np.empty((rows, h * head_dim), np.float32)
        attention.attend(q, *attention.cache_arrays(cache, 0), start, causal, 0, _scale(head_dim), got)
        stored_k, stored_v = (a.astype(dtype).astype(np.float32) for a in (k, v))  # a float16 cache rounds them
        np.testing.assert_allclose(got, cpu.attention(q, stored_k, stored_v, start, causal=causal), rtol=0, atol=2e-6)
        if causal:  # a row alone (its own position, fewer rows beside it) gives the same bits
            for r in range(rows):
                alone = np.empty((1, h * head_dim), np.float32)
                attention.attend(q[r:r + 1], *attention.cache_arrays(cache, 0), start + r, True, 0, _scale(head_dim),
                                 alone)
                assert np.array_equal(alone[0], got[r]), (n, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_compiled_kv_store_writes_what_the_cache_writes(dtype):
    # store_kv_row (the compiled step's write) against KVCache.write (the reference), across a
    # tile edge and a block edge
    rng = np.random.default_rng(7)
    first, new = rng.standard_normal((2, 2, 13, 8)).astype(np.float32), rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    caches = [_cache_of(first[0], first[1], dtype, block_tokens=16) for _ in range(2)]
    for cache in caches:
        cache.reserve(9)
    caches[0].write(0, new[0].transpose(1, 0, 2), new[1].transpose(1, 0, 2))
    _store_kv_rows(new[0], new[1], *attention.cache_arrays(caches[1], 0), 13)
    for cache in caches:
        cache.commit(9)
    assert np.array_equal(caches[0].keys(), caches[1].keys()) and np.array_equal(caches[0].values(), caches[1].values())
    assert np.array_equal(caches[1].keys(0)[:, 13:], new[0].transpose(1, 0, 2).astype(dtype))
    assert np.array_equal(caches[1].values(0)[:, 13:], new[1].transpose(1, 0, 2).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_attention_is_bit_identical_whatever_blocks_hold_the_context(dtype, head_dim):
    """The same keys and values in blocks of 64 (consecutive), of 16 scattered through a shared
    pool (another cache's blocks between them) and of 128: the same output bits, causal rows and
    not, with sliding windows that skip blocks and start inside tiles, at lengths that end inside
    a tile, on a tile edge and on a block edge."""
    rng = np.random.default_rng(3)
    hkv, h = 2, 6
    for n in (5, 64, 200, 257):
        k, v = (rng.standard_normal((hkv, n, head_dim)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((4, h, head_dim)).astype(np.float32)
        shared = KVPool(1, hkv, head_dim, dtype, n_blocks=64, block_tokens=16)
        scattered, other = KVCache(shared, 4096), KVCache(shared, 4096)
        for at in range(0, n, 16):  # the two caches take blocks by turns: not one of ours is next to another
            other.reserve(16)
            other.commit(16)
            scattered.reserve(min(16, n - at))
            scattered.write(0, k[:, at:at + 16], v[:, at:at + 16])
            scattered.commit(min(16, n - at))
        assert all(b - a > 1 for a, b in zip(scattered.blocks, scattered.blocks[1:]))
        caches = [_cache_of(k, v, dtype, 64), scattered, _cache_of(k, v, dtype, 128)]
        # windows that start inside a tile, skip tiles, skip blocks
        for causal, window in ((True, 0), (False, 0), (True, 3), (True, 40), (True, 150)):
            outs = []
            for cache in caches:
                out = np.empty((4, h * head_dim), np.float32)
                attention.attend(q, *attention.cache_arrays(cache, 0), n - 4, causal, window, _scale(head_dim), out)
                outs.append(out)
            assert all(np.array_equal(outs[0], o) for o in outs[1:]), (n, causal, window)


def _masked_softmax_attention(q, k, v, start, window, scale):
    """Attention in float64 as its definition: query row ``t`` (position ``p = start + t``) over
    keys ``j`` with ``j <= p`` and ``p - j < window`` (transformers' sliding window), softmax of
    ``scale * q . k`` over them, weighted values. ``q`` ``[T, H, D]``, ``k``, ``v`` ``[Hkv, N, D]``."""
    t, h, d = q.shape
    hkv, n, _ = k.shape
    p, j = start + np.arange(t)[:, None], np.arange(n)[None, :]
    allowed = (j <= p) & (p - j < window)
    out = np.empty((t, h, d))
    for head in range(h):
        kv = head // (h // hkv)
        scores = np.where(allowed, q[:, head].astype(np.float64) @ k[kv].T.astype(np.float64) * scale, -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = weights / weights.sum(axis=1, keepdims=True) @ v[kv]
    return out.reshape(t, h * d)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 64, 100])
def test_sliding_window_attention_is_a_masked_softmax(window, dtype):
    """Windows of one position, inside a tile, a tile, past a tile edge, a block, and more than
    the context; a scale of its own (Gemma 3's): against the masked softmax, within float32
    rounding."""
    rng = np.random.default_rng(window)
    h, hkv, d, t, scale = 6, 2, 80, 8, 0.1
    for n in (8, 40, 130):
        k, v = (rng.standard_normal((hkv, n, d)).astype(dtype).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((t, h, d)).astype(np.float32)
        got = np.empty((t, h * d), np.float32)
        attention.attend(q, *attention.cache_arrays(_cache_of(k, v, dtype), 0), n - t, True, window,
                         np.float32(scale), got)
        np.testing.assert_allclose(got, _masked_softmax_attention(q, k, v, n - t, window, np.float32(scale)), rtol=0,
                                   atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sliding_window_reads_nothing_below_the_window(dtype):
    """The positions below the window of the first query row hold NaN: whole blocks and tiles
    below it are not read, and the ones that share its edge tile are masked, so the output is
    the bits of a cache holding real numbers there."""
    rng = np.random.default_rng(11)
    hkv, h, d, n, window, rows = 2, 4, 64, 200, 70, 4
    k, v = (rng.standard_normal((hkv, n, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((rows, h, d)).astype(np.float32)
    below = n - rows - window + 1  # the first row's window starts here: inside a tile of block 1 of 16 positions
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, :below], poisoned_v[:, :below] = np.nan, np.nan
    outs = []
    for keys, values in ((k, v), (poisoned_k, poisoned_v)):
        for block_tokens in (16, 64):
            out = np.empty((rows, h * d), np.float32)
            cache = _cache_of(keys, values, dtype, block_tokens)
            attention.attend(q, *attention.cache_arrays(cache, 0), n - rows, True, window, _scale(d), out)
            outs.append(out)
    assert below % 16 and np.all(np.isfinite(outs[0]))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_a_window_wider_than_the_context_is_no_window():
    rng = np.random.default_rng(12)
    k, v = (rng.standard_normal((2, 50, 64)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    cache = _cache_of(k, v)
    outs = []
    for window in (0, 50, 4096):
        out = np.empty((3, 4 * 64), np.float32)
        attention.attend(q, *attention.cache_arrays(cache, 0), 47, True, window, _scale(64), out)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
