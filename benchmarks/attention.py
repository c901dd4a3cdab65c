"""The attention kernel (``attention.attend``, keys in tiles) against numpy's ``cpu.attention`` (the
float32 reference, batched BLAS products over row-major keys), interleaved in one run.

One layer of SmolLM2-135M's geometry (9 query heads, 3 key-value heads, head dim 64) over random
keys and values, ``T`` query rows appended at each context: T = 1 is a decode step, T = 8 a DFlash
verify pass. The kernel runs over a float32 cache (the float32 reference model's) and a float16
one (a quantized model's). Each figure is the median over rounds of a best-of-``--repeat`` time
in microseconds; the three alternate within every round, so that machine noise hits all. The kernel runs on numba's threads (``NUMBA_NUM_THREADS``), numpy on OpenBLAS's.

    python benchmarks/attention.py [--contexts 256,4096] [--rows 1,8] [--rounds 5] [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flm_runtime.kv_cache import KVCache
from flm_runtime.kernels import attention, cpu

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def best_of(fn, repeat: int) -> float:
    """The fastest of ``repeat`` calls of ``fn``, in microseconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(context: int, rows: int, rounds: int, repeat: int) -> tuple[float, float, float]:
    """Median microseconds of the kernel over a float32 and a float16 cache, and of numpy, for
    ``rows`` queries at ``context``."""
    rng = np.random.default_rng(context + rows)
    k, v = (rng.standard_normal((KV_HEADS, context, HEAD_DIM)).astype(np.float16).astype(np.float32)
            for _ in range(2))  # values a float16 cache holds exactly
    q = rng.standard_normal((rows, HEADS, HEAD_DIM)).astype(np.float32)
    start = context - rows
    fns, scale = [], np.float32(HEAD_DIM ** -0.5)
    for dtype in (np.float32, np.float16):
        cache = KVCache.private(1, KV_HEADS, HEAD_DIM, max_length=context, dtype=dtype)
        cache.reserve(context)
        cache.write(0, k, v)
        cache.commit(context)
        out = np.empty((rows, HEADS * HEAD_DIM), dtype=np.float32)
        fns.append(lambda out=out, cache=cache: attention.attend(q, *attention.cache_arrays(cache, 0), start, True, 0,
                                                                 scale, out) or out)
    fns.append(lambda: cpu.attention(q, k, v, start))
    for fn in fns[:2]:
        np.testing.assert_allclose(fn(), fns[2](), rtol=0, atol=1e-5)  # the same attention
    times = [[best_of(fn, repeat) for fn in fns] for _ in range(rounds)]
    return tuple(statistics.median(t[i] for t in times) for i in range(3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,4096")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    print("| context | rows | kernel, float32 cache (us) | kernel, float16 cache (us) | numpy (us) "
          "| numpy / kernel float32 | numpy / kernel float16 |\n|---:|---:|---:|---:|---:|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            f32, f16, numpy_ = measure(context, rows, args.rounds, args.repeat)
            print(f"| {context} | {rows} | {f32:.1f} | {f16:.1f} | {numpy_:.1f} | {numpy_ / f32:.2f} | {numpy_ / f16:.2f} |")


if __name__ == "__main__":
    main()
