"""The cpu backend's product for a few rows: ``x @ w.T`` with ``x`` ``[M, K]``, ``M <= MAX_ROWS``.

Decode (M = 1), a DFlash verify pass (M = K + 1 <= 8) and a small batched decode step are
"skinny" products: the weight matrix is read once and each of its rows meets only M activation
rows. On our 2-core machine OpenBLAS runs them below what the memory allows (M = 1 as a GEMV;
M = 2..8 as a GEMM that packs both operands: 2 rows cost 2.8x one row). This kernel streams each
weight row once and takes its dot products with up to 8 activation rows at a time, the rows held
in cache, the output columns split over the cores. All of SmolLM2-135M's products (30 layers and
the LM head), medians of 3 rounds, ``python benchmarks/skinny_gemm.py`` (quiet machine):

    rows    1      2      4      8
    BLAS    26.2   74.0   60.0   62.8 ms
    here    19.4   20.3   21.7   39.0 ms

so a verify pass of 2-4 positions costs about what one decode costs, which is what could make
drafting short blocks pay on a CPU (docs/dflash.md, "Cost on the cpu backend").

The kernel is compiled by numba and cached on disk: ``compile_kernel`` runs when a model loads
(``flm_runtime.api.load_model``), so that the compilation (seconds on a fresh install, then a load
from the cache) is not counted in the first request's decode time. Summation order differs from
BLAS: results agree to float32 rounding, not bit for bit.

Thread safety: numba's default thread pool (its "workqueue" layer) aborts the process when two
threads enter a parallel kernel at once, and two engines (two loaded models) run in two threads.
Every call therefore holds one process-wide lock; on 2 cores the calls would only contend anyway.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

# Above 8 rows the kernel reads each weight row once more per 8 rows, and OpenBLAS's GEMM, whose
# cost hardly grows with rows here (60-63 ms from 4 to 8 rows), is as fast.
MAX_ROWS = 8

_LOCK = threading.Lock()


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _skinny_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = x @ w.T``; ``x`` ``[M, K]``, ``w`` ``[N, K]``, ``out`` ``[M, N]``, C-contiguous float32.

    Output columns (weight rows) are split over the threads. Each weight row meets the activation
    rows 8 at a time; the rest (1-7 rows) in ONE more group of 8, 4 or 1, its indices past the end
    clamped to the last row (computed twice, written twice: the same value), so that every weight
    row is read from memory once for M <= 8 and twice at most up to 16. ``reassoc`` lets LLVM
    vectorize each dot product along K, ``contract`` fuses multiply-adds; NaN and inf propagate as
    in IEEE arithmetic (no ``nnan``/``ninf`` flags).
    """
    m, k = x.shape
    n = w.shape[0]
    last = m - 1
    zero = np.float32(0.0)
    for j in numba.prange(n):
        r = 0
        while r < m:
            if m - r > 4:
                r1 = min(r + 1, last); r2 = min(r + 2, last); r3 = min(r + 3, last)
                r4 = min(r + 4, last); r5 = min(r + 5, last); r6 = min(r + 6, last); r7 = min(r + 7, last)
                a0 = zero; a1 = zero; a2 = zero; a3 = zero; a4 = zero; a5 = zero; a6 = zero; a7 = zero
                for i in range(k):
                    wv = w[j, i]
                    a0 += x[r, i] * wv; a1 += x[r1, i] * wv; a2 += x[r2, i] * wv; a3 += x[r3, i] * wv
                    a4 += x[r4, i] * wv; a5 += x[r5, i] * wv; a6 += x[r6, i] * wv; a7 += x[r7, i] * wv
                out[r, j] = a0; out[r1, j] = a1; out[r2, j] = a2; out[r3, j] = a3
                out[r4, j] = a4; out[r5, j] = a5; out[r6, j] = a6; out[r7, j] = a7
                r += 8
            elif m - r > 1:
                r1 = min(r + 1, last); r2 = min(r + 2, last); r3 = min(r + 3, last)
                a0 = zero; a1 = zero; a2 = zero; a3 = zero
                for i in range(k):
                    wv = w[j, i]
                    a0 += x[r, i] * wv; a1 += x[r1, i] * wv; a2 += x[r2, i] * wv; a3 += x[r3, i] * wv
                out[r, j] = a0; out[r1, j] = a1; out[r2, j] = a2; out[r3, j] = a3
                r += 4
            else:
                a0 = zero
                for i in range(k):
                    a0 += x[r, i] * w[j, i]
                out[r, j] = a0
                r += 1


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
    with _LOCK:
        _skinny_matmul(np.ascontiguousarray(x), w, out)
    return out


def compile_kernel() -> None:
    """Compile the kernel now, or load it from numba's disk cache (``skinny_linear`` on 1 x 8 zeros)."""
    skinny_linear(np.zeros((1, 8), dtype=np.float32), np.zeros((8, 8), dtype=np.float32))
