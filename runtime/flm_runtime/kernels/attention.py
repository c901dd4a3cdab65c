"""The attention kernel every decoder layer runs, over a ``KVCache``'s blocks (``kv_cache``:
keys in tiles of 16 positions, a sequence's blocks named by its block table), and the K/V write
of the compiled layers.

``attend_item`` serves every layer of every model, float32 or quantized, target or draft
(docs/design.md, "Quantized weights": attention over key tiles): one item per query row and
key-value head, each query's scores and sums in a fixed order that depends on its position
alone, so a row's output is bit-identical whatever rows run beside it (docs/design.md, "Batch
invariance"). The compiled step (``layers.stack``) splits the items over the kernel team; the
numpy reference layer calls ``attend``, which runs them on numba's threads.

Axis legend: T query rows of one sequence, N positions attended, H / Hkv query / key-value heads,
D head dim, NB blocks of the pool, B positions per block.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from flm_runtime.kernels import cpu_features
from flm_runtime.kernels.elementwise import ELEMENTWISE, exp
from flm_runtime.kernels.irgen import (F16, F32, I1, I32, I64, as_i64, broadcast, counted_loop, data_ptr, declare,
                                       literal, load, prefetch, store, vec)
from flm_runtime.kv_cache import KEY_TILE


def _contiguous(*array_types, cache=None):
    """Typing check of the attention intrinsics, which address their arrays' rows directly: C-
    contiguous float32 arrays, and ``cache`` (keys or values) float32 or float16 bits (uint16:
    numba has no float16 arrays). Returns the cache's element type in IR (F32 or F16)."""
    for t in (*array_types, cache) if cache is not None else array_types:
        dtypes = (types.float32, types.uint16) if t is cache else (types.float32,)
        if not (isinstance(t, types.Array) and t.layout == "C" and t.dtype in dtypes):
            raise numba.core.errors.TypingError(f"attention takes C-contiguous float32 arrays (a KV cache: "
                                                f"float16 bits too), got {t}")
    return F16 if cache is not None and cache.dtype == types.uint16 else F32


def _widen(builder, value):
    """A vector of cache elements as float32 (float16 ones converted exactly)."""
    return builder.fpext(value, vec(F32, value.type.count)) if value.type.element == F16 else value


