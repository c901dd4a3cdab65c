"""The cpu backend's compiled decoder layer for quantized weights, and the attention kernel
every layer uses.

A quantized layer over one sequence's rows is one numba call (norm, QKV product and RoPE, the K/V
write, attention, O product, residual, norm, gate/up product, SwiGLU, down product, residual);
over several sequences' rows, two calls (``attention_in``, ``attention_out``) with each sequence's
K/V write and attention between them (``attend_spans``). Attention is one kernel, ``attend``,
over the ``KVCache``'s key tiles; the float32 layer ``models.llama.decoder_layer`` calls it too.

Every computation is per row, in an order that does not depend on how many rows run or where in
the step a row sits: the products are ``qgemm``'s (bit-identical for any row count), norms and
RoPE are row-wise, and attention runs each query's scores and sums in a fixed order of its own.
So a row's logits are bit-identical whether it runs alone (decode), among the rows of a DFlash
verify pass, or in a batched step beside other sequences (docs/design.md, "Batch invariance").

The float32 reference of the same layer is ``models.llama.decoder_layer`` over ``cpu.py``'s numpy
functions.

Axis legend as ``cpu.py``: R rows of the step, T rows of one sequence, N positions attended,
H / Hkv query / key-value heads, D head dim, E hidden size, F FFN width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from flm_runtime.backends import irgen, qgemm, skinny_gemm
from flm_runtime.backends.irgen import (F16, F32, I1, I32, I64, as_i64, broadcast, counted_loop, data_ptr, declare,
                                        literal, load, prefetch, store, vec)
from flm_runtime.backends.quant import QuantWeight
from flm_runtime.core import KEY_TILE

# fastmath without nnan/ninf: reassociation lets LLVM vectorize the reductions (norms, attention
# dots), in an order fixed by the compiled code alone, the same for every row. numpy's error model:
# a division by zero gives inf instead of a check and a branch that stops the loop vectorizing.
_FASTMATH = {"reassoc", "contract", "arcp"}
_ELEMENTWISE = {"fastmath": _FASTMATH, "error_model": "numpy"}


class Product(NamedTuple):
    """A quantized matrix as the compiled layer takes it: ``qgemm.operands``, its padded input
    width, its output width and its kernel format."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    padded: int  # Kp
    n_out: int  # N
    bits: int
    has_mins: bool

    @classmethod
    def of(cls, w: QuantWeight) -> Product:
        return cls(*qgemm.operands(w), w.padded_in_features, w.out_features, w.bits, w.mins is not None)


@intrinsic
def _pow2(typingctx, n):  # pragma: no cover - compiled
    """``2.0 ** n`` as float32 for an int32 ``n`` in ``[-126, 127]`` (the exponent bits, built)."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always", **_ELEMENTWISE)
def _exp(x):  # pragma: no cover - compiled
    """``exp(x)`` in float32 within about 2 ulp, clamped to ``[exp(-87), exp(88)]``, in plain
    arithmetic that LLVM vectorizes (a loop of ``np.exp`` calls libm once per element). Cody-Waite
    reduction ``x = n ln2 + f`` and Cephes' ``expf`` polynomial on ``|f| <= ln2 / 2``."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.float32(np.rint(x * np.float32(1.44269504)))
    f = (x - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * f + np.float32(1.3981999507e-3)
    p = p * f + np.float32(8.3334519073e-3)
    p = p * f + np.float32(4.1665795894e-2)
    p = p * f + np.float32(1.6666665459e-1)
    p = p * f + np.float32(5.0000001201e-1)
    return (p * (f * f) + f + np.float32(1.0)) * _pow2(np.int32(n))


@numba.njit(nogil=True, **_ELEMENTWISE)
def _rms_norm(x, weight, eps):  # pragma: no cover - compiled
    """RMSNorm of each row of ``x`` ``[R, E]`` (as ``cpu.rms_norm``)."""
    r, e = x.shape
    out = np.empty_like(x)
    for i in range(r):
        ss = np.float32(0.0)
        for j in range(e):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(e) + np.float32(eps))
        for j in range(e):
            out[i, j] = x[i, j] * inv * weight[j]
    return out


