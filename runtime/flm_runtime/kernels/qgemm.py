"""Integer products of the cpu backend: ``x @ w.T`` with ``w`` a ``QuantWeight`` (tiles of 16
rows, ``kernels/quant.py``) and ``x`` float32 rows quantized at the product's input.

Activations. Each row of ``x`` is quantized per block of 32 in two int8 levels: ``q1 =
rint(x / dx)`` with ``dx = max|x| / 127`` (llama.cpp's Q8_0 rule), then what that left, ``q2 =
rint((x - dx * q1) / step)`` with ``step = dx / 128``, so that ``x ~ step * (128 * q1 + q2)`` to
about 1/32768 of the block's largest magnitude (one level drifts measurably over a deep model;
docs/design.md, "Quantized weights"). A row's quantization depends on that row alone.

The dot product of weight row ``n`` and an activation row is, per block ``b``, with the integer
``i_b = 128 * sum(code * q1) + sum(code * q2)`` and ``S_b = 128 * sum(q1) + sum(q2)``:

- stored mins: ``acc = fma(float(i_b), scale_b * step_b, acc)``, then ``acc = fma(min_b, step_b *
  float(S_b), acc)``;
- symmetric (``min = -zero_point * scale``): ``acc = fma(float(i_b - zero_point * S_b), scale_b *
  step_b, acc)``: the zero point is taken out exactly, in integers;
- 6-bit, per half block ``h`` (16 inputs) with its sub-scale: ``acc = fma(float(sum_h sub_h *
  (i_h - 32 * S_h)), scale_b * step_b, acc)``, all in integers (``|.| < 128 * 32 * 16383 * 32 <
  2**31``), so the file's weights ``scale * sub * (code - 32)`` are multiplied exactly.

Blocks run in order, ``acc`` starting at 0. The integer sums run on the host's dot-product
instructions and are exact; the float32 steps are the same on every instruction set and for any
number of rows (docs/design.md, "Batch invariance"). So a row's result is bit-identical whether it
runs alone, among the 8 rows of a verify pass or among the 16 of a batched step, and on every
path (``ISAS``), which tests check.

A kernel step is one tile (16 weight rows) against up to 8 activation rows: per block, the tile's
codes are loaded (and 4-bit ones unpacked) once, and each activation row's four inputs of a group
are broadcast to every lane, so that lane ``l`` accumulates row ``16t + l`` with no horizontal sum.

Paths, fastest first; ``select_isa`` takes the first the host has (``cpu_features``):

- ``avx512vnni``: ``vpdpbusd`` on 512-bit vectors (a whole tile per instruction);
- ``avxvnni``: ``vpdpbusd`` on 256-bit vectors (VEX or EVEX encoded), half a tile at a time;
- ``avx2``: ``vpmaddwd`` on 16-bit words: the codes widened, the two levels joined into one
  word ``128 * q1 + q2`` (``quantize_activations``' ``xw``), one multiply per code pair where
  bytes would take a ``vpmaddubsw`` + ``vpmaddwd`` per level (two of each with 8-bit codes,
  split into nibbles against the 16-bit saturation of ``vpmaddubsw``);
- ``portable``: plain numba code (any CPU), the same arithmetic lane by lane.

AMX is never used: its tile instructions fault on some hosts that report them.

Threads: a product's tiles are split over the kernel team's threads (``kernels.team``), in a
model's step (``layers.stack``) or, called from Python (``qlinear``), as a step of its own.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from flm_runtime.kernels import cpu_features
from flm_runtime.kernels.irgen import (F16, F32, I1, I8, I16, I32, I64, as_i64, broadcast, counted_loop, data_ptr,
                                        declare, literal, load, prefetch, row_ptr, splat, store, vec)
from flm_runtime.kernels.jit import compiled, sources_key
from flm_runtime.kernels.quant import (BLOCK, GROUP, HIGH_BITS_AT, SUB_BLOCK, SUB_SCALES_AT, TILE, ZERO_POINT,
                                       QuantWeight, block_bytes)
from flm_runtime.kernels.team import barrier, default_team

ISAS = ("avx512vnni", "avxvnni", "avx2", "portable")
_ISA_FEATURES = {"avx512vnni": ("avx512vnni", "avx512bw", "avx512f", "f16c", "fma"),
                 "avxvnni": ("avxvnni", "avx2", "f16c", "fma"),
                 "avx2": ("avx2", "f16c", "fma"),
                 "portable": ()}
LEVEL_SHIFT = 7  # step = dx / 2**7: the second level's integers join the first's exactly
_GROUPS = BLOCK // GROUP  # code vectors per block of a tile
_PREFETCH_BLOCKS = 4  # how far ahead a multi-row kernel step prefetches its codes


@functools.cache
def host_isas() -> tuple[str, ...]:
    """The paths this host can run (``ISAS`` order), from LLVM's host CPU features."""
    return tuple(isa for isa in ISAS if cpu_features.has(*_ISA_FEATURES[isa]))