@intrinsic
def _score_tiles(typingctx, queries, n_queries, tiles, first, count, scale, scores, at):  # pragma: no cover
    """``_score_tiles(queries, n_queries, tiles, first, count, scale, scores, at)``: for each of
    the first ``n_queries`` (a constant) rows ``j`` of ``queries`` ``[G, D]`` and each of the
    ``count`` (a constant) key tiles ``i = first + c`` of ``tiles`` ``[n_tiles, D, 16]`` (one
    block's), ``scores[j, 16 (at + c) + l] = scale * sum_e queries[j, e] * tiles[i, e, l]``
    (``at``: the tile's place in the sequence), each lane a chain of fused multiply-adds over
    ``e`` in order. A tile's row is loaded once for all the queries,
    and the chains run side by side so that their latencies overlap; each chain's arithmetic is
    the same whatever runs beside it."""
    elem = _contiguous(queries, scores, cache=tiles)
    g, n = literal(n_queries, "n_queries"), literal(count, "count")
    sig = types.void(queries, n_queries, tiles, first, count, scale, scores, at)

    def codegen(context, builder, signature, args):
        q_t, _, k_t, _, _, _, s_t, _ = signature.args
        queries_v, _, tiles_v, first_v, _, scale_v, scores_v, at_v = args
        first_v, at_v = as_i64(builder, first_v), as_i64(builder, at_v)
        d = builder.extract_value(context.make_array(q_t)(context, builder, queries_v).shape, 1)
        score_width = builder.extract_value(context.make_array(s_t)(context, builder, scores_v).shape, 1)
        qp, sp = (data_ptr(context, builder, t, v, F32) for t, v in ((q_t, queries_v), (s_t, scores_v)))
        kp = data_ptr(context, builder, k_t, tiles_v, elem)
        vf = vec(F32, KEY_TILE)
        fma = declare(builder, f"llvm.fma.v{KEY_TILE}f32", vf, [vf] * 3)
        i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
        tiles_at = [builder.add(first_v, i64(t)) for t in range(n)]
        bases = [builder.mul(i, builder.mul(d, i64(KEY_TILE))) for i in tiles_at]
        e, accs, close = counted_loop(builder, d, [ir.Constant(vf, None)] * (g * n))
        row = builder.mul(e, i64(KEY_TILE))
        for base in bases:  # the same row of the tiles the next call scores: one stream per tile
            prefetch(builder, kp, builder.add(builder.add(base, builder.mul(d, i64(KEY_TILE * n))), row))
        keys = [_widen(builder, load(builder, kp, builder.add(base, row), vec(elem, KEY_TILE))) for base in bases]
        sums = []
        for j in range(g):
            qe = broadcast(builder, load(builder, qp, builder.add(builder.mul(i64(j), d), e), F32), KEY_TILE)
            sums += [builder.call(fma, [qe, key, acc]) for key, acc in zip(keys, accs[j * n:(j + 1) * n])]
        close(sums)
        scale_v = broadcast(builder, scale_v, KEY_TILE)
        for j in range(g):
            for c, acc in enumerate(sums[j * n:(j + 1) * n]):
                place = builder.mul(builder.add(at_v, i64(c)), i64(KEY_TILE))
                store(builder, builder.fmul(acc, scale_v), sp, builder.add(builder.mul(i64(j), score_width), place))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _max_of_tiles(typingctx, scores, n_tiles):  # pragma: no cover - compiled
    """``_max_of_tiles(scores, n_tiles)``: the largest of ``scores[0 .. 16 n_tiles - 1]``
    (``n_tiles >= 1``), a lane-wise maximum then one reduction (exact in any order)."""
    _contiguous(scores)
    sig = types.float32(scores, n_tiles)

    def codegen(context, builder, signature, args):
        sp = data_ptr(context, builder, signature.args[0], args[0], F32)
        vf = vec(F32, KEY_TILE)
        top = declare(builder, f"llvm.maxnum.v{KEY_TILE}f32", vf, [vf, vf])
        first = load(builder, sp, ir.Constant(I64, 0), vf)
        i, acc, close = counted_loop(builder, as_i64(builder, args[1]), [first])
        acc = builder.call(top, [acc[0], load(builder, sp, builder.mul(i, ir.Constant(I64, KEY_TILE)), vf)])
        close([acc])
        return builder.call(declare(builder, f"llvm.vector.reduce.fmax.v{KEY_TILE}f32", F32, [vf]), [acc])

    return sig, codegen


