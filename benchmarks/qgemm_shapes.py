"""The integer product (``kernels/qgemm.py``'s ``qlinear``) at a model's matrix shapes, this
tree's kernel against another version of ``qgemm.py``, interleaved in one process.

Per shape and row count, rounds alternate the two kernels (the order flipped every round) on the
same weights and activations; each reports the median and the minimum over rounds of milliseconds
per product (activation quantization included) and ``other / this`` of each (on a busy machine
the fastest round is the least disturbed one). The weights are random codes in the
format the model holds that matrix in (a Q4_K_M file: 4-bit with mins for Q4_K, 8-bit for Q6_K,
8-bit with mins for the fused QKV whose V is Q6_K); the time does not depend on their values.
Threads: numba's (``NUMBA_NUM_THREADS``, default one per CPU; on a machine busy with other
work, 1 gives steadier figures: two threads wait on the slower one at every product).

    python benchmarks/qgemm_shapes.py --against OLD_QGEMM_PY [--rows 1,8] [--rounds 15]

``OLD_QGEMM_PY``: e.g. ``git show main:runtime/flm_runtime/kernels/qgemm.py > /tmp/old/qgemm.py``
(it imports the rest of ``flm_runtime.kernels`` from this tree, so its interfaces must match).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from flm_bench import report
from flm_runtime.kernels import qgemm, quant

# qwen2.5-coder:1.5b (Q4_K_M): name, out, in, bits, stored mins
SHAPES = (("attn qkv (fused, V Q6_K)", 2048, 1536, 8, True), ("attn_output", 1536, 1536, 4, True),
          ("ffn_gate", 8960, 1536, 4, True), ("ffn_down (Q4_K)", 1536, 8960, 4, True),
          ("ffn_down (Q6_K)", 1536, 8960, 8, False), ("output head", 151936, 1536, 8, False))


def load_other(path: Path):
    """The ``qgemm.py`` at ``path`` as a module of its own."""
    spec = importlib.util.spec_from_file_location("qgemm_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's on-disk cache imports a function's module by name
    spec.loader.exec_module(module)
    return module


def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, mins: bool) -> quant.QuantWeight:
    codes = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-3, (n, k // quant.BLOCK)).astype(np.float32)
    return quant.from_blocks(codes, scales, -8 * scales if mins else None, bits, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", type=Path, required=True, help="another version of qgemm.py")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    kernels = {"this": qgemm, "other": load_other(args.against)}
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"path {qgemm.select_isa()}; other: {args.against}")
    print("| matrix | out x in | bits | rows | this ms (median / min) | other ms | other / this |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k, bits, mins in SHAPES:
        w = random_weight(rng, n, k, bits, mins)
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            times: dict[str, list[float]] = {"this": [], "other": []}
            for kernel in kernels.values():  # compile and warm up
                kernel.qlinear(x, w)
            for r in range(args.rounds):
                for label in (("this", "other") if r % 2 == 0 else ("other", "this")):
                    t0 = time.perf_counter()
                    kernels[label].qlinear(x, w)
                    times[label].append(time.perf_counter() - t0)
            (this, other), (this_min, other_min) = ([agg(times[label]) * 1e3 for label in ("this", "other")]
                                                    for agg in (statistics.median, min))
            print(f"| {name} | {n}x{k} | {bits}{' + mins' if mins else ''} | {m} | {this:.2f} / {this_min:.2f} | "
                  f"{other:.2f} / {other_min:.2f} | {other / this:.2f}x / {other_min / this_min:.2f}x |", flush=True)
    print(report.run_conditions())


if __name__ == "__main__":
    main()
