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
    from flm_runtime.models.llama import ForwardOutput, LlamaConfig


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
    """The step interface of a target model (DESIGN §6): per sequence, and batched for decode.

    Attributes:
        config: ``LlamaConfig`` (``vocab_size``, ``hidden_size``, ``max_position_embeddings``,
            ``num_hidden_layers``, ...).
        embed, lm_head: ``[V, E]`` float32 host arrays; the DFlash draft shares them (frozen).
        prefill_chunk: positions per ``prefill_chunks`` step.
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
                      taps: tuple[int, ...] = ()) -> np.ndarray | ForwardOutput:
        """One step for ``B`` sequences: ``token_rows[b]`` ``[T_b]`` appended to ``caches[b]``;
        logits ``[sum T_b, V]`` of every row (plus the taps, as a ``ForwardOutput``, when asked),
        rows ``b`` as ``forward(token_rows[b], caches[b], all_logits=True, taps=taps)``. Batched
        plain decode and DFlash verify rows of several sequences go through it. If it raises, no
        cache's length has changed."""

    def decode_batch(self, token_ids, caches: list[KVCacheLike]) -> np.ndarray:
        """One plain decode step for ``B`` sequences (``token_ids`` ``[B]`` int, ``B`` distinct
        caches): logits ``[B, V]``, row ``b`` as ``decode(token_ids[b], caches[b])``. The cpu
        backend shares each matrix product across the rows (continuous batching)."""


def select_backend(requested: str | None, tag: str):
    """See ``flm_runtime.backends.select.select_backend``."""
    from flm_runtime.backends.select import select_backend as select

    return select(requested, tag)


__all__ = ["KVCacheLike", "TargetModel", "select_backend"]


def decode_rows(model, token_ids, caches: list) -> np.ndarray:
    """``decode_batch`` for a backend without a batched decode: one ``model.decode`` per row.

    Returns logits ``[B, V]``. If a row raises, every cache is rolled back to its length before
    the call (as the cpu backend's batched decode leaves them) and the error propagates.
    """
    lengths = [c.length for c in caches]
    try:
        return np.stack([model.decode(int(t), c) for t, c in zip(token_ids, caches)])  # [B, V]
    except Exception:
        for cache, n in zip(caches, lengths):
            cache.trim(n)
        raise


def forward_rows(model, token_rows: list[np.ndarray], caches: list, *, taps: tuple[int, ...] = ()):
    """``forward_batch`` for a backend without a batched forward: one ``model.forward`` per
    sequence. Same returns; if a sequence raises, every cache is rolled back to its length before
    the call and the error propagates.
    """
    from flm_runtime.models.llama import ForwardOutput

    lengths = [c.length for c in caches]
    try:
        outs = [model.forward(np.asarray(t, dtype=np.int64).reshape(-1), c, all_logits=True, taps=taps)
                for t, c in zip(token_rows, caches)]
    except Exception:
        for cache, n in zip(caches, lengths):
            cache.trim(n)
        raise
    if not taps:
        return np.concatenate(outs)  # [R, V]
    return ForwardOutput(np.concatenate([o.logits for o in outs]), np.concatenate([o.taps for o in outs]))