@intrinsic
def _weighted_values(typingctx, weights, n_queries, values, n, column, width, masked, scales, out, at, first,
                     last):  # pragma: no cover - compiled
    """``_weighted_values(weights, n_queries, values, n, column, width, masked, scales, out, at,
    first, last)``: one block's share of ``out[j * D + column + c] = scales[j] * sum_i
    weights[j, i] * values[i, column + c]``, for each of the first ``n_queries`` (a constant)
    rows ``j`` of ``weights`` ``[G, N']`` and ``c < width`` (a constant multiple of 16), ``D``
    the row width of ``values``: the positions ``at .. at + n - 1`` of the sum, whose values are
    the rows ``0 .. n - 1`` of ``values`` ``[B, D]`` (one block's). The sums start at 0 in the
    ``first`` block and from what ``out`` holds in the others, and are scaled by ``scales`` in
    the ``last`` (``first``, ``last``: booleans), so that each lane is one chain over the
    positions in order, whatever the blocks: the same whatever runs beside it. ``masked`` (a
    constant): lanes with ``column + c >= D`` are neither read nor written; without it the
    caller ensures ``column + width <= D``. Within a block the sums stay in registers; a value
    row is loaded once for all the queries."""
    elem = _contiguous(weights, scales, out, cache=values)
    g, w, is_masked = literal(n_queries, "n_queries"), literal(width, "width"), bool(literal(masked, "masked"))
    assert w % KEY_TILE == 0
    sig = types.void(weights, n_queries, values, n, column, width, masked, scales, out, at, first, last)

    def codegen(context, builder, signature, args):
        p_t, _, v_t, _, _, _, _, c_t, o_t, _, _, _ = signature.args
        weights_v, _, values_v, n_v, column_v, _, _, scales_v, out_v, at_v, first_v, last_v = args
        n_v, column_v, at_v = as_i64(builder, n_v), as_i64(builder, column_v), as_i64(builder, at_v)
        first_v, last_v = (builder.trunc(v, I1) if v.type != I1 else v for v in (first_v, last_v))
        weights_width = builder.extract_value(context.make_array(p_t)(context, builder, weights_v).shape, 1)
        pp, cp, op = (data_ptr(context, builder, t, v, F32) for t, v in ((p_t, weights_v), (c_t, scales_v),
                                                                          (o_t, out_v)))
        vp = data_ptr(context, builder, v_t, values_v, elem)
        row_width = builder.extract_value(context.make_array(v_t)(context, builder, values_v).shape, 1)
        vf, ve, mask_t = vec(F32, KEY_TILE), vec(elem, KEY_TILE), vec(I1, KEY_TILE)
        i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
        fma = declare(builder, f"llvm.fma.v{KEY_TILE}f32", vf, [vf] * 3)
        chunks = w // KEY_TILE
        if is_masked:
            suffix = f"v{KEY_TILE}{'f16' if elem == F16 else 'f32'}"
            masked_load = declare(builder, f"llvm.masked.load.{suffix}.p0", ve, [ve.as_pointer(), I32, mask_t, ve])
            masked_store = declare(builder, f"llvm.masked.store.v{KEY_TILE}f32.p0", ir.VoidType(),
                                   [vf, vf.as_pointer(), I32, mask_t])
            masked_load_out = declare(builder, f"llvm.masked.load.v{KEY_TILE}f32.p0", vf,
                                      [vf.as_pointer(), I32, mask_t, vf])
            lane = ir.Constant(vec(I64, KEY_TILE), list(range(KEY_TILE)))
            width_v = broadcast(builder, row_width, KEY_TILE)
            masks = [builder.icmp_signed("<", builder.add(broadcast(builder, builder.add(column_v, i64(KEY_TILE * c)),
                                                                    KEY_TILE), lane), width_v) for c in range(chunks)]

        def at(ptr, index, t):
            return builder.bitcast(builder.gep(ptr, [index]), t.as_pointer())

        def read(c, index):
            if is_masked:
                return builder.call(masked_load, [at(vp, index, ve), ir.Constant(I32, 2), masks[c], ir.Constant(ve, None)])
            return load(builder, vp, index, ve)

        def out_at(j, c):
            return builder.add(builder.mul(i64(j), row_width), builder.add(column_v, i64(KEY_TILE * c)))

        starts = []  # 0 in the first block, else the sums so far from out
        for j in range(g):
            for c in range(chunks):
                if is_masked:
                    held = builder.call(masked_load_out, [at(op, out_at(j, c), vf), ir.Constant(I32, 4), masks[c],
                                                          ir.Constant(vf, None)])
                else:
                    held = load(builder, op, out_at(j, c), vf)
                starts.append(builder.select(first_v, ir.Constant(vf, None), held))
        i, accs, close = counted_loop(builder, n_v, starts)
        row = builder.add(builder.mul(i, row_width), column_v)
        for c in range(chunks):  # the value row _VALUE_AHEAD positions on
            prefetch(builder, vp, builder.add(row, builder.add(builder.mul(row_width, i64(_VALUE_AHEAD)),
                                                               i64(KEY_TILE * c))))
        rows = [_widen(builder, read(c, builder.add(row, i64(KEY_TILE * c)))) for c in range(chunks)]
        sums = []
        position = builder.add(at_v, i)
        for j in range(g):
            p = broadcast(builder, load(builder, pp, builder.add(builder.mul(i64(j), weights_width), position), F32),
                          KEY_TILE)
            sums += [builder.call(fma, [p, value, acc]) for value, acc in zip(rows, accs[j * chunks:(j + 1) * chunks])]
        close(sums)
        for j in range(g):
            scale = broadcast(builder, load(builder, cp, i64(j), F32), KEY_TILE)
            for c in range(chunks):
                total = sums[j * chunks + c]
                result = builder.select(last_v, builder.fmul(total, scale), total)
                if is_masked:
                    builder.call(masked_store, [result, at(op, out_at(j, c), vf), ir.Constant(I32, 4), masks[c]])
                else:
                    store(builder, result, op, out_at(j, c))
        return context.get_dummy_value()

    return sig, codegen