@numba.njit(inline="always")
def _product(isa, bits, has_mins, codes, scales, mins, padded, n_out, x):  # pragma: no cover - compiled
    """``x @ w.T`` of a quantized ``w`` (``Product``'s fields): activations quantized, then
    ``qgemm.product`` (a ``prange``: the caller is parallel, ``isa, bits, has_mins`` constants)."""
    xq, xw, step, sx, s = qgemm.quantize_activations(x, padded)
    out = np.empty((x.shape[0], n_out), dtype=np.float32)
    qgemm.product(isa, bits, has_mins, codes, scales, mins, xq, xw, step, sx, s, out)
    return out


@numba.njit(nogil=True)
def _rope(x, cos, sin, first, heads, d):  # pragma: no cover - compiled
    """Rotate-half RoPE of ``heads`` heads of width ``d`` starting at column ``first`` of each
    row of ``x`` (as ``cpu.apply_rope``); ``[R, heads, D]`` float32."""
    r, half = x.shape[0], d // 2
    out = np.empty((r, heads, d), dtype=np.float32)
    for i in range(r):
        for h in range(heads):
            base = first + h * d
            for j in range(half):
                x1, x2, c, s = x[i, base + j], x[i, base + half + j], cos[i, j], sin[i, j]
                out[i, h, j] = x1 * c - x2 * s
                out[i, h, half + j] = x2 * c + x1 * s
    return out


@numba.njit(parallel=True, cache=True, nogil=True)
def attention_in(x, norm, eps, codes, scales, mins, padded, n_out, cos, sin, n_heads, n_kv_heads, head_dim,
                 isa, bits, has_mins):  # pragma: no cover - compiled
    """Norm, fused QKV product (``codes .. padded``: its ``Product`` fields; ``isa, bits,
    has_mins`` its format) and RoPE of the rows ``x`` ``[R, E]``.

    Returns:
        ``(q [R, H, D], k [R, Hkv, D], v [R, Hkv, D])`` float32, RoPE applied to q and k.
    """
    numba.literally(isa)
    numba.literally(bits)
    numba.literally(has_mins)
    qkv = _product(isa, bits, has_mins, codes, scales, mins, padded, n_out, _rms_norm(x, norm, eps))  # [R, (H+2Hkv)*D]
    q = _rope(qkv, cos, sin, 0, n_heads, head_dim)
    k = _rope(qkv, cos, sin, n_heads * head_dim, n_kv_heads, head_dim)
    v = qkv[:, (n_heads + n_kv_heads) * head_dim:].copy().reshape(x.shape[0], n_kv_heads, head_dim)
    return q, k, v


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
def _score_tiles(typingctx, queries, n_queries, tiles, first, count, scale, scores):  # pragma: no cover - compiled
    """``_score_tiles(queries, n_queries, tiles, first, count, scale, scores)``: for each of the
    first ``n_queries`` (a constant) rows ``j`` of ``queries`` ``[G, D]`` and each of the
    ``count`` (a constant) key tiles ``i = first ..`` of ``tiles`` ``[n_tiles, D, 16]``,
    ``scores[j, 16 i + l] = scale * sum_e queries[j, e] * tiles[i, e, l]``, each lane a chain of
    fused multiply-adds over ``e`` in order. A tile's row is loaded once for all the queries,
    and the chains run side by side so that their latencies overlap; each chain's arithmetic is
    the same whatever runs beside it."""
    elem = _contiguous(queries, scores, cache=tiles)
    g, n = literal(n_queries, "n_queries"), literal(count, "count")
    sig = types.void(queries, n_queries, tiles, first, count, scale, scores)

    def codegen(context, builder, signature, args):
        q_t, _, k_t, _, _, _, s_t = signature.args
        queries_v, _, tiles_v, first_v, _, scale_v, scores_v = args
        first_v = as_i64(builder, first_v)
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
            for i, acc in zip(tiles_at, sums[j * n:(j + 1) * n]):
                at = builder.add(builder.mul(i64(j), score_width), builder.mul(i, i64(KEY_TILE)))
                store(builder, builder.fmul(acc, scale_v), sp, at)
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
def _weighted_values(typingctx, weights, n_queries, values, n, column, width, masked, scales,
                     out):  # pragma: no cover - compiled
    """``_weighted_values(weights, n_queries, values, n, column, width, masked, scales, out)``:
    for each of the first ``n_queries`` (a constant) rows ``j`` of ``weights`` ``[G, N']``,
    ``out[j * D + column + c] = scales[j] * sum_i weights[j, i] * values[i, column + c]`` over
    ``i < n`` for ``c < width`` (a constant multiple of 16), ``D`` the row width of ``values``.
    ``masked`` (a constant): lanes with ``column + c >= D`` are neither read nor written;
    without it the caller ensures ``column + width <= D``. The sums stay in registers, each lane
    a chain over ``i`` in order (the same whatever runs beside it); a value row is loaded once
    for all the queries."""
    elem = _contiguous(weights, scales, out, cache=values)
    g, w, is_masked = literal(n_queries, "n_queries"), literal(width, "width"), bool(literal(masked, "masked"))
    assert w % KEY_TILE == 0
    sig = types.void(weights, n_queries, values, n, column, width, masked, scales, out)

    def codegen(context, builder, signature, args):
        p_t, _, v_t, _, _, _, _, c_t, o_t = signature.args
        weights_v, _, values_v, n_v, column_v, _, _, scales_v, out_v = args
        n_v, column_v = as_i64(builder, n_v), as_i64(builder, column_v)
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

        i, accs, close = counted_loop(builder, n_v, [ir.Constant(vf, None)] * (g * chunks))
        first = builder.add(builder.mul(i, row_width), column_v)
        for c in range(chunks):  # the value row _VALUE_AHEAD positions on
            prefetch(builder, vp, builder.add(first, builder.add(builder.mul(row_width, i64(_VALUE_AHEAD)),
                                                                 i64(KEY_TILE * c))))
        rows = [_widen(builder, read(c, builder.add(first, i64(KEY_TILE * c)))) for c in range(chunks)]
        sums = []
        for j in range(g):
            p = broadcast(builder, load(builder, pp, builder.add(builder.mul(i64(j), weights_width), i), F32), KEY_TILE)
            sums += [builder.call(fma, [p, value, acc]) for value, acc in zip(rows, accs[j * chunks:(j + 1) * chunks])]
        close(sums)
        for j in range(g):
            scale = broadcast(builder, load(builder, cp, i64(j), F32), KEY_TILE)
            for c in range(chunks):
                dst = builder.add(builder.mul(i64(j), row_width), builder.add(column_v, i64(KEY_TILE * c)))
                result = builder.fmul(sums[j * chunks + c], scale)
                if is_masked:
                    builder.call(masked_store, [result, at(op, dst, vf), ir.Constant(I32, 4), masks[c]])
                else:
                    store(builder, result, op, dst)
        return context.get_dummy_value()

    return sig, codegen


