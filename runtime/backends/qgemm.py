"""Integer products of the cpu backend: ``x @ w.T`` with ``w`` a ``QuantWeight`` (blocks of 32
codes in lane order, ``backends/quant.py``) and ``x`` float32 rows quantized to int8 at the
product's input.

Activations. Each row of ``x`` is quantized per block of 32 (llama.cpp's Q8_0 rule on the fly):
``dx = max|x| / 127``, ``qx = rint(x / dx)``; ``sx = dx * sum(qx)`` carries the block's sum for
the weight's min. A row's quantization depends on that row alone.

The dot product of a weight row and an activation row is, per block ``b``,
``scale_b * dx_b * sum(code * qx) + min_b * sx_b``. The integer sums run on the host's
dot-product instructions and are exact; everything after them is float32 in ONE fixed order,
the same on every instruction set and for any number of rows (docs/design.md, "Batch
invariance"):

- a chunk of 64 inputs gives 16 int32 lanes, lane ``l`` the sum over lane-order positions
  ``4l .. 4l+3`` (even lanes the chunk's first block, odd lanes its second); per lane, chunk
  after chunk, ``acc = fma(float(lane), scale * dx, acc)`` (``float(lane)`` is exact);
- the min terms, 8 blocks at a time: ``side[t] = fma(min_b, sx_b, side[t])`` for ``b = 8i + t``;
- the result is ``((acc[0..7] + acc[8..15]) + side)`` summed as a tree: halves of 4, 2, 1.

So a row's result is bit-identical whether it runs alone, among the 8 rows of a verify pass or
among the 16 of a batched step, and on every path (``ISAS``), which tests check.

Paths, fastest first; ``select_isa`` takes the first the host has (LLVM's own view of the CPU):

- ``avx512vnni``: ``vpdpbusd`` on 512-bit vectors (a chunk per instruction and row);
- ``avxvnni``: ``vpdpbusd`` on 256-bit vectors (VEX or EVEX encoded);
- ``avx2``: ``vpmaddubsw`` + ``vpmaddwd``; 8-bit codes go in two nibbles, so that the 16-bit
  pair sums cannot saturate;
- ``portable``: plain numba code (any CPU), the same arithmetic lane by lane.

AMX is never used: its tile instructions fault on some hosts that report them.

Threads: output rows are split over numba's threads; every call holds
``skinny_gemm.KERNEL_LOCK`` (numba's workqueue layer aborts when two threads enter a parallel
kernel at once).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from flm_runtime.backends import skinny_gemm
from flm_runtime.backends.quant import BLOCK, CHUNK, CHUNK_ORDER, ZERO_POINT, QuantWeight

_POSITION = np.argsort(CHUNK_ORDER)  # input offset in a chunk -> its lane-order position

ISAS = ("avx512vnni", "avxvnni", "avx2", "portable")
_ISA_FEATURES = {"avx512vnni": ("avx512vnni", "avx512bw", "avx512f", "f16c", "fma"),
                 "avxvnni": ("avxvnni", "avx2", "f16c", "fma"),
                 "avx2": ("avx2", "f16c", "fma"),
                 "portable": ()}
_LANES = 16  # int32 lanes per chunk


@functools.cache
def host_isas() -> tuple[str, ...]:
    """The paths this host can run (``ISAS`` order), from LLVM's host CPU features."""
    features = llvm.get_host_cpu_features()
    return tuple(isa for isa in ISAS if all(features.get(f, False) for f in _ISA_FEATURES[isa]))


def select_isa() -> str:
    """The fastest path this host runs."""
    return host_isas()[0]