def select_isa() -> str:
    """The fastest path this host runs."""
    return host_isas()[0]


# --- activations ------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def quantize_activations(x, padded):  # pragma: no cover - compiled
    """``x`` ``[M, K]`` float32 in two int8 levels per block of 32 (module docstring), a block at a
    time on whole vectors (``_quantize_block``).

    Returns:
        ``xq`` ``[M, 2 * Kp]`` int8 (``q1`` in columns ``0 .. Kp-1``, ``q2`` in ``Kp ..``, input
        order, padding zeros); ``xw`` ``[M, Kp]`` int16, the two levels joined, ``128 * q1 + q2``
        (``|xw| <= 16383``); ``step`` ``[M, Kp/32]`` float32; ``sx`` ``[M, Kp/32]`` float32,
        ``step * S``; ``s`` ``[M, Kp/16]`` int32, ``S`` of each half block (``Kp = padded``).
    """
    m = x.shape[0]
    acts = new_activations(m, padded)
    for r in range(m):
        quantize_row(x, r, padded, *acts)
    return acts


@numba.njit(inline="always")
def new_activations(m, padded):  # pragma: no cover - compiled
    """Empty ``(xq, xw, step, sx, s)`` for ``m`` rows of padded width ``padded``
    (``quantize_activations``' shapes)."""
    nb = padded // BLOCK
    return (np.empty((m, 2 * padded), dtype=np.int8), np.empty((m, padded), dtype=np.int16),
            np.empty((m, nb), dtype=np.float32), np.empty((m, nb), dtype=np.float32),
            np.empty((m, 2 * nb), dtype=np.int32))