_QUERY_GROUP = 3  # query heads of one key-value head taken together
_VALUE_AHEAD = 8  # value rows ahead of the one being summed whose lines are prefetched
# Key tiles scored side by side and head-dimension columns summed at a time, sized so that the
# accumulators stay in registers: 3 x 8 score chains and 3 x 4 value sums of 16 lanes fill
# AVX-512's 32 registers; AVX2's 16 registers of 8 lanes hold 3 x 2 chains and 3 x 2 sums.
_SCORE_TILES, _VALUE_COLUMNS = (8, 64) if irgen.vector_registers() == 32 else (2, 32)


@numba.njit(inline="always", **_ELEMENTWISE)
def _attend_heads(queries, g, tiles, values, n, scale, scores, out):  # pragma: no cover - compiled
    """``g`` (a constant) query heads ``queries`` ``[g, D]`` of one row over the first ``n``
    positions of one key-value head (``tiles``, ``values``): softmax of the scaled scores, then
    the weighted values into ``out`` ``[g * D]``; ``scores`` ``[>= g, >= 16 n_tiles]`` is scratch."""
    d = queries.shape[1]
    n_tiles = (n + KEY_TILE - 1) // KEY_TILE
    tile = 0
    while tile + _SCORE_TILES <= n_tiles:
        _score_tiles(queries, g, tiles, tile, _SCORE_TILES, scale, scores)
        tile += _SCORE_TILES
    while tile < n_tiles:
        _score_tiles(queries, g, tiles, tile, 1, scale, scores)
        tile += 1
    inverse = np.empty(g, dtype=np.float32)
    for j in range(g):
        row = scores[j]
        for i in range(n, n_tiles * KEY_TILE):  # the last tile's positions past n
            row[i] = -np.inf
        top = _max_of_tiles(row, n_tiles)
        total = np.float32(0.0)
        for i in range(n):
            p = _exp(row[i] - top)
            row[i] = p
            total += p
        inverse[j] = np.float32(1.0) / total
    column = 0
    while column + _VALUE_COLUMNS <= d:
        _weighted_values(scores, g, values, n, column, _VALUE_COLUMNS, False, inverse, out)
        column += _VALUE_COLUMNS
    while column + KEY_TILE <= d:
        _weighted_values(scores, g, values, n, column, KEY_TILE, False, inverse, out)
        column += KEY_TILE
    if column < d:  # a head dim that is not whole vectors
        _weighted_values(scores, g, values, n, column, KEY_TILE, True, inverse, out)


