"""The cpu backend's float32 product for a few rows: ``x @ w.T`` with ``x`` ``[M, K]``, ``M <= MAX_ROWS``.

Decode (M = 1), a DFlash verify pass of up to 8 rows (a block of 16's longer passes run BLAS:
``MAX_ROWS``) and a small batched decode step are "skinny" products: the weight matrix is read
once and each of its rows meets only M activation rows. On a 2-core machine OpenBLAS runs them
below what the memory allows (M = 1 as a GEMV; M = 2..8 as a GEMM that packs both operands). This
kernel streams each weight row once, prefetching a few rows ahead, and takes its dot products with
up to 8 activation rows at a time, the rows held in cache, the output columns split over the
cores, so that a verify pass of 2-4 positions costs little more than one decode (figures:
docs/benchmarks.md, "`benchmarks/skinny_gemm.py`").
It serves the float32 reference path; quantized weights run ``qgemm``.

The kernel is compiled by numba and cached on disk; a float32 model's load runs it once
(``flm_runtime.api.load_model``'s warm-up step), so that the compilation (seconds on a fresh
install, then a load from the cache) is not counted in the first request's decode time. Summation order differs from
BLAS: results agree to float32 rounding, not bit for bit.

Thread safety: every call holds ``lock.KERNEL_LOCK``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from flm_runtime.kernels.lock import KERNEL_LOCK

# Above 8 rows the kernel reads each weight row once more per 8 rows, and OpenBLAS's GEMM, whose
# cost hardly grows with rows there, is as fast.
MAX_ROWS = 8

# Weight rows ahead of the one being multiplied whose cache lines a thread prefetches: the
# hardware prefetcher alone leaves the multi-row loops, which spend more instructions per cache
# line, short of the memory's speed (4 ahead measured best of 2, 4 and 8).
PREFETCH_ROWS = 4
_CACHE_LINE_FLOATS = 16  # 64-byte lines

_FASTMATH = {"reassoc", "contract"}


@intrinsic
def _prefetch(typingctx, a, row, col):  # pragma: no cover - compiled
    """Prefetch the cache line holding ``a[row, col]`` (LLVM's ``llvm.prefetch``: a read, kept in
    all cache levels); a hint that never faults, so ``a[row, col]`` must only be in bounds."""

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array = context.make_array(array_type)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array_type, array, [args[1], args[2]], wraparound=False)
        i8_ptr, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8_ptr, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        read, keep_everywhere, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
        builder.call(fn, [builder.bitcast(ptr, i8_ptr), read, keep_everywhere, data])
        return context.get_dummy_value()

    return types.void(a, row, col), codegen


# One weight row against a group of 8, 4, 3, 2 or 1 activation rows starting at row ``r``: the
# group's dot products run in ONE loop along K, one accumulator per activation row, so that each
# weight element is loaded once and LLVM vectorizes every dot product along K (``reassoc``) with
# fused multiply-adds (``contract``). One function per group size, because numba keeps
# accumulators in registers only when their number is fixed in the code. NaN and inf propagate as
# in IEEE arithmetic (no ``nnan``/``ninf`` flags).
@numba.njit(fastmath=_FASTMATH, inline="always")
def _dot8(x, w, j, r, out):  # pragma: no cover - compiled
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(x.shape[1]):
        u = w[j, i]
        a0 += x[r, i] * u; a1 += x[r + 1, i] * u; a2 += x[r + 2, i] * u; a3 += x[r + 3, i] * u
        a4 += x[r + 4, i] * u; a5 += x[r + 5, i] * u; a6 += x[r + 6, i] * u; a7 += x[r + 7, i] * u
    out[r, j] = a0; out[r + 1, j] = a1; out[r + 2, j] = a2; out[r + 3, j] = a3
    out[r + 4, j] = a4; out[r + 5, j] = a5; out[r + 6, j] = a6; out[r + 7, j] = a7


@numba.njit(fastmath=_FASTMATH, inline="always")
def _dot4(x, w, j, r, out):  # pragma: no cover - compiled
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(x.shape[1]):
        u = w[j, i]
        a0 += x[r, i] * u; a1 += x[r + 1, i] * u; a2 += x[r + 2, i] * u; a3 += x[r + 3, i] * u
    out[r, j] = a0; out[r + 1, j] = a1; out[r + 2, j] = a2; out[r + 3, j] = a3


@numba.njit(fastmath=_FASTMATH, inline="always")
def _dot3(x, w, j, r, out):  # pragma: no cover - compiled
    a0 = a1 = a2 = np.float32(0.0)
    for i in range(x.shape[1]):
        u = w[j, i]
        a0 += x[r, i] * u; a1 += x[r + 1, i] * u; a2 += x[r + 2, i] * u
    out[r, j] = a0; out[r + 1, j] = a1; out[r + 2, j] = a2


@numba.njit(fastmath=_FASTMATH, inline="always")
def _dot2(x, w, j, r, out):  # pragma: no cover - compiled
    a0 = a1 = np.float32(0.0)
    for i in range(x.shape[1]):
        u = w[j, i]
        a0 += x[r, i] * u; a1 += x[r + 1, i] * u
    out[r, j] = a0; out[r + 1, j] = a1


@numba.njit(fastmath=_FASTMATH, inline="always")
def _dot1(x, w, j, r, out):  # pragma: no cover - compiled
    a0 = np.float32(0.0)
    for i in range(x.shape[1]):
        a0 += x[r, i] * w[j, i]
    out[r, j] = a0


@numba.njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _skinny_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = x @ w.T``; ``x`` ``[M, K]``, ``w`` ``[N, K]``, ``out`` ``[M, N]``, C-contiguous float32.

    Output columns (weight rows) are split over the threads; a thread prefetches the weight row
    ``PREFETCH_ROWS`` ahead of the one it multiplies. Each weight row meets the activation rows in
    groups of exactly 8, then 4, 3, 2 or 1 (5 rows: 4 + 1): a group computes only real rows (padded
    groups measured slower), and a weight row read for the first group is in L1 for the next.
    """
    m = x.shape[0]
    n, k = w.shape
    for j in numba.prange(n):
        if j + PREFETCH_ROWS < n:
            for i in range(0, k, _CACHE_LINE_FLOATS):
                _prefetch(w, j + PREFETCH_ROWS, i)
        r = 0
        while r < m:
            rem = m - r
            if rem >= 8:
                _dot8(x, w, j, r, out); r += 8
            elif rem >= 4:
                _dot4(x, w, j, r, out); r += 4
            elif rem == 3:
                _dot3(x, w, j, r, out); r += 3
            elif rem == 2:
                _dot2(x, w, j, r, out); r += 2
            else:
                _dot1(x, w, j, r, out); r += 1


def skinny_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a few rows.

    Args:
        x: ``[M, K]`` float32, ``1 <= M <= MAX_ROWS``; copied if not C-contiguous.
        w: ``[N, K]`` float32 C-contiguous (a weight in Hugging Face layout).
    Returns:
        ``[M, N]`` float32, C-contiguous.
    """
    assert 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1], f"shapes {x.shape} @ {w.shape}.T"
    assert x.dtype == w.dtype == np.float32 and w.flags.c_contiguous, "float32 operands, C-contiguous weight"
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    with KERNEL_LOCK:
        _skinny_matmul(np.ascontiguousarray(x), w, out)
    return out

