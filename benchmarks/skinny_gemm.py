"""The skinny product kernel against BLAS, on a real model's weights, measured in one run.

Two measurements per row count T (1 = decode, K + 1 = a DFlash verify pass of K drafts, B = a
batched decode step of B sequences):

- products: every weight matrix of the model (each layer's fused q/k/v, o, gate/up, down, and the
  LM head) times a ``[T, in]`` activation, as ``cpu.linear`` runs it;
- pass: one target forward of T positions after a ``--context``-token prompt (logits of every
  position, then rolled back): products, attention and everything else in between.

"kernel" is the cpu backend as shipped; "BLAS" is the same with ``cpu.SKINNY_ROWS = 0`` (every
product on OpenBLAS with its own threads, as before the kernel). Each (mode, round) runs in its own
process, modes alternating round after round, because two thread pools in one process disturb
each other: OpenBLAS's workers spin for up to ~0.1 s after a call. Medians over rounds of each
process's best-of-N.

    python benchmarks/skinny_gemm.py [--tag smollm2:135m] [--rows 1,2,3,4,8,16] [--rounds 3]

On machines that set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (older-CPU workarounds that slow a
current numpy), say so when you quote a figure measured with them unset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from flm_bench import report


def worker(tag: str, mode: str, rows: list[int], context: int, repeat: int) -> dict:
    """Seconds (best of ``repeat``) of all products and of one pass, per row count."""
    import numpy as np

    from flm_runtime.api import load_model
    from flm_runtime.backends import forward, prefill
    from flm_runtime.kernels import cpu

    model = load_model(tag).model
    cpu.SKINNY_ROWS = 0 if mode == "BLAS" else cpu.SKINNY_ROWS
    weights = [m for layer in model.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    weights.append(model.lm_head)
    rng = np.random.default_rng(0)
    cache = model.new_cache(context + max(rows))
    prefill(model, rng.integers(100, 1000, context), cache)
    start = cache.length
    out: dict[str, dict[int, float]] = {"products": {}, "pass": {}}
    for t in rows:
        xs = {n: rng.standard_normal((t, n)).astype(np.float32) for n in {w.shape[1] for w in weights}}

        def products():
            with cpu.forward_pass(t):
                for w in weights:
                    cpu.linear(xs[w.shape[1]], w)

        def one_pass():
            forward(model, rng.integers(100, 1000, t), cache, all_logits=True)
            cache.trim(start)

        for name, fn in (("products", products), ("pass", one_pass)):
            fn()  # warm up (the kernel compiles or loads from its cache on first use)
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name][t] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--rows", default="1,2,3,4,8,16", help="comma-separated row counts T")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before each pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5, help="timings per process (best is kept)")
    parser.add_argument("--worker", choices=["kernel", "BLAS"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print(json.dumps(worker(args.tag, args.worker, rows, args.context, args.repeat)))
        return

    runs: dict[str, list[dict]] = {"kernel": [], "BLAS": []}
    for r in range(args.rounds):
        for mode in runs:
            cmd = [sys.executable, __file__, "--worker", mode, "--tag", args.tag, "--rows", args.rows,
                   "--context", str(args.context), "--repeat", str(args.repeat)]
            runs[mode].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            print(f"round {r + 1}/{args.rounds}: {mode} done", file=sys.stderr)

    def med(mode: str, what: str, t: int) -> float:
        return statistics.median(run[what][str(t)] for run in runs[mode]) * 1e3

    print(f"model {args.tag}; pass at context {args.context}; medians of {args.rounds} rounds (ms)")
    print(f"rows | products: BLAS | kernel | BLAS/kernel | pass: BLAS | kernel | BLAS/kernel | kernel pass / {rows[0]}-row pass")
    for t in rows:
        pb, pk, fb, fk = med("BLAS", "products", t), med("kernel", "products", t), med("BLAS", "pass", t), med("kernel", "pass", t)
        print(f"{t:4d} | {pb:14.1f} | {pk:6.1f} | {pb / pk:11.2f} | {fb:10.1f} | {fk:6.1f} | {fb / fk:11.2f} | "
              f"{fk / med('kernel', 'pass', rows[0]):.2f}")
    print(report.run_conditions())


if __name__ == "__main__":
    main()
