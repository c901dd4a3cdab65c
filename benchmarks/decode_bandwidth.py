"""1-token decode speed against the memory-bandwidth bound, both measured in this run.

A decode step of a small model is memory-bound: it streams every weight once (``bytes_per_token``,
~538 MB for SmolLM2-135M in float32, plus the KV cache it attends over). The bound is
``read_bandwidth / bytes_per_token`` tokens/s, where ``read_bandwidth`` is the best rate at which
this process streams a 1 GiB float32 matrix through the same 1-row product the model uses (the
skinny kernel, ``cpu.linear``) and through a plain numpy reduction (the larger counts). Rounds alternate the bandwidth probe
and the decode measurement so that machine noise hits both; medians are reported.

    python benchmarks/decode_bandwidth.py [--tag smollm2:135m] [--tokens 64] [--rounds 5]

On machines that set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (older-CPU workarounds that slow a
current numpy), say so when you quote a figure measured with them unset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from flm_runtime.api import load_model
from flm_runtime.backends import decode, prefill
from flm_runtime.kernels import cpu

PROBE_BYTES = 1 << 30


def read_bandwidth(matrix: np.ndarray, vector: np.ndarray) -> float:
    """Bytes/s streamed by one 1-row product (as a decode step runs it) and one numpy sum over
    ``matrix`` (the better of the two)."""
    t0 = time.perf_counter()
    with cpu.forward_pass(1):
        cpu.linear(vector[None], matrix)
    t1 = time.perf_counter()
    matrix.sum(dtype=np.float32)
    t2 = time.perf_counter()
    return matrix.nbytes / min(t1 - t0, t2 - t1)


def decode_rate(loaded, prompt_ids: list[int], n_tokens: int) -> float:
    """Greedy 1-token decode tokens/s after prefilling ``prompt_ids`` (prefill not timed)."""
    model = loaded.model
    cache = model.new_cache(len(prompt_ids) + n_tokens)
    token = int(np.argmax(prefill(model, np.array(prompt_ids), cache).logits))
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        token = int(np.argmax(decode(model, token, cache).logits))
    return n_tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    loaded = load_model(args.tag)
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the ocean."}]))
    bytes_per_token = loaded.model.nbytes_per_token
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((PROBE_BYTES // 4 // 4096, 4096), dtype=np.float32)
    vector = rng.standard_normal(4096, dtype=np.float32)

    bandwidths, rates = [], []
    for _ in range(args.rounds):
        bandwidths.append(read_bandwidth(matrix, vector))
        rates.append(decode_rate(loaded, prompt, args.tokens))
    bw, rate = statistics.median(bandwidths), statistics.median(rates)
    bound = bw / bytes_per_token
    unset = [v for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if v not in os.environ]
    print(f"model {args.tag}: {bytes_per_token / 1e6:.1f} MB of weights read per decoded token")
    print(f"read bandwidth (median of {args.rounds}): {bw / 1e9:.2f} GB/s -> bound {bound:.1f} tokens/s")
    print(f"1-token decode (median of {args.rounds} x {args.tokens} tokens): {rate:.1f} tokens/s")
    print(f"decode / bound = {rate / bound:.2f}")
    print(f"OPENBLAS_CORETYPE/L2_SIZE unset in this run: {', '.join(unset) or 'neither'}")


if __name__ == "__main__":
    main()