_QUERY_GROUP = 3  # query heads of one key-value head taken together
_VALUE_AHEAD = 8  # value rows ahead of the one being summed whose lines are prefetched
# Key tiles scored side by side and head-dimension columns summed at a time, sized so that the
# accumulators stay in registers: 3 x 8 score chains and 3 x 4 value sums of 16 lanes fill
# AVX-512's 32 registers; AVX2's 16 registers of 8 lanes hold 3 x 2 chains and 3 x 2 sums.
_SCORE_TILES, _VALUE_COLUMNS = (8, 64) if cpu_features.vector_registers() == 32 else (2, 32)


@numba.njit(inline="always", **ELEMENTWISE)
def _attend_heads(queries, g, keys, values, table, kv, lo, n, scale, scores, out):  # pragma: no cover - compiled
    """``g`` (a constant) query heads ``queries`` ``[g, D]`` of one row over the positions ``lo
    .. n - 1`` of key-value head ``kv`` of one layer (``keys`` ``[NB, Hkv, B/16, D, 16]``,
    ``values`` ``[NB, Hkv, B, D]``, the sequence's blocks ``table``): softmax of the scaled
    scores, then the weighted values into ``out`` ``[g * D]``; ``scores`` ``[>= g, >= 16
    (ceil(n / 16) - lo // 16)]`` is scratch, position ``i``'s score at ``i - 16 (lo // 16)``.
    Blocks and tiles wholly below ``lo`` are not read; in the tile holding ``lo`` the positions
    before it are masked. Block by block, each score and each sum in the order of the positions
    from ``lo``, so the result depends on the positions alone, not on the blocks."""
    d = queries.shape[1]
    block_tiles = keys.shape[2]
    block = block_tiles * KEY_TILE
    first_tile = lo // KEY_TILE
    base = first_tile * KEY_TILE  # the position of scores[:, 0]
    n_tiles = (n + KEY_TILE - 1) // KEY_TILE
    first_block, n_blocks = lo // block, (n + block - 1) // block
    for j in range(first_block, n_blocks):
        tiles = keys[table[j], kv]  # [B/16, D, 16]
        count = min(block_tiles, n_tiles - j * block_tiles)
        tile = max(first_tile - j * block_tiles, 0)
        while tile + _SCORE_TILES <= count:
            _score_tiles(queries, g, tiles, tile, _SCORE_TILES, scale, scores, j * block_tiles + tile - first_tile)
            tile += _SCORE_TILES
        while tile < count:
            _score_tiles(queries, g, tiles, tile, 1, scale, scores, j * block_tiles + tile - first_tile)
            tile += 1
    inverse = np.empty(g, dtype=np.float32)
    for j in range(g):
        row = scores[j]
        for i in range(lo - base):  # the first tile's positions before the window
            row[i] = -np.inf
        for i in range(n - base, (n_tiles - first_tile) * KEY_TILE):  # the last tile's positions past n
            row[i] = -np.inf
        top = _max_of_tiles(row, n_tiles - first_tile)
        total = np.float32(0.0)
        for i in range(lo - base, n - base):
            p = exp(row[i] - top)
            row[i] = p
            total += p
        inverse[j] = np.float32(1.0) / total
    column = 0
    while column < d:
        for j in range(first_block, n_blocks):
            skip = max(lo - j * block, 0)  # the block's positions before the window
            rows = values[table[j], kv][skip:]  # [B - skip, D]
            count, first, last = min(block, n - j * block) - skip, j == first_block, j == n_blocks - 1
            at = j * block + skip - base
            if column + _VALUE_COLUMNS <= d:
                _weighted_values(scores, g, rows, count, column, _VALUE_COLUMNS, False, inverse, out, at, first, last)
            elif column + KEY_TILE <= d:
                _weighted_values(scores, g, rows, count, column, KEY_TILE, False, inverse, out, at, first, last)
            else:  # a head dim that is not whole vectors
                _weighted_values(scores, g, rows, count, column, KEY_TILE, True, inverse, out, at, first, last)
        column += _VALUE_COLUMNS if column + _VALUE_COLUMNS <= d else KEY_TILE


