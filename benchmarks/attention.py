"""The attention kernel (``fused.attend``, keys in tiles) against numpy's ``cpu.attention`` (the
float32 reference, batched BLAS products over row-major keys), interleaved in one run.

One layer of SmolLM2-135M's geometry (9 query heads, 3 key-value heads, head dim 64) over random
keys and values, ``T`` query rows appended at each context: T = 1 is a decode step, T = 8 a DFlash
verify pass. Each figure is the median over rounds of a best-of-``--repeat`` time in
microseconds; the two implementations alternate within every round, so that machine noise hits
both. The kernel runs on numba's threads (``NUMBA_NUM_THREADS``), numpy on OpenBLAS's.

    python benchmarks/attention.py [--contexts 256,4096] [--rows 1,8] [--rounds 5] [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flm_runtime.backends import cpu, fused
from flm_runtime.core import KVCache

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


def measure(context: int, rows: int, rounds: int, repeat: int) -> tuple[float, float]:
    """Median microseconds of the kernel and of numpy for ``rows`` queries at ``context``."""
    rng = np.random.default_rng(context + rows)
    k, v = (rng.standard_normal((KV_HEADS, context, HEAD_DIM)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((rows, HEADS, HEAD_DIM)).astype(np.float32)
    cache = KVCache(1, KV_HEADS, HEAD_DIM, max_length=context)
    cache.reserve(context)
    cache.write(0, k, v)
    cache.commit(context)
    out = np.empty((rows, HEADS * HEAD_DIM), dtype=np.float32)
    start = context - rows
    kernel = lambda: fused.attend(q, cache.k[0], cache.v[0], start, True, out)  # noqa: E731
    reference = lambda: cpu.attention(q, k, v, start)  # noqa: E731
    kernel()
    np.testing.assert_allclose(out, reference(), rtol=0, atol=1e-5)  # the same attention
    times = [(best_of(kernel, repeat), best_of(reference, repeat)) for _ in range(rounds)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,4096")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    print("| context | rows | kernel (us) | numpy (us) | numpy / kernel |\n|---:|---:|---:|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            kernel, numpy_ = measure(context, rows, args.rounds, args.repeat)
            print(f"| {context} | {rows} | {kernel:.1f} | {numpy_:.1f} | {numpy_ / kernel:.2f} |")


if __name__ == "__main__":
    main()