@numba.njit(nogil=True)
def quantize_row(x, r, padded, xq, xw, step, sx, s):  # pragma: no cover - compiled
    """Row ``r`` of ``x`` quantized into row ``r`` of ``(xq, xw, step, sx, s)``
    (``quantize_activations``' arithmetic and layout); it reads and writes that row alone."""
    row = x[r]
    k = row.shape[0]
    if k < padded:  # a row whose width is not whole blocks, padded
        padded_row = np.zeros(padded, dtype=np.float32)
        for j in range(k):  # a loop, not a slice assignment: no shape check to compile
            padded_row[j] = row[j]
        row = padded_row
    for b in range(padded // BLOCK):
        st, first_half, second_half = _quantize_block(row, xq, xw, r, b, padded)
        step[r, b] = st
        s[r, 2 * b] = first_half
        s[r, 2 * b + 1] = second_half
        sx[r, b] = st * np.float32(first_half + second_half)  # exact: |S| < 2**24


@intrinsic
def _quantize_block(typingctx, row, xq, xw, r, b, padded):  # pragma: no cover - compiled
    """``_quantize_block(row, xq, xw, r, b, padded) -> (step, S0, S1)``: inputs ``32b .. 32b+31``
    of ``row`` (1-D float32) in two levels (module docstring), written to ``xq[r, 32b ..]``
    (``q1``), ``xq[r, padded + 32b ..]`` (``q2``) and ``xw[r, 32b ..]`` (``128 * q1 + q2``), as
    ``<32 x float>`` vector IR (the scalar loop's max and rounding did not vectorize). ``S0``,
    ``S1``: ``sum(128 * q1 + q2)`` over the block's first and second 16 inputs, in integers."""
    sig = types.Tuple((types.float32, types.int32, types.int32))(row, xq, xw, r, b, padded)

    def codegen(context, builder, signature, args):
        row_t, xq_t, xw_t = signature.args[:3]
        row_v, xq_v, xw_v, r_v, b_v, padded_v = args
        r_v, b_v, padded_v = (as_i64(builder, v) for v in (r_v, b_v, padded_v))
        vf, vi = vec(F32, BLOCK), vec(I32, BLOCK)
        f32 = lambda v: ir.Constant(F32, v)  # noqa: E731
        data = data_ptr(context, builder, row_t, row_v, F32)
        first = builder.mul(b_v, ir.Constant(I64, BLOCK))
        v = load(builder, data, first, vf)
        amax = builder.call(declare(builder, "llvm.vector.reduce.fmax.v32f32", F32, [vf]),
                            [builder.call(declare(builder, "llvm.fabs.v32f32", vf, [vf]), [v])])
        dx = builder.fdiv(amax, f32(127.0))
        st = builder.fmul(dx, f32(1.0 / (1 << LEVEL_SHIFT)))  # exact: a power of two

        def inverse(a):  # 1 / a, or 0 for an all-zero block
            return builder.select(builder.fcmp_ordered(">", a, f32(0.0)), builder.fdiv(f32(1.0), a), f32(0.0))

        rint = declare(builder, "llvm.rint.v32f32", vf, [vf])
        lo = declare(builder, "llvm.maxnum.v32f32", vf, [vf, vf])
        hi = declare(builder, "llvm.minnum.v32f32", vf, [vf, vf])

        def level(a, inv):  # clamp(rint(a * inv), -127, 127)
            q = builder.call(rint, [builder.fmul(a, broadcast(builder, inv, BLOCK))])
            return builder.call(hi, [builder.call(lo, [q, splat(F32, BLOCK, -127.0)]), splat(F32, BLOCK, 127.0)])

        q1 = level(v, inverse(dx))
        q2 = level(builder.fsub(v, builder.fmul(broadcast(builder, dx, BLOCK), q1)), inverse(st))
        i1, i2 = builder.fptosi(q1, vi), builder.fptosi(q2, vi)
        out = row_ptr(context, builder, xq_t, xq_v, r_v, I8)
        for column, q in ((first, i1), (builder.add(padded_v, first), i2)):
            store(builder, builder.trunc(q, vec(I8, BLOCK)), out, column)
        joined = builder.add(builder.shl(i1, splat(I32, BLOCK, LEVEL_SHIFT)), i2)
        store(builder, builder.trunc(joined, vec(I16, BLOCK)), row_ptr(context, builder, xw_t, xw_v, r_v, I16), first)
        add16 = declare(builder, "llvm.vector.reduce.add.v16i32", I32, [vec(I32, SUB_BLOCK)])
        halves = [builder.call(add16, [builder.shuffle_vector(joined, joined, ir.Constant(
            vec(I32, SUB_BLOCK), list(range(h * SUB_BLOCK, (h + 1) * SUB_BLOCK))))]) for h in range(2)]
        return context.make_tuple(builder, signature.return_type, [st, *halves])

    return sig, codegen


def _dot4(builder, acc, codes, x):
    """``acc`` (``<n x i32>``) plus, per 32-bit lane, the sum of its four code bytes (unsigned)
    times the four int8 of ``x`` (``<4n x i8>`` each), exact: ``vpdpbusd``."""
    v = vec(I32, codes.type.count // 4)
    name = "llvm.x86.avx512.vpdpbusd.512" if v.count == 16 else "llvm.x86.avx512.vpdpbusd.256"
    return builder.call(declare(builder, name, v, [v, v, v]), [acc, builder.bitcast(codes, v), builder.bitcast(x, v)])


def _byte_dots(builder, tile_codes, xrow, x0, padded):
    """A block's integer sums ``128 * sum(code * q1) + sum(code * q2)`` (``<n x i32>``, a lane a
    weight row) over its first and over its second 16 inputs, of one activation row (``xrow``,
    its ``xq`` row; ``x0`` the block's first input), on the VNNI paths: a dot product of bytes per
    level."""
    width = tile_codes[0].type.count // 4
    halves = []
    for half in range(2):  # groups 0-3, then 4-7: the two sums chain independently, their adds overlap
        levels = []
        for level in range(2):
            start = builder.add(x0, padded) if level else x0
            acc = ir.Constant(vec(I32, width), None)
            for k in range(4 * half, 4 * half + 4):
                word = load(builder, xrow, builder.add(start, ir.Constant(I64, GROUP * k)), I32)
                x_k = builder.bitcast(broadcast(builder, word, width), tile_codes[k].type)
                acc = _dot4(builder, acc, tile_codes[k], x_k)
            levels.append(acc)
        halves.append(builder.add(builder.shl(levels[0], splat(I32, width, LEVEL_SHIFT)), levels[1]))
    return halves


def _word_dots(builder, tile_codes, wrows, x0):
    """AVX2's form of ``_byte_dots`` for every activation row at once (``wrows``: their ``xw``
    rows), the same integers (a pair per row: the block's halves): codes and the joined levels
    ``128 * q1 + q2`` as 16-bit words into ``vpmaddwd``. One multiply per code pair and row, where
    the bytes' form takes two levels of ``vpmaddubsw`` + ``vpmaddwd`` (four with 8-bit codes, split
    into nibbles against saturation); ``|code * xw|`` sums stay far inside int32.

    Each code vector (8 weight rows x 4 codes) is spread by one in-lane byte shuffle into the
    words of its codes 0-1 and of its codes 2-3, so that a 32-bit lane still holds one weight
    row; the words of inputs ``4k, 4k+1`` (then ``4k+2, 4k+3``) are broadcast against them."""
    i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
    pmaddwd = declare(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16)] * 2)
    zero = ir.Constant(vec(I8, 32), None)
    spreads = [ir.Constant(vec(I32, 32), [4 * (i // 4) + pair + i % 4 // 2 if i % 2 == 0 else 32 for i in range(32)])
               for pair in (0, 2)]  # lane bytes (c0, 0, c1, 0) and (c2, 0, c3, 0)
    words = [[builder.bitcast(builder.shuffle_vector(c, zero, spread), vec(I16, 16)) for spread in spreads]
             for c in tile_codes]
    totals = []
    for wrow in wrows:
        chains = [ir.Constant(vec(I32, 8), None)] * 4  # per half block and code pair: independent adds
        for k, pairs in enumerate(words):
            for pair, code_words in enumerate(pairs):
                word = load(builder, wrow, builder.add(x0, i64(GROUP * k + 2 * pair)), I32)  # two int16
                x_k = builder.bitcast(broadcast(builder, word, 8), vec(I16, 16))
                chain = 2 * (k // 4) + pair
                chains[chain] = builder.add(chains[chain], builder.call(pmaddwd, [code_words, x_k]))
        totals.append([builder.add(chains[0], chains[1]), builder.add(chains[2], chains[3])])
    return totals


def _tile_codes(builder, bits, width, wrow, b, part):
    """The ``_GROUPS`` code vectors ``<4 * width x i8>`` of block ``b`` of a tile (``wrow``: its
    codes), lanes ``part * width ..`` of the tile, 4- and 6-bit codes unpacked."""
    i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
    n = 4 * width
    offset = part * n
    base = builder.mul(b, i64(block_bytes(bits)))
    if bits == 8:
        return [load(builder, wrow, builder.add(base, i64(64 * g + offset)), vec(I8, n)) for g in range(_GROUPS)]
    packed = [load(builder, wrow, builder.add(base, i64(64 * g + offset)), vec(I8, n)) for g in range(_GROUPS // 2)]
    mask = splat(I8, n, 0x0F)
    codes = [builder.and_(p, mask) for p in packed] + [builder.lshr(p, splat(I8, n, 4)) for p in packed]
    if bits == 4:
        return codes
    high = [load(builder, wrow, builder.add(base, i64(HIGH_BITS_AT + 64 * j + offset)), vec(I8, n)) for j in range(2)]

    def high_bits(g):  # bits 2 (g % 4) of group g's plane byte, moved to bits 4-5 of its code
        plane, shift = high[g // 4], 4 - 2 * (g % 4)
        if shift > 0:
            plane = builder.shl(plane, splat(I8, n, shift))
        elif shift < 0:
            plane = builder.lshr(plane, splat(I8, n, -shift))
        return builder.and_(plane, splat(I8, n, 0x30))

    return [builder.or_(c, high_bits(g)) for g, c in enumerate(codes)]


def _sub_scales(builder, width, wrow, b, part):
    """A 6-bit block's sub-scales of lanes ``part * width ..`` of the tile, a ``<width x i32>`` per
    half block (quant's layout)."""
    base = builder.add(builder.mul(b, ir.Constant(I64, block_bytes(6))), ir.Constant(I64, SUB_SCALES_AT + part * width))
    return [builder.sext(load(builder, wrow, builder.add(base, ir.Constant(I64, TILE * h)), vec(I8, width)),
                         vec(I32, width)) for h in range(2)]


def _tile_codegen(isa, bits, group, has_mins, context, builder, sig, args):
    """IR of ``_tile_dots``: tile ``t`` against activation rows ``r0 .. r0+group-1``."""
    codes_t, scales_t, mins_t, _, xq_t, xw_t, step_t, sx_t, s_t, _, out_t = sig.args
    codes, scales, mins, t, xq, xw, step, sx, s, r0, out = args
    width = 16 if isa == "avx512vnni" else 8
    vf = vec(F32, width)
    fma = declare(builder, f"llvm.fma.v{width}f32", vf, [vf] * 3)
    i64 = lambda v: ir.Constant(I64, v)  # noqa: E731
    t, r0 = as_i64(builder, t), as_i64(builder, r0)

    def rows_of(array_t, array, elem):
        return [row_ptr(context, builder, array_t, array, builder.add(r0, i64(g)), elem) for g in range(group)]

    wrow = row_ptr(context, builder, codes_t, codes, t, I8)
    srow = row_ptr(context, builder, scales_t, scales, t, F16)
    mrow = row_ptr(context, builder, mins_t, mins, t, F16) if has_mins else None
    xrows, wrows, steps, sxs, ss, outs = (rows_of(xq_t, xq, I8), rows_of(xw_t, xw, I16), rows_of(step_t, step, F32),
                                          rows_of(sx_t, sx, F32), rows_of(s_t, s, I32), rows_of(out_t, out, F32))
    shape = cgutils.unpack_tuple(builder, context.make_array(scales_t)(context, builder, scales).shape, 2)
    n_blocks = builder.sdiv(shape[1], i64(TILE))
    padded = builder.mul(n_blocks, i64(BLOCK))
    n_out = cgutils.unpack_tuple(builder, context.make_array(out_t)(context, builder, out).shape, 2)[1]
    masked_store = declare(builder, f"llvm.masked.store.v{width}f32.p0", ir.VoidType(),
                       [vf, F32.as_pointer(), I32, vec(I1, width)])

    for part in range(TILE // width):  # 256-bit paths: the tile's two halves, one after the other
        b, accs, close = counted_loop(builder, n_blocks, [ir.Constant(vf, None)] * group)
        if part == 0 and group > 1:  # several rows a block: the loads alone run too little ahead
            ahead = builder.mul(builder.add(b, i64(_PREFETCH_BLOCKS)), i64(block_bytes(bits)))
            for line in range(0, block_bytes(bits), 64):
                prefetch(builder, wrow, builder.add(ahead, i64(line)))
        tile_codes = _tile_codes(builder, bits, width, wrow, b, part)
        lane0 = builder.add(builder.mul(b, i64(TILE)), i64(part * width))
        scale = builder.fpext(load(builder, srow, lane0, vec(F16, width)), vf)
        if has_mins:
            block_mins = builder.fpext(load(builder, mrow, lane0, vec(F16, width)), vf)
        x0 = builder.mul(b, i64(BLOCK))
        if isa == "avx2":
            halves = _word_dots(builder, tile_codes, wrows, x0)
        else:
            halves = [_byte_dots(builder, tile_codes, xrow, x0, padded) for xrow in xrows]
        subs = _sub_scales(builder, width, wrow, b, part) if bits == 6 else None
        new_accs = []
        for g, (h0, h1) in enumerate(halves):
            step_g = broadcast(builder, load(builder, steps[g], b, F32), width)
            if has_mins:
                total = builder.add(h0, h1)
            else:  # take the zero point out in integers (module docstring)
                zero_shift = splat(I32, width, ZERO_POINT[bits].bit_length() - 1)
                s0, s1 = (broadcast(builder, load(builder, ss[g], builder.add(builder.add(b, b), i64(h)), I32), width)
                          for h in range(2))
                if bits == 6:  # per half block: its zero point out, then its sub-scale
                    total = builder.add(*(builder.mul(builder.sub(h_i, builder.shl(s_i, zero_shift)), sub_i)
                                          for h_i, s_i, sub_i in ((h0, s0, subs[0]), (h1, s1, subs[1]))))
                else:
                    total = builder.sub(builder.add(h0, h1), builder.shl(builder.add(s0, s1), zero_shift))
            acc = builder.call(fma, [builder.sitofp(total, vf), builder.fmul(scale, step_g), accs[g]])
            if has_mins:
                acc = builder.call(fma, [block_mins, broadcast(builder, load(builder, sxs[g], b, F32), width), acc])
            new_accs.append(acc)
        close(new_accs)

        col = builder.add(builder.mul(t, i64(TILE)), i64(part * width))
        lanes = builder.add(broadcast(builder, col, width), ir.Constant(vec(I64, width), list(range(width))))
        mask = builder.icmp_signed("<", lanes, broadcast(builder, n_out, width))
        for g in range(group):
            builder.call(masked_store, [new_accs[g], builder.gep(outs[g], [col]), ir.Constant(I32, 4), mask])
    return context.get_dummy_value()


@intrinsic
def _tile_dots(typingctx, isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0,
               out):  # pragma: no cover
    """``_tile_dots(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out)``
    writes ``out[r0 + g, 16t .. 16t+15]`` (the columns below ``out``'s width) for ``g < group``
    (the module docstring's arithmetic) on the vector path ``ISAS[isa]``; the first four are
    compile-time constants, ``mins`` is read only when ``has_mins``."""
    consts = (ISAS[literal(isa, "isa")], literal(bits, "bits"), literal(group, "group"),
              bool(literal(has_mins, "has_mins")))
    sig = types.void(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out)

    def codegen(context, builder, signature, args):
        inner = signature.replace(args=signature.args[4:])
        return _tile_codegen(*consts, context, builder, inner, args[4:])

    return sig, codegen


compiled_block_bytes = numba.njit(inline="always")(block_bytes)  # quant.block_bytes in compiled code


# --- the portable path ----------------------------------------------------------------------------

@intrinsic
def _fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` rounded once (``llvm.fma.f32``), as the vector paths' fused multiply-adds."""

    def codegen(context, builder, sig, args):
        f = declare(builder, "llvm.fma.f32", F32, [F32] * 3)
        return builder.call(f, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f16(typingctx, bits):  # pragma: no cover - compiled
    """The float16 whose bits are the uint16 ``bits``, as float32 (exact)."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], F16), F32)

    return types.float32(types.uint16), codegen


# A call, not inlined: each of the 15 rows of a tile's four group sizes would inline its own copy
# (the compile time of the portable product, many times over); a call costs nothing beside its loops.
@numba.njit(nogil=True)
def _portable_tile(codes, scales, mins, t, xq, step, sx, s, r, out, bits, has_mins):  # pragma: no cover
    """The module's arithmetic for one tile and one activation row, lane by lane."""
    nb = scales.shape[1] // TILE
    padded = nb * BLOCK
    stride = compiled_block_bytes(bits)
    zero = 128 if bits == 8 else 32 if bits == 6 else 8  # ZERO_POINT[bits]
    for lane in range(min(TILE, out.shape[1] - t * TILE)):
        acc = np.float32(0.0)
        for b in range(nb):
            base = b * stride
            total = 0
            for h in range(2):
                half = 0
                for level in range(2):
                    half <<= LEVEL_SHIFT * level
                    for g in range(4 * h, 4 * h + 4):
                        for i in range(GROUP):
                            if bits == 8:
                                code = np.int32(codes[t, base + 64 * g + 4 * lane + i])
                            else:
                                byte = np.int32(codes[t, base + 64 * (g % 4) + 4 * lane + i])
                                code = byte & 0x0F if g < 4 else byte >> 4
                                if bits == 6:
                                    high = np.int32(codes[t, base + HIGH_BITS_AT + 64 * (g // 4) + 4 * lane + i])
                                    code |= ((high >> (2 * (g % 4))) & 3) << 4
                            half += code * np.int32(xq[r, level * padded + b * BLOCK + GROUP * g + i])
                if bits == 6:
                    sub = np.int32(codes[t, base + SUB_SCALES_AT + TILE * h + lane])
                    half = (half - zero * s[r, 2 * b + h]) * (sub - 256 if sub > 127 else sub)
                total += half
            if bits != 6 and not has_mins:
                total -= zero * (s[r, 2 * b] + s[r, 2 * b + 1])
            acc = _fma(np.float32(total), _f16(scales[t, b * TILE + lane]) * step[r, b], acc)
            if has_mins:
                acc = _fma(_f16(mins[t, b * TILE + lane]), sx[r, b], acc)
        out[r, t * TILE + lane] = acc


# --- the kernels ----------------------------------------------------------------------------------

def _tile_group(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out):
    """Tile ``t`` against activation rows ``r0 .. r0+group-1`` (compiled: ``_tile_group_impl``)."""


@overload(_tile_group, inline="always")
def _tile_group_impl(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out):
    """The portable path row by row, the vector paths through ``_tile_dots``; chosen while typing
    (the four leading arguments are constants), so a host compiles only the path it runs."""
    if ISAS[literal(isa, "isa")] != "portable":
        def vector(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out):  # pragma: no cover
            _tile_dots(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out)

        return vector

    def portable(isa, bits, has_mins, group, codes, scales, mins, t, xq, xw, step, sx, s, r0, out):  # pragma: no cover
        for r in range(r0, r0 + group):
            _portable_tile(codes, scales, mins, t, xq, step, sx, s, r, out, bits, has_mins)

    return portable


@numba.njit(inline="always")
def product_tiles(isa, bits, has_mins, codes, scales, mins, xq, xw, step, sx, s, out, first,
                  stop):  # pragma: no cover - compiled
    """Tiles ``first .. stop-1`` of ``x @ w.T``: ``out[r, 16t .. 16t+15]`` for every activation row
    ``r`` and each tile ``t`` (one thread's share of a product split over a ``kernels.team``).
    ``codes, scales, mins`` are ``operands(w)``; ``xq, xw, step, sx, s`` ``quantize_activations``';
    ``isa``, ``bits``, ``has_mins`` constants of the caller."""
    for t in range(first, stop):
        product_tile(isa, bits, has_mins, codes, scales, mins, xq, xw, step, sx, s, out, t)


@numba.njit(inline="always")
def product_tile(isa, bits, has_mins, codes, scales, mins, xq, xw, step, sx, s, out, t):  # pragma: no cover
    """Tile ``t``'s 16 output columns of every activation row, the rows in groups of 8, 4, 2, 1
    (a tile's codes read once a group)."""
    m = xq.shape[0]
    r = 0
    while r < m:
        rem = m - r
        if rem >= 8:
            _tile_group(isa, bits, has_mins, 8, codes, scales, mins, t, xq, xw, step, sx, s, r, out)
            r += 8
        elif rem >= 4:
            _tile_group(isa, bits, has_mins, 4, codes, scales, mins, t, xq, xw, step, sx, s, r, out)
            r += 4
        elif rem >= 2:
            _tile_group(isa, bits, has_mins, 2, codes, scales, mins, t, xq, xw, step, sx, s, r, out)
            r += 2
        else:
            _tile_group(isa, bits, has_mins, 1, codes, scales, mins, t, xq, xw, step, sx, s, r, out)
            r += 1


_NO_MINS = np.zeros((0, TILE), dtype=np.uint16)


class Format(NamedTuple):
    """A weight's kernel format: the path's index in ``ISAS``, code bits, stored mins."""

    isa: int
    bits: int
    has_mins: bool


def operands(w: QuantWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, mins)`` of ``w`` as the kernels take them (float16 as uint16 bits; no
    stored mins: an empty array)."""
    return w.codes, w.scales.view(np.uint16), _NO_MINS if w.mins is None else w.mins.view(np.uint16)


def format_of(w: QuantWeight, isa: str | None = None) -> Format:
    """``w``'s ``Format`` on ``isa`` (default ``select_isa()``).

    Raises:
        ValueError: the host cannot run ``isa``.
    """
    isa = isa or _DEFAULT_ISA
    if isa not in host_isas():
        raise ValueError(f"instruction set {isa!r} is not available here (host runs {host_isas()})")
    return Format(ISAS.index(isa), w.bits, w.mins is not None)


@functools.cache
def format_product(fmt: Format):
    """``product(codes, scales, mins, xq, xw, step, sx, s, out, first, stop)``: ``product_tiles``
    on format ``fmt``'s kernel, the format bound as constants. A function of its own, called and
    not inlined, so that a format's kernel is compiled once (and cached on disk) for every
    product that runs it: a stack's step runs five products a layer."""
    isa, bits, has_mins = fmt

    def product(codes, scales, mins, xq, xw, st, sx, s, out, first, stop):  # pragma: no cover - compiled
        product_tiles(isa, bits, has_mins, codes, scales, mins, xq, xw, st, sx, s, out, first, stop)

    return compiled(product, f"product {fmt!r} {sources_key()}", nogil=True)


@functools.cache
def _product_step(fmt: Format):
    """The ``kernels.team`` step of a product of format ``fmt``: ``step(tid, n_threads, sync, codes,
    scales, mins, xq, xw, step, sx, s, out)``, each thread its share of the tiles."""
    product = format_product(fmt)

    def step(tid, n_threads, sync, codes, scales, mins, xq, xw, st, sx, s, out):  # pragma: no cover - compiled
        tiles = codes.shape[0]
        product(codes, scales, mins, xq, xw, st, sx, s, out, tiles * tid // n_threads, tiles * (tid + 1) // n_threads)
        barrier(sync, n_threads)

    return compiled(step, f"product step {fmt!r} {sources_key()}", nogil=True)


def qlinear(x: np.ndarray, w: QuantWeight, isa: str | None = None) -> np.ndarray:
    """``x @ w.T`` on integer dot products, one step of the process's kernel team
    (``team.default_team``: steps of concurrent callers run one after the other).

    Args:
        x: ``[M, K]`` float32 (any ``M >= 1``).
        w: a ``[N, K]`` ``QuantWeight``.
        isa: a path of ``ISAS`` (default ``select_isa()``); tests force each.
    Returns:
        ``[M, N]`` float32, C-contiguous; each row depends on its own row of ``x`` alone.
    Raises:
        ValueError: the host cannot run ``isa``.
    """
    fmt = format_of(w, isa)
    assert x.ndim == 2 and x.shape[1] == w.in_features, f"shapes {x.shape} @ {w.shape}.T"
    acts = quantize_activations(np.ascontiguousarray(x, dtype=np.float32), w.padded_in_features)
    out = np.empty((x.shape[0], w.out_features), dtype=np.float32)
    default_team().run(_product_step(fmt), *operands(w), *acts, out)
    return out


_DEFAULT_ISA = select_isa()