@numba.njit(parallel=True, cache=True, nogil=True, **_ELEMENTWISE)
def attend(q, k, v, start, causal, out):  # pragma: no cover - compiled
    """Grouped-query attention of ``T`` query rows over one layer of a sequence's KV cache (as
    ``cpu.attention``): query row ``t`` sits at position ``start + t`` and attends positions
    ``0 .. start + t`` (``causal``) or all ``start + T``; query head ``h`` reads key/value head
    ``h // (H / Hkv)``.

    One parallel item per query row and key-value head, its query heads taken up to
    ``_QUERY_GROUP`` at a time over keys and values loaded once for them. Each query's scores and
    sums run in a fixed order that depends on its position alone (``_score_tiles``,
    ``_weighted_values``): a row's output is bit-identical whatever rows run beside it
    (docs/design.md, "Batch invariance").

    Args:
        q: ``[T, H, D]`` float32 C-contiguous (RoPE applied).
        k: ``[Hkv, S/16, D, 16]``, v: ``[Hkv, S, D]``: one layer of a ``KVCache`` (keys in tiles),
            holding the step's keys and values already (positions ``0 .. start + T - 1``; the
            rest of its capacity is not used); float32, or float16 as its uint16 bits
            (``cache_arrays``).
        out: ``[T, H * D]`` float32 C-contiguous, written.
    """
    t_rows, h, d = q.shape
    hkv = k.shape[0]
    group = h // hkv
    scale = np.float32(1.0 / np.sqrt(d))
    for item in numba.prange(t_rows * hkv):
        t, kv = item // hkv, item % hkv
        n = start + t + 1 if causal else start + t_rows
        scores = np.empty((min(group, _QUERY_GROUP), (n + KEY_TILE - 1) // KEY_TILE * KEY_TILE), dtype=np.float32)
        head = kv * group
        while head + _QUERY_GROUP <= (kv + 1) * group:
            _attend_heads(q[t, head:head + _QUERY_GROUP], _QUERY_GROUP, k[kv], v[kv], n, scale, scores,
                          out[t, head * d:(head + _QUERY_GROUP) * d])
            head += _QUERY_GROUP
        while head < (kv + 1) * group:
            _attend_heads(q[t, head:head + 1], 1, k[kv], v[kv], n, scale, scores, out[t, head * d:(head + 1) * d])
            head += 1


@numba.njit(nogil=True, **_ELEMENTWISE)
def _swiglu(gate_up):  # pragma: no cover - compiled
    r, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((r, f), dtype=np.float32)
    for i in range(r):
        for j in range(f):
            g = gate_up[i, j]
            out[i, j] = g / (np.float32(1.0) + _exp(-g)) * gate_up[i, f + j]
    return out


@numba.njit(parallel=True, cache=True, nogil=True)
def attention_out(x, attn, ffn_norm, eps, o_codes, o_scales, o_mins, o_padded, o_n, gu_codes, gu_scales, gu_mins,
                  gu_padded, gu_n, d_codes, d_scales, d_mins, d_padded, d_n, isa, o_bits, o_has_mins, gu_bits,
                  gu_has_mins, d_bits, d_has_mins):  # pragma: no cover - compiled
    """The rest of the layer: ``x + attn @ wo.T``, then the SwiGLU FFN and its residual (the
    three products' ``Product`` fields, then their formats).

    Args:
        x: ``[R, E]`` the layer's input rows; attn: ``[R, H * D]``.
    Returns:
        ``[R, E]`` float32, the layer's output.
    """
    numba.literally(isa)
    numba.literally(o_bits)
    numba.literally(o_has_mins)
    numba.literally(gu_bits)
    numba.literally(gu_has_mins)
    numba.literally(d_bits)
    numba.literally(d_has_mins)
    x = x + _product(isa, o_bits, o_has_mins, o_codes, o_scales, o_mins, o_padded, o_n, attn)
    gate_up = _product(isa, gu_bits, gu_has_mins, gu_codes, gu_scales, gu_mins, gu_padded, gu_n,
                       _rms_norm(x, ffn_norm, eps))
    return x + _product(isa, d_bits, d_has_mins, d_codes, d_scales, d_mins, d_padded, d_n, _swiglu(gate_up))


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


@numba.njit(nogil=True, cache=True)
def store_kv(k, v, k_cache, v_cache, start):  # pragma: no cover - compiled
    """Write a step's keys and values ``k``, ``v`` ``[T, Hkv, D]`` float32 at positions ``start ..
    start + T - 1`` of one layer of a cache (``cache_arrays``: keys in tiles; float32, or float16
    bits, rounded as numpy rounds), as ``KVCache.write`` does: the one-call layer's write, inside
    compiled code (every other path writes through ``KVCache.write``)."""
    for t in range(k.shape[0]):
        tile, lane = divmod(start + t, KEY_TILE)
        for h in range(k.shape[1]):
            for e in range(k.shape[2]):
                k_cache[h, tile, e, lane] = _cache_element(k_cache, k[t, h, e])
                v_cache[h, start + t, e] = _cache_element(v_cache, v[t, h, e])


def attend_spans(index: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, spans, causal: bool) -> np.ndarray:
    """A layer's attention over a step's rows, sequence by sequence: each span's new keys and
    values ``k``, ``v`` ``[R, Hkv, D]`` go into layer ``index`` of its cache, then its queries
    ``q`` ``[R, H, D]`` attend it (``attend``). ``spans``: per sequence, an object with ``cache``,
    ``start`` (the cache length before the step) and ``rows`` (its slice of the rows), as
    ``LlamaModel``'s spans. The caller holds ``skinny_gemm.KERNEL_LOCK``.

    Returns:
        ``[R, H * D]`` float32.
    """
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)
    for s in spans:
        s.cache.write(index, k[s.rows].transpose(1, 0, 2), v[s.rows].transpose(1, 0, 2))
        attend(q[s.rows], *cache_arrays(s.cache, index), s.start, causal, out[s.rows])
    return out


def cache_arrays(cache, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``index`` of a ``KVCache`` as ``attend`` takes it: ``(k, v)``, float16 ones as their
    uint16 bits (numba has no float16 arrays; the kernel converts them)."""
    k, v = cache.k[index], cache.v[index]
    return (k.view(np.uint16), v.view(np.uint16)) if k.dtype == np.float16 else (k, v)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row ``[R, E]`` -> ``[R, E]`` float32, row by row (the fused layer's)."""
    return _rms_norm(np.ascontiguousarray(x, dtype=np.float32), weight, np.float32(eps))


@functools.cache
def _bound(isa: int, qkv: tuple[int, bool], o: tuple[int, bool], gu: tuple[int, bool], dn: tuple[int, bool]):
    """``attention_in`` and ``attention_out`` with the layer's formats (``(bits, has_mins)`` per
    product) bound as constants: a call from Python cannot pass constants (numba would retype
    every call), a compiled caller can, and the two are cached on disk for each format. Also the
    whole layer of one sequence's rows in one call (``layer``: ``attention_in``, ``store_kv``,
    ``attend``, ``attention_out``), which saves a step of one sequence (a decode, a verify pass)
    four returns to Python a layer."""
    (qkv_bits, qkv_has), (o_bits, o_has), (gu_bits, gu_has), (d_bits, d_has) = qkv, o, gu, dn

    @numba.njit(nogil=True)
    def layer_in(x, norm, eps, codes, scales, mins, padded, n_out, cos, sin, n_heads, n_kv_heads,
                 head_dim):  # pragma: no cover
        return attention_in(x, norm, eps, codes, scales, mins, padded, n_out, cos, sin, n_heads, n_kv_heads,
                            head_dim, isa, qkv_bits, qkv_has)

    @numba.njit(nogil=True)
    def layer_out(x, attn, ffn_norm, eps, o_codes, o_scales, o_mins, o_padded, o_n, gu_codes, gu_scales,
                  gu_mins, gu_padded, gu_n, d_codes, d_scales, d_mins, d_padded, d_n):  # pragma: no cover
        return attention_out(x, attn, ffn_norm, eps, o_codes, o_scales, o_mins, o_padded, o_n, gu_codes, gu_scales,
                             gu_mins, gu_padded, gu_n, d_codes, d_scales, d_mins, d_padded, d_n, isa, o_bits, o_has,
                             gu_bits, gu_has, d_bits, d_has)

    @numba.njit(nogil=True)
    def layer(x, norm, eps, codes, scales, mins, padded, n_out, cos, sin, n_heads, n_kv_heads, head_dim, k_cache,
              v_cache, start, causal, ffn_norm, o_codes, o_scales, o_mins, o_padded, o_n, gu_codes, gu_scales,
              gu_mins, gu_padded, gu_n, d_codes, d_scales, d_mins, d_padded, d_n):  # pragma: no cover
        q, k, v = attention_in(x, norm, eps, codes, scales, mins, padded, n_out, cos, sin, n_heads, n_kv_heads,
                               head_dim, isa, qkv_bits, qkv_has)
        store_kv(k, v, k_cache, v_cache, start)
        attn = np.empty((x.shape[0], n_heads * head_dim), dtype=np.float32)
        attend(q, k_cache, v_cache, start, causal, attn)
        return attention_out(x, attn, ffn_norm, eps, o_codes, o_scales, o_mins, o_padded, o_n, gu_codes, gu_scales,
                             gu_mins, gu_padded, gu_n, d_codes, d_scales, d_mins, d_padded, d_n, isa, o_bits, o_has,
                             gu_bits, gu_has, d_bits, d_has)

    return layer_in, layer_out, layer


class FusedLayer:
    """One decoder layer whose matrices are all ``QuantWeight``.

    Args:
        layer: a ``LlamaLayer`` (norm vectors float32, matrices quantized).
        n_heads, n_kv_heads, head_dim, eps: the model's geometry and RMSNorm epsilon.
    """

    def __init__(self, layer, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
        self.attn_norm, self.ffn_norm = layer.attn_norm, layer.ffn_norm
        products = [Product.of(w) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        self.wqkv, self.wo, self.w_gate_up, self.w_down = (p[:5] for p in products)
        self._in, self._out, self._layer = _bound(qgemm.format_of(layer.wqkv).isa, *(p[5:] for p in products))
        self.geometry = (n_heads, n_kv_heads, head_dim)
        self.eps = np.float32(eps)

    def __call__(self, index: int, x: np.ndarray, spans, cos: np.ndarray, sin: np.ndarray,
                 causal: bool = True) -> np.ndarray:
        """The layer over the rows ``x`` ``[R, E]`` (``cos``, ``sin`` ``[R, D/2]`` at their
        positions). ``spans``: per sequence, an object with ``cache`` (its KV cache: layer
        ``index`` is written), ``start`` (the cache length before the step) and ``rows`` (its
        slice of the rows), as ``LlamaModel``'s spans.
        Returns ``[R, E]``."""
        h, hkv, d = self.geometry
        with skinny_gemm.KERNEL_LOCK:
            if len(spans) == 1:  # one sequence (a decode, a verify pass, a prefill chunk): one call
                s = spans[0]
                return self._layer(x, self.attn_norm, self.eps, *self.wqkv, cos, sin, h, hkv, d,
                                   *cache_arrays(s.cache, index), s.start, causal, self.ffn_norm, *self.wo,
                                   *self.w_gate_up, *self.w_down)
            q, k, v = self._in(x, self.attn_norm, self.eps, *self.wqkv, cos, sin, h, hkv, d)
            attn = attend_spans(index, q, k, v, spans, causal)
            return self._out(x, attn, self.ffn_norm, self.eps, *self.wo, *self.w_gate_up, *self.w_down)