@numba.njit(parallel=True, cache=True, nogil=True, **ELEMENTWISE)
def attend(q, k, v, table, start, causal, window, scale, out):  # pragma: no cover - compiled
    """Grouped-query attention of ``T`` query rows over one layer of a sequence's KV cache (as
    ``cpu.attention``): query row ``t`` sits at position ``p = start + t`` and attends positions
    ``0 .. p`` (``causal``) or all ``start + T``; with a sliding ``window`` ``W > 0`` (causal
    only), positions ``max(0, p - W + 1) .. p`` (transformers' convention: key ``k`` is masked
    when ``p - k >= W``). Query head ``h`` reads key/value head ``h // (H / Hkv)``.

    One parallel item per query row and key-value head, its query heads taken up to
    ``_QUERY_GROUP`` at a time over keys and values loaded once for them. Each query's scores and
    sums run in a fixed order that depends on its position alone (``_score_tiles``,
    ``_weighted_values``), whatever the blocks hold its context: a row's output is bit-identical
    whatever rows run beside it and whatever its block table (docs/design.md, "Batch
    invariance"). Blocks and key tiles wholly outside a row's window are not read.

    Args:
        q: ``[T, H, D]`` float32 C-contiguous (RoPE applied).
        k: ``[NB, Hkv, B/16, D, 16]``, v: ``[NB, Hkv, B, D]``: one layer of a ``KVPool`` (keys in
            tiles), holding the step's keys and values already; float32, or float16 as its uint16
            bits (``cache_arrays``).
        table: int64 ``[>= ceil((start + T) / B)]``, the sequence's blocks in order.
        start: the position of row 0.
        causal: bool; window: int, 0 for none.
        scale: float32, the scores' scale before the softmax (``D ** -0.5`` for most models).
        out: ``[T, H * D]`` float32 C-contiguous, written.
    """
    for item in numba.prange(q.shape[0] * k.shape[1]):
        attend_item(q, k, v, table, start, causal, window, scale, out, item)


