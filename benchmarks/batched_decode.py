"""Continuous batching on the cpu backend: aggregate decode tokens/s of B concurrent sequences.

One ``CausalLM.forward_batch`` decode step of ``B`` rows (one token per sequence, each sequence with its
own cache at context ``--context``) is timed for every B of ``--batches``, rounds interleaved in
one run so that machine noise hits all alike; each step is then rolled back (``trim``). Aggregate
tokens/s is ``B / t_step``; the ratio to ``B = 1`` is what batching buys. Medians and minima are
reported: on a shared machine the fastest round is the least disturbed, so the ratio of minima
estimates the quiet-machine ratio.

Steps of up to ``cpu.SKINNY_ROWS`` rows run the skinny product kernel; ``benchmarks/skinny_gemm.py``
compares it with BLAS.

    python benchmarks/batched_decode.py [--tag smollm2:135m] [--batches 1,2,4,8] [--context 64]
        [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from flm_runtime.api import load_model
from flm_runtime.backends import prefill


def step_seconds(model, tokens: list[int], caches: list) -> float:
    """Seconds of one batched decode step, then rolled back."""
    lengths = [c.length for c in caches]
    t0 = time.perf_counter()
    model.forward_batch([[t] for t in tokens], caches)
    t = time.perf_counter() - t0
    for cache, n in zip(caches, lengths):
        cache.trim(n)
    return t


def measure(model, prompt: np.ndarray, batches: list[int], rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each ``B=<b>``, one per round."""
    caches = [model.new_cache(len(prompt) + 8) for _ in range(max(batches))]
    for cache in caches:
        logits = prefill(model, prompt, cache).logits
    tokens = [int(np.argmax(logits))] * max(batches)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for b in batches:
            times.setdefault(f"B={b}", []).append(step_seconds(model, tokens[:b], caches[:b]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--batches", default="1,2,4,8", help="comma-separated row counts B")
    parser.add_argument("--context", type=int, default=64, help="tokens in each sequence's cache")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    assert batches[0] == 1, "the first batch size must be 1 (the reference)"

    model = load_model(args.tag).model
    prompt = np.arange(args.context, dtype=np.int64) % model.config.vocab_size + 100
    times = measure(model, prompt, batches, args.rounds)
    print(f"model {args.tag}; context {args.context} tokens per sequence; {args.rounds} rounds, interleaved")
    print("batch |  stat  | step ms | tokens/s | x B=1")
    for stat, agg in (("median", statistics.median), ("min", min)):
        base = 1 / agg(times["B=1"])
        for name, ts in times.items():
            t = agg(ts)
            b = int(name[2:])
            print(f"{name:5s} | {stat:6s} | {t * 1e3:7.1f} | {b / t:8.1f} | {b / t / base:5.2f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
