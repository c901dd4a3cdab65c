"""A target's verify curve on this host, as the DFlash engine measures it at its first start:
``t_verify(n+1) / t_decode`` for ``n = 1 .. --drafted`` (``speculation.costs.measure_verify_ratio``:
interleaved rounds of a one-row pass and passes of 2 .. n + 1 rows, every row's logits, each
rolled back from a cache of ``--contexts`` random tokens; medians), from the main thread.

    python benchmarks/verify_curve.py [--tag qwen2.5-coder:1.5b] [--contexts 256,4096] [--rounds 5]

Prints one line per context: the one-row pass in ms, then the curve in decodes for 2 .. n + 1 rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flm_bench import report
from flm_runtime.api import load_model
from flm_runtime.backends import forward
from flm_runtime.speculation import costs


def decode_ms(model, context: int, rounds: int) -> float:
    """Median milliseconds of a one-row pass at ``context`` (its own cache, random tokens)."""
    rng = np.random.default_rng(1)
    cache = model.new_cache(context + 1)
    forward(model, rng.integers(0, model.config.vocab_size, context), cache)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        forward(model, rng.integers(0, model.config.vocab_size, 1), cache)
        times.append(time.perf_counter() - t0)
        cache.trim(context)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="qwen2.5-coder:1.5b")
    parser.add_argument("--contexts", default="256")
    parser.add_argument("--drafted", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=costs.ROUNDS)
    args = parser.parse_args()
    model = load_model(args.tag).model
    for context in (int(c) for c in args.contexts.split(",")):
        curve = costs.measure_verify_ratio(model, (), args.drafted, context=context, rounds=args.rounds)
        print(f"{args.tag} context {context}: decode {decode_ms(model, context, args.rounds):.1f} ms; "
              f"rows 2..{args.drafted + 1} in decodes: {' '.join(f'{r:.2f}' for r in curve)}", flush=True)
    print(report.run_conditions())


if __name__ == "__main__":
    main()
