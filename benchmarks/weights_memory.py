"""Resident memory a model's weights add, per weight kind: each kind loaded in a fresh child
process by ``flm_runtime.api.load_model`` (files, tokenizer, model, the heap's free pages handed
back), RSS read from /proc before and after, next to the bytes of the arrays the model holds.
The model is loaded once before the first reading (compiled kernels, imports), then again.

    python benchmarks/weights_memory.py [--tag smollm2:135m] [--kinds auto,q8,q4,f32]

Prints a markdown table: MB added, bytes per parameter, and the bytes of the matrices and
vectors themselves (``CausalLM.nbytes``-style sum over every array the model holds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import gc, json, sys
import numpy as np
from flm_runtime import api

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

import os
os.environ["FLM_WEIGHTS"] = sys.argv[2]
api.load_model(sys.argv[1])  # the kernels compiled or loaded from numba's cache, the file in the page cache
gc.collect()
api._return_free_memory()  # that model's pages back to the system before the reading
before = rss()
model = api.load_model(sys.argv[1]).model
gc.collect()
after = rss()
arrays = [a for layer in model.layers for a in vars(layer).values() if a is not None]
arrays += [model.embed, model.norm, model.rope_cos, model.rope_sin]
if model.lm_head is not model.embed:
    arrays.append(model.lm_head)
c = model.config
params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size + c.num_hidden_layers * (
    2 * c.hidden_size + c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
print(json.dumps({"added": after - before, "held": sum(a.nbytes for a in arrays), "params": params}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--kinds", default="auto,q8,q4,f32", help="weight kinds, comma-separated")
    args = parser.parse_args(argv)
    print("| weights | RSS added (MB) | bytes / parameter | arrays held (MB) | arrays / parameter |\n"
          "|---|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        out = subprocess.run([sys.executable, "-c", _CHILD, args.tag, kind], capture_output=True, text=True,
                             check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {kind} | {r['added'] / 1e6:.1f} | {r['added'] / r['params']:.3f} | {r['held'] / 1e6:.1f} "
              f"| {r['held'] / r['params']:.3f} |")


if __name__ == "__main__":
    main()
