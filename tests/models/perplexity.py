"""Perplexity computed as llama.cpp's ``llama-perplexity`` computes it, for comparing with the
figures it prints (``tests/reference/llama_cpp.py`` records them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flm_runtime.backends import TargetModel, forward

DATA = Path(__file__).resolve().parents[1] / "data"
PASSAGE = DATA / "wizard_of_oz_ch1.txt"


def llama_cpp_fixture(name: str) -> dict:
    """A fixture ``tests/reference/llama_cpp.py perplexity`` wrote under tests/data."""
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def passage_as_llama_perplexity_reads_it() -> str:
    """The test passage without its one trailing newline (``llama-perplexity -f`` drops it)."""
    return PASSAGE.read_text(encoding="utf-8").removesuffix("\n")


def llama_perplexity(model: TargetModel, ids: list[int], n_ctx: int, bos: int | None) -> tuple[float, int]:
    """The figure ``llama-perplexity -c n_ctx`` prints for the tokens ``ids``, and its chunks.

    As ``perplexity()`` in llama.cpp's ``tools/perplexity/perplexity.cpp``: ``ids`` are cut into
    ``len(ids) // n_ctx`` chunks of ``n_ctx`` (the rest is not scored); each chunk runs alone from
    an empty cache, its first token replaced by ``bos`` (None: a model that adds no BOS keeps it);
    the logits at positions ``n_ctx/2 .. n_ctx-2`` score the tokens after them; exp(mean negative
    log-likelihood) over all scored tokens of all chunks, in float64.
    """
    first, n_chunks = n_ctx // 2, len(ids) // n_ctx
    nll, count = 0.0, 0
    for c in range(n_chunks):
        chunk = np.array(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logits = forward(model, chunk, model.new_cache(), all_logits=True).logits[first:n_ctx - 1]
        logits = logits.astype(np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll -= logprobs[np.arange(n_ctx - 1 - first), chunk[first + 1:]].sum()
        count += n_ctx - 1 - first
    return float(np.exp(nll / count)), n_chunks