# --- activations ------------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def _quantize_rows(x, xq, dx, sx):  # pragma: no cover - compiled
    """``x`` ``[M, K]`` float32 -> ``xq`` ``[M, Kp]`` int8 in lane order (``CHUNK_ORDER``), per
    block ``dx`` ``[M, Kp/32]`` and ``sx`` ``[M, Kp/32 rounded up to 8]`` float32; padding is zeros."""
    m, k = x.shape
    nb = dx.shape[1]
    sx[:, nb:] = 0
    for r in range(m):
        for b in range(nb):
            lo = b * BLOCK
            amax = np.float32(0.0)
            for i in range(lo, min(lo + BLOCK, k)):
                amax = max(amax, abs(x[r, i]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            chunk = b // 2 * CHUNK
            for i in range(lo, lo + BLOCK):
                q = int(np.rint(x[r, i] * inv)) if i < k else 0
                xq[r, chunk + _POSITION[i - chunk]] = q
                total += q
            dx[r, b] = d
            sx[r, b] = d * np.float32(total)


@numba.njit(nogil=True)
def quantize_two_levels(x, padded):  # pragma: no cover - compiled
    """``x`` ``[M, K]`` float32 as ``2M`` int8 rows: rows ``0..M-1`` quantize ``x``, rows
    ``M..2M-1`` what that left (``x - dx * qx``), so that a product's result is the sum of the
    two halves' (``combine``) with about 127 times less activation error than one int8 level.
    Returns ``(xq [2M, Kp] int8, dx [2M, Kp/32], sx [2M, Kp/32 up to 8] float32)``."""
    m, k = x.shape
    nb = padded // BLOCK
    xq = np.empty((2 * m, padded), dtype=np.int8)
    dx = np.empty((2 * m, nb), dtype=np.float32)
    sx = np.empty((2 * m, -(-nb // 8) * 8), dtype=np.float32)
    _quantize_rows(x, xq[:m], dx[:m], sx[:m])
    rest = np.empty_like(x)
    for r in range(m):
        for i in range(k):
            c, p = divmod(i, CHUNK)
            rest[r, i] = x[r, i] - dx[r, i // BLOCK] * np.float32(xq[r, c * CHUNK + _POSITION[p]])
    _quantize_rows(rest, xq[m:], dx[m:], sx[m:])
    return xq, dx, sx


@numba.njit(nogil=True)
def combine(out2):  # pragma: no cover - compiled
    """``[2M, N]`` products of ``quantize_two_levels``' rows -> ``[M, N]``: each row's two halves summed."""
    m = out2.shape[0] // 2
    return out2[:m] + out2[m:]


# --- LLVM IR building blocks --------------------------------------------------------------------

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, value):
    return ir.Constant(_vec(t, n), [ir.Constant(t, value)] * n)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _row_ptr(context, builder, array_type, array_value, row, elem):
    """``&array[row, 0]`` as a pointer to ``elem`` (a C-contiguous 2-D array)."""
    arr = context.make_array(array_type)(context, builder, array_value)
    stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    base = builder.bitcast(arr.data, _I8.as_pointer())
    return builder.bitcast(builder.gep(base, [builder.mul(row, stride)]), elem.as_pointer())


def _load(builder, ptr, index, vec_type):
    """Load ``vec_type`` at element ``index`` of ``ptr`` (unaligned)."""
    p = builder.bitcast(builder.gep(ptr, [index]), vec_type.as_pointer())
    return builder.load(p, align=1)


def _lanes(builder, isa, bits, w_bytes, x_bytes):
    """The 16 int32 lane sums of one chunk, as a list of vectors covering lanes 0..15 in order
    (one ``<16 x i32>`` on 512-bit paths, two ``<8 x i32>`` on 256-bit ones).

    ``w_bytes``: the chunk's codes as the path wants them (``_weight_chunk``); ``x_bytes``: its
    64 int8 activations, split the same way."""
    out = []
    for w, x in zip(w_bytes, x_bytes):
        n = w.type.count // 4
        if isa in ("avx512vnni", "avxvnni"):
            name = "llvm.x86.avx512.vpdpbusd.512" if n == 16 else "llvm.x86.avx512.vpdpbusd.256"
            v = _vec(_I32, n)
            f = _fn(builder, name, v, [v, v, v])
            out.append(builder.call(f, [ir.Constant(v, None), builder.bitcast(w, v), builder.bitcast(x, v)]))
            continue
        pmaddubsw = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
        pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
        ones = _splat(_I16, 16, 1)
        if bits == 4:  # codes <= 15: a pair sum is at most 2 * 15 * 128, no saturation
            out.append(builder.call(pmaddwd, [builder.call(pmaddubsw, [w, x]), ones]))
            continue
        low = builder.and_(w, _splat(_I8, 32, 0x0F))
        high = builder.lshr(w, _splat(_I8, 32, 4))
        s_low = builder.call(pmaddwd, [builder.call(pmaddubsw, [low, x]), ones])
        s_high = builder.call(pmaddwd, [builder.call(pmaddubsw, [high, x]), ones])
        out.append(builder.add(s_low, builder.shl(s_high, _splat(_I32, 8, 4))))
    return out


def _weight_chunk(builder, wide, bits, wrow, c):
    """Chunk ``c``'s 64 codes of a weight row, one byte each: ``[<64 x i8>]`` (``wide``) or two
    ``<32 x i8>`` (inputs 0-31, 32-63)."""
    if bits == 8:
        at = builder.mul(c, ir.Constant(_I64, 64))
        if wide:
            return [_load(builder, wrow, at, _vec(_I8, 64))]
        return [_load(builder, wrow, at, _vec(_I8, 32)),
                _load(builder, wrow, builder.add(at, ir.Constant(_I64, 32)), _vec(_I8, 32))]
    packed = _load(builder, wrow, builder.mul(c, ir.Constant(_I64, 32)), _vec(_I8, 32))
    mask = _splat(_I8, 64 if wide else 32, 0x0F)
    if wide:  # both halves of a 512-bit vector hold the 32 bytes; the upper half is shifted by 4
        both = builder.shuffle_vector(packed, packed, ir.Constant(_vec(_I32, 64), list(range(32)) * 2))
        q = builder.bitcast(both, _vec(ir.IntType(64), 8))
        shifts = ir.Constant(_vec(ir.IntType(64), 8), [0] * 4 + [4] * 4)
        return [builder.and_(builder.bitcast(builder.lshr(q, shifts), _vec(_I8, 64)), mask)]
    return [builder.and_(packed, mask), builder.and_(builder.lshr(packed, _splat(_I8, 32, 4)), mask)]


def _split(builder, vec, parts):
    """``vec`` cut into ``parts`` equal consecutive vectors."""
    n = vec.type.count // parts
    return [builder.shuffle_vector(vec, vec, ir.Constant(_vec(_I32, n), list(range(p * n, (p + 1) * n))))
            for p in range(parts)]


def _splat_value(builder, value, n):
    """``value`` repeated in an ``n``-lane vector."""
    first = builder.insert_element(ir.Constant(_vec(value.type, n), None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, first, ir.Constant(_vec(_I32, n), [0] * n))


def _tree_sum(builder, parts, side):
    """The module's fixed final sum: 16 lanes (1 or 2 vectors, in order) folded to 8, plus the
    8 min-term lanes ``side``, then halves of 4, 2, 1."""
    if len(parts) == 1:
        parts = _split(builder, parts[0], 2)
    v = builder.fadd(builder.fadd(parts[0], parts[1]), side)
    while v.type.count > 1:
        lo, hi = _split(builder, v, 2)
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _loop(builder, count, inits):
    """Open a counted loop ``for i in range(count)`` (``count >= 1``, i64) whose body updates the
    values ``inits``; returns ``(i, phis, close)``, ``close(new_values)`` ends the body and leaves
    the builder after the loop, where ``new_values`` hold the final values."""
    entry = builder.block
    body = builder.append_basic_block("body")
    after = builder.append_basic_block("after")
    builder.branch(body)
    builder.position_at_end(body)
    i = builder.phi(_I64)
    i.add_incoming(ir.Constant(_I64, 0), entry)
    phis = []
    for v in inits:
        phi = builder.phi(v.type)
        phi.add_incoming(v, entry)
        phis.append(phi)

    def close(new_values):
        i_next = builder.add(i, ir.Constant(_I64, 1))
        tail = builder.block
        i.add_incoming(i_next, tail)
        for phi, v in zip(phis, new_values):
            phi.add_incoming(v, tail)
        builder.cbranch(builder.icmp_signed("<", i_next, count), body, after)
        builder.position_at_end(after)

    return i, phis, close


def _dot_codegen(isa, bits, group, has_mins, context, builder, sig, args):
    """IR of ``_row_dots``: weight row ``j`` against activation rows ``r0 .. r0+group-1``."""
    codes_t, scales_t, mins_t, _, xq_t, dx_t, sx_t, _, out_t = sig.args
    codes, scales, mins, j, xq, dx, sx, r0, out = args
    wide = isa == "avx512vnni"
    width = 16 if wide else 8
    parts = _LANES // width
    vf, v8f = _vec(_F32, width), _vec(_F32, 8)
    fma, fma8 = (_fn(builder, f"llvm.fma.v{n}f32", _vec(_F32, n), [_vec(_F32, n)] * 3) for n in (width, 8))
    i64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
    j, r0 = (builder.sext(v, _I64) if v.type.width < 64 else v for v in (j, r0))

    def rows_of(array_t, array, elem):
        return [_row_ptr(context, builder, array_t, array, builder.add(r0, i64(g)), elem) for g in range(group)]

    wrow = _row_ptr(context, builder, codes_t, codes, j, _I8)
    srow = _row_ptr(context, builder, scales_t, scales, j, ir.HalfType())
    mrow = _row_ptr(context, builder, mins_t, mins, j, ir.HalfType()) if has_mins else srow
    xrows, drows, sxrows, orows = (rows_of(xq_t, xq, _I8), rows_of(dx_t, dx, _F32), rows_of(sx_t, sx, _F32),
                                   rows_of(out_t, out, _F32))
    n_blocks = cgutils.unpack_tuple(builder, context.make_array(scales_t)(context, builder, scales).shape, 2)[1]
    alternate = ir.Constant(_vec(_I32, width), [0, 1] * (width // 2))  # even lanes block 2c, odd 2c + 1

    # Chunks: the integer lanes, scaled per block, into ``parts`` accumulators per row.
    c, accs, close = _loop(builder, builder.sdiv(n_blocks, i64(2)), [ir.Constant(vf, None)] * (group * parts))
    two = builder.mul(c, i64(2))
    s2 = builder.fpext(_load(builder, srow, two, _vec(ir.HalfType(), 2)), _vec(_F32, 2))
    s_lanes = builder.shuffle_vector(s2, s2, alternate)
    w_bytes = _weight_chunk(builder, wide, bits, wrow, c)
    x_at = builder.mul(c, i64(CHUNK))
    new_accs = []
    for g in range(group):
        if wide:
            x_bytes = [_load(builder, xrows[g], x_at, _vec(_I8, 64))]
        else:
            x_bytes = [_load(builder, xrows[g], builder.add(x_at, i64(h * 32)), _vec(_I8, 32)) for h in range(2)]
        d2 = _load(builder, drows[g], two, _vec(_F32, 2))
        scale = builder.fmul(s_lanes, builder.shuffle_vector(d2, d2, alternate))
        for p, lanes in enumerate(_lanes(builder, isa, bits, w_bytes, x_bytes)):
            new_accs.append(builder.call(fma, [builder.sitofp(lanes, vf), scale, accs[g * parts + p]]))
    close(new_accs)

    # Min terms, 8 blocks a step; the last step masks the blocks past the row.
    masked_load = _fn(builder, "llvm.masked.load.v8f16.p0", _vec(ir.HalfType(), 8),
                      [ir.HalfType().as_pointer(), _I32, _vec(ir.IntType(1), 8), _vec(ir.HalfType(), 8)])
    steps = builder.sdiv(builder.add(n_blocks, i64(7)), i64(8))
    k, sides, close = _loop(builder, steps, [ir.Constant(v8f, None)] * group)
    b0 = builder.mul(k, i64(8))
    mask = builder.icmp_signed("<", builder.add(_splat_value(builder, b0, 8), ir.Constant(_vec(_I64, 8), list(range(8)))),
                               _splat_value(builder, n_blocks, 8))
    m8 = builder.fpext(builder.call(masked_load, [builder.gep(mrow, [b0]), ir.Constant(_I32, 2), mask,
                                                  ir.Constant(_vec(ir.HalfType(), 8), None)]), v8f)
    if not has_mins:
        m8 = builder.fmul(m8, ir.Constant(v8f, [ir.Constant(_F32, -float(ZERO_POINT[bits]))] * 8))
    new_sides = [builder.call(fma8, [m8, _load(builder, sxrows[g], b0, v8f), sides[g]]) for g in range(group)]
    close(new_sides)

    for g in range(group):
        total = _tree_sum(builder, new_accs[g * parts:(g + 1) * parts], new_sides[g])
        builder.store(total, builder.gep(orows[g], [j]))
    return context.get_dummy_value()


def _literal(t, what):
    if not isinstance(t, (types.IntegerLiteral, types.BooleanLiteral)):
        raise numba.core.errors.TypingError(f"{what} must be a compile-time constant")
    return t.literal_value


@intrinsic
def _row_dots(typingctx, isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out):  # pragma: no cover
    """``_row_dots(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out)``
    writes ``out[r0 + g, j]`` for ``g < group`` (the module docstring's arithmetic) on the vector
    path ``ISAS[isa]``; the first four are compile-time constants, ``mins`` is read only when
    ``has_mins``."""
    consts = (ISAS[_literal(isa, "isa")], _literal(bits, "bits"), _literal(group, "group"),
              bool(_literal(has_mins, "has_mins")))
    sig = types.void(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out)

    def codegen(context, builder, signature, args):
        inner = signature.replace(args=signature.args[4:])
        return _dot_codegen(*consts, context, builder, inner, args[4:])

    return sig, codegen


# --- the portable path ----------------------------------------------------------------------------

@intrinsic
def _fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` rounded once (``llvm.fma.f32``), as the vector paths' fused multiply-adds."""

    def codegen(context, builder, sig, args):
        f = _fn(builder, "llvm.fma.f32", _F32, [_F32] * 3)
        return builder.call(f, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f16(typingctx, bits):  # pragma: no cover - compiled
    """The float16 whose bits are the uint16 ``bits``, as float32 (exact)."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)

    return types.float32(types.uint16), codegen


@numba.njit(inline="always")
def _portable_row(codes, scales, mins, j, xq, dx, sx, r, bits, has_mins):  # pragma: no cover - compiled
    """The module's arithmetic for one weight row and one activation row, lane by lane."""
    acc = np.zeros(_LANES, dtype=np.float32)
    nb = scales.shape[1]
    for c in range(nb // 2):
        for lane in range(_LANES):
            b = 2 * c + lane % 2
            total = 0
            for t in range(4):
                p = 4 * lane + t
                if bits == 8:
                    code = codes[j, CHUNK * c + p]
                else:
                    byte = codes[j, CHUNK // 2 * c + p % 32]
                    code = byte & 0x0F if p < 32 else byte >> 4
                total += np.int32(code) * np.int32(xq[r, CHUNK * c + p])
            acc[lane] = _fma(np.float32(total), _f16(scales[j, b]) * dx[r, b], acc[lane])
    side = np.zeros(8, dtype=np.float32)
    zero = np.float32(-8.0 if bits == 4 else -128.0)
    for b in range(nb):
        m = _f16(mins[j, b]) if has_mins else zero * _f16(scales[j, b])
        side[b % 8] = _fma(m, sx[r, b], side[b % 8])
    for lane in range(8):
        acc[lane] = (acc[lane] + acc[lane + 8]) + side[lane]
    width = 4
    while width >= 1:
        for lane in range(width):
            acc[lane] = acc[lane] + acc[lane + width]
        width //= 2
    return acc[0]


# --- the kernels ----------------------------------------------------------------------------------

def _row_group(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out):
    """Weight row ``j`` against activation rows ``r0 .. r0+group-1`` (compiled: ``_row_group_impl``)."""


@overload(_row_group, inline="always")
def _row_group_impl(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out):
    """The portable path row by row, the vector paths through ``_row_dots``; chosen while typing
    (the four leading arguments are constants), so a host compiles only the path it runs."""
    if ISAS[_literal(isa, "isa")] != "portable":
        def vector(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out):  # pragma: no cover
            _row_dots(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out)

        return vector

    def portable(isa, bits, has_mins, group, codes, scales, mins, j, xq, dx, sx, r0, out):  # pragma: no cover
        for r in range(r0, r0 + group):
            out[r, j] = _portable_row(codes, scales, mins, j, xq, dx, sx, r, bits, has_mins)

    return portable


@numba.njit(inline="always")
def product(isa, bits, has_mins, codes, scales, mins, xq, dx, sx, out):  # pragma: no cover - compiled
    """``out[r, j]`` for every activation row ``r`` and weight row ``j``, weight rows over the
    threads (a ``prange``: call it from a ``parallel=True`` function with constant ``isa``,
    ``bits``, ``has_mins``), activation rows in groups of 8, 4, 2, 1 (one weight row read a group).
    ``codes, scales, mins`` are ``operands(w)``; ``xq, dx, sx`` ``quantize_two_levels``'."""
    m = xq.shape[0]
    for j in numba.prange(codes.shape[0]):
        r = 0
        while r < m:
            rem = m - r
            if rem >= 8:
                _row_group(isa, bits, has_mins, 8, codes, scales, mins, j, xq, dx, sx, r, out)
                r += 8
            elif rem >= 4:
                _row_group(isa, bits, has_mins, 4, codes, scales, mins, j, xq, dx, sx, r, out)
                r += 4
            elif rem >= 2:
                _row_group(isa, bits, has_mins, 2, codes, scales, mins, j, xq, dx, sx, r, out)
                r += 2
            else:
                _row_group(isa, bits, has_mins, 1, codes, scales, mins, j, xq, dx, sx, r, out)
                r += 1


@numba.njit(parallel=True, cache=True, nogil=True)
def _matmul(codes, scales, mins, xq, dx, sx, out, isa, bits, has_mins):  # pragma: no cover - compiled
    numba.literally(isa)
    numba.literally(bits)
    numba.literally(has_mins)
    product(isa, bits, has_mins, codes, scales, mins, xq, dx, sx, out)


@functools.cache
def _matmul_of(fmt: Format):
    """``_matmul`` with ``fmt`` bound: a call from Python cannot pass constants (numba would
    retype the call every time), a compiled caller can (``_matmul`` itself is cached on disk)."""
    isa, bits, has_mins = fmt

    @numba.njit(nogil=True)
    def matmul(codes, scales, mins, xq, dx, sx, out):  # pragma: no cover - compiled
        _matmul(codes, scales, mins, xq, dx, sx, out, isa, bits, has_mins)

    return matmul


_NO_MINS = np.zeros((0, 2), dtype=np.uint16)


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


def qlinear(x: np.ndarray, w: QuantWeight, isa: str | None = None) -> np.ndarray:
    """``x @ w.T`` on integer dot products.

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
    xq, dx, sx = quantize_two_levels(np.ascontiguousarray(x, dtype=np.float32), w.padded_in_features)
    out = np.empty((xq.shape[0], w.shape[0]), dtype=np.float32)
    with skinny_gemm.KERNEL_LOCK:
        _matmul_of(fmt)(*operands(w), xq, dx, sx, out)
    return combine(out)


_DEFAULT_ISA = select_isa()
