"""Backends: where a model step runs. One interface, ``TargetModel``, that both implement.

- ``cpu``: ``flm_runtime.models.llama.LlamaModel`` *is* the cpu backend's target (numpy kernels in
  ``backends/cpu.py``); it is the numerical reference for every other backend.
- ``npu``: ``flm_runtime.backends.npu.NpuModel``, built from a loaded ``LlamaModel`` and a kernel
  build of ``xclbins/manifest.json``; the same step on an AMD NPU through ``pyxrt``. Never run on
  hardware (see its module docstring).

``select_backend`` (``backends/select.py``) picks one: ``FLM_BACKEND=auto|cpu|npu`` or a
per-deployment value. The engine, the speculative decoder and the DFlash draft use only what
``TargetModel`` states, so they run unchanged on either backend.

Nothing here imports ``pyxrt`` or the npu backend: importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from flm_runtime.core import ForwardOutput, LlamaConfig


@runtime_checkable
class KVCacheLike(Protocol):
    """One sequence's KV cache as the engine sees it: positions ``0 .. length-1`` are held.

    ``trim(n)`` rolls back to ``n`` positions (a rejected speculative block); appending past
    ``max_length`` (the context length) is a bug.
    """

    length: int
    max_length: int

    def trim(self, length: int) -> None: ...


@runtime_checkable
class TargetModel(Protocol):
    """The step interface of a target model (docs/design.md, "Backends"): per sequence, and
    batched (the engine's steps go through ``forward_batch`` only).

    Attributes:
        config: ``LlamaConfig`` (``vocab_size``, ``hidden_size``, ``max_position_embeddings``,
            ``num_hidden_layers``, ...).
        embed, lm_head: ``[V, E]`` float32 host arrays; the DFlash draft shares them (frozen).
        prefill_chunk: positions per ``prefill_chunks`` step, and the most rows of one sequence the
            engine puts in one ``forward_batch`` (it bounds attention's score buffer).
    """

    config: LlamaConfig
    embed: np.ndarray
    lm_head: np.ndarray
    prefill_chunk: int

    def new_cache(self, capacity: int = 0) -> KVCacheLike:
        """An empty cache; ``capacity`` (tokens) is a hint, it grows on demand."""

    def forward(self, token_ids: np.ndarray, cache: KVCacheLike, *, all_logits: bool = False,
                taps: tuple[int, ...] = ()) -> np.ndarray | ForwardOutput:
        """Append ``T`` positions (``token_ids`` ``[T]`` int) to ``cache``; logits ``[T, V]``
        (``all_logits``: the verify pass) or ``[1, V]`` float32, plus ``[T, n*E]`` taps (the
        residual stream after each layer of ``taps``) as a ``ForwardOutput`` when asked."""

    def prefill(self, token_ids: np.ndarray, cache: KVCacheLike, *,
                taps: tuple[int, ...] = ()) -> np.ndarray | ForwardOutput:
        """A whole prompt; logits ``[V]`` of its last position (and all its taps)."""

    def prefill_chunks(self, token_ids: np.ndarray, cache: KVCacheLike, *, taps: tuple[int, ...] = ()):
        """A prompt ``prefill_chunk`` positions at a time; yields each chunk's ``forward`` output."""

    def decode(self, token_id: int, cache: KVCacheLike) -> np.ndarray:
        """One plain decode step (the 1-token layer); logits ``[V]``."""

    def forward_batch(self, token_rows: list[np.ndarray], caches: list[KVCacheLike], *,
                      taps: tuple[int, ...] = (), logit_rows: list[int] | None = None) -> np.ndarray | ForwardOutput:
        """One step for ``B`` sequences: ``token_rows[b]`` ``[T_b]`` appended to ``caches[b]``;
        logits ``[sum n_b, V]`` of each sequence's last ``n_b = logit_rows[b]`` rows (None: every
        row), plus the taps of every row ``[sum T_b, n*E]``, as a ``ForwardOutput``, when asked;
        rows ``b`` as ``forward(token_rows[b], caches[b], all_logits=True, taps=taps)``. Prefill
        chunks, plain decode rows and DFlash verify rows of several sequences go through it (the
        engine's continuous batching). If it raises, no cache's length has changed."""


def select_backend(requested: str | None, tag: str):
    """See ``flm_runtime.backends.select.select_backend``."""
    from flm_runtime.backends.select import select_backend as select

    return select(requested, tag)


__all__ = ["KVCacheLike", "TargetModel", "select_backend"]


def forward_rows(model, token_rows: list[np.ndarray], caches: list, *, taps: tuple[int, ...] = (),
                 logit_rows: list[int] | None = None):
    """``forward_batch`` for a backend without a batched forward: one ``model.forward`` per
    sequence. Same returns; if a sequence raises, every cache is rolled back to its length before
    the call and the error propagates.
    """
    from flm_runtime.core import ForwardOutput

    lengths = [c.length for c in caches]
    rows = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_rows]
    n_logits = [r.size for r in rows] if logit_rows is None else list(logit_rows)
    try:
        outs = [model.forward(r, c, all_logits=n > 1, taps=taps) for r, c, n in zip(rows, caches, n_logits)]
    except Exception:
        for cache, n in zip(caches, lengths):
            cache.trim(n)
        raise
    logits = [o.logits if taps else o for o in outs]  # [T_b or 1, V] each
    logits = np.concatenate([lg[len(lg) - n:] for lg, n in zip(logits, n_logits)])  # [sum n_b, V]
    return ForwardOutput(logits, np.concatenate([o.taps for o in outs])) if taps else logits