@numba.njit(nogil=True, **ELEMENTWISE)
def attend_item(q, k, v, table, start, causal, window, scale, out, item):  # pragma: no cover - compiled
    """``attend``'s item ``item``: query row ``item // Hkv`` over key-value head ``item % Hkv``
    (its query heads), alone: one thread's share of attention split over a ``kernels.team``."""
    t_rows, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    t, kv = item // hkv, item % hkv
    n = start + t + 1 if causal else start + t_rows
    lo = max(n - window, 0) if window > 0 else 0
    width = ((n + KEY_TILE - 1) // KEY_TILE - lo // KEY_TILE) * KEY_TILE
    scores = np.empty((min(group, _QUERY_GROUP), width), dtype=np.float32)
    head = kv * group
    while head + _QUERY_GROUP <= (kv + 1) * group:
        _attend_heads(q[t, head:head + _QUERY_GROUP], _QUERY_GROUP, k, v, table, kv, lo, n, scale, scores,
                      out[t, head * d:(head + _QUERY_GROUP) * d])
        head += _QUERY_GROUP
    while head < (kv + 1) * group:
        _attend_heads(q[t, head:head + 1], 1, k, v, table, kv, lo, n, scale, scores, out[t, head * d:(head + 1) * d])
        head += 1


@intrinsic
def _half_bits(typingctx, x):  # pragma: no cover - compiled
    """The bits (uint16) of float32 ``x`` rounded to float16, to nearest even, as numpy's
    ``astype(np.float16)`` rounds."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], F16), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _cache_element(cache, x):
    """``x`` (float32) as an element of ``cache`` (compiled: ``_cache_element_impl``)."""


@overload(_cache_element, inline="always")
def _cache_element_impl(cache, x):
    if cache.dtype == types.uint16:  # float16 bits
        return lambda cache, x: _half_bits(x)  # pragma: no cover - compiled
    return lambda cache, x: x  # pragma: no cover - compiled


@numba.njit(nogil=True)
def store_kv_row(k, v, k_pool, v_pool, table, start, t):  # pragma: no cover - compiled
    """Write row ``t`` of a step's keys and values ``k``, ``v`` ``[T, Hkv, D]`` float32 at position
    ``start + t`` of one layer of a sequence's cache (``cache_arrays``: the pool's layer, keys in
    tiles, float32 or float16 bits rounded as numpy rounds; the sequence's blocks ``table``), as
    ``KVCache.write`` does: the compiled step's write (the reference writes through
    ``KVCache.write``)."""
    block = v_pool.shape[2]
    position = start + t
    at, slot = table[position // block], position % block
    tile, lane = divmod(slot, KEY_TILE)
    for h in range(k.shape[1]):
        for e in range(k.shape[2]):
            k_pool[at, h, tile, e, lane] = _cache_element(k_pool, k[t, h, e])
            v_pool[at, h, slot, e] = _cache_element(v_pool, v[t, h, e])


def attend_spans(index: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, spans, causal: bool, window: int,
                 scale: np.float32) -> np.ndarray:
    """A layer's attention over a step's rows, sequence by sequence: each span's new keys and
    values ``k``, ``v`` ``[R, Hkv, D]`` go into layer ``index`` of its cache, then its queries
    ``q`` ``[R, H, D]`` attend it (``attend``, with ``causal``, ``window``, ``scale``).
    ``spans``: per sequence, an object with ``cache``, ``start`` (the cache length before the
    step) and ``rows`` (its slice of the rows), as
    ``flm_runtime.layers.decoder.RowSpan``. The caller holds ``lock.KERNEL_LOCK``.

    Returns:
        ``[R, H * D]`` float32.
    """
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    for s in spans:
        s.cache.write(index, k[s.rows].transpose(1, 0, 2), v[s.rows].transpose(1, 0, 2))
        attend(q[s.rows], *cache_arrays(s.cache, index), s.start, causal, window, scale, out[s.rows])
    return out


def cache_arrays(cache, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer ``index`` of a ``KVCache`` as ``attend`` takes it: ``(k, v, table)``, its pool's
    keys and values (float16 ones as their uint16 bits: numba has no float16 arrays; the kernel
    converts them) and its blocks (int64)."""
    k, v = cache.pool.k[index], cache.pool.v[index]
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    return k, v, cache.table
