"""A GGUF's load, stage by stage: the process's peak and current resident set (``VmHWM``,
``VmRSS`` of /proc/self/status, bytes) and the seconds since it started, after each stage of what
``flm_runtime.api.load_model`` does, in this process (run it in a fresh one):

- ``imports``: the runtime imported;
- ``files``: ``load_model_files`` with the converted weights kept in ``KEEP`` (converted first
  when none are kept for the file: a first load);
- ``model``: the model built and the files' bundle dropped;
- ``step`` (``--step``): one forward step of one token with a pool of one KV block (the kernels
  compiled or loaded from numba's cache; every matrix read);
- ``pages``: a byte of every weight page read, the embedding's included (a served model's
  resident set once its whole vocabulary has been seen).

    python -m flm_bench.load_memory GGUF KEEP [--step]

Prints one JSON object a line, ``{"stage", "seconds", "peak", "steady"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

_START = time.monotonic()


def _resident() -> dict[str, int]:
    """``{"peak": VmHWM, "steady": VmRSS}`` of this process, bytes (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"peak": int(fields["VmHWM"].split()[0]) * 1024, "steady": int(fields["VmRSS"].split()[0]) * 1024}


def _report(stage: str) -> None:
    print(json.dumps({"stage": stage, "seconds": round(time.monotonic() - _START, 2), **_resident()}), flush=True)


def _read_every_weight_page(model) -> None:
    """Read a byte of every page of every weight array of ``model`` (a ``CausalLM``)."""
    from flm_runtime.kernels.quant import QuantWeight

    for w in [model.embed, model.lm_head, model.norm, *(a for layer in model.layers for a in vars(layer).values())]:
        for a in (w.codes, w.scales, w.mins) if isinstance(w, QuantWeight) else (w,):
            if a is not None:
                int(a.reshape(-1).view(np.uint8)[::4096].sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("keep", type=Path, help="the directory of converted weights")
    parser.add_argument("--step", action="store_true", help="run one forward step after the model is built")
    args = parser.parse_args(argv)
    # Imported here, so that the first stage's seconds count the imports.
    from flm_runtime.kv_cache import BLOCK_TOKENS
    from flm_runtime.loading import load_model_files
    from flm_runtime.models.causal_lm import CausalLM

    _report("imports")
    bundle = load_model_files(args.gguf, weights="auto", keep=args.keep)
    _report("files")
    model = CausalLM(bundle.config, bundle.weights)
    del bundle
    _report("model")
    if args.step:
        model.forward_batch([np.zeros(1, dtype=np.int64)], [model.new_cache(1, model.new_pool(BLOCK_TOKENS))])
        _report("step")
    _read_every_weight_page(model)
    _report("pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
