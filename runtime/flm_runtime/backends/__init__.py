"""Backends: where a model step runs. One interface, ``TargetModel``, that both implement.

- ``cpu``: ``flm_runtime.models.causal_lm.CausalLM`` *is* the cpu backend's target (its layers
  ``flm_runtime.layers``, its kernels ``flm_runtime.kernels``); it is the numerical reference for every other backend.
- ``npu``: ``flm_runtime.backends.npu.NpuModel``, built from a loaded ``CausalLM`` and a kernel
  build of ``xclbins/flm_xclbins/manifest.json``; the same step on an AMD NPU through ``pyxrt``. Never run on
  hardware (see its module docstring).

A backend implements one step method, ``forward_batch``; ``forward``, ``prefill``,
``prefill_chunks`` and ``decode`` below are the per-sequence calls, written once over it. Every one
returns a ``ForwardOutput``. ``backends/select.py`` picks a backend:
``FLM_BACKEND=auto|cpu|npu`` or a per-deployment value. The engine, the speculative decoder and
the DFlash draft use only what ``TargetModel`` states, so they run unchanged on either backend.

Nothing here imports ``pyxrt`` or the npu backend: importing this package stays cheap.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from flm_runtime.kv_cache import BlockPool
from flm_runtime.model_config import ModelConfig
from flm_runtime.outputs import ForwardOutput


class Backend(enum.Enum):
    """Where a target's step runs; the value is the backend's name (``FLM_BACKEND``, file names)."""

    CPU = "cpu"
    NPU = "npu"


@runtime_checkable
class KVCacheLike(Protocol):
    """One sequence's KV cache as the engine sees it: a ``kv_cache.BlockTable``, positions ``0 ..
    length-1`` held in blocks of its pool.

    ``fits(n)`` says whether the pool has the blocks of ``n`` more positions, ``reserve(n)`` takes
    them (``kv_cache.KVPoolExhausted`` when a fixed pool has none left), ``trim(n)`` rolls back to
    ``n`` positions (a rejected speculative block), ``release()`` gives every block back;
    appending past ``max_length`` (the context length) is a bug. ``copy``: ``copy()`` where the
    backend can copy a cache (a request's choices then share one prefill; None when the pool has
    no block for the copy), None where it cannot.
    """

    length: int
    max_length: int
    copy: Callable[[], KVCacheLike | None] | None

    def fits(self, n_new: int) -> bool: ...

    def reserve(self, n_new: int) -> None: ...

    def trim(self, length: int) -> None: ...

    def release(self) -> None: ...


@runtime_checkable
class TargetModel(Protocol):
    """The step interface of a target model (docs/design.md, "Backends"): one batched step,
    ``forward_batch``.

    Attributes:
        config: ``ModelConfig`` (``vocab_size``, ``hidden_size``, ``max_position_embeddings``,
            ``num_hidden_layers``, ...).
        backend: where the step runs.
        embed, lm_head: ``[V, E]`` float32 host arrays; the DFlash draft shares them (frozen).
        norm: ``[E]`` float32, the final RMSNorm's weight (the LM head reads the last layer's
            output through it; embeddings pool it, ``flm_runtime.embedding``).
        prefill_chunk: positions per ``prefill_chunks`` step, and the most rows of one sequence the
            engine puts in one ``forward_batch`` (it bounds attention's score buffer).
        kv_dtype: the element type of its caches' keys and values, as the engine's KV budget
            counts them.
        batch_invariant: a row's outputs are the same bits whatever rows run beside it in a pass
            (docs/design.md, "Batch invariance"); only then does the engine cache prompt prefixes
            (a cached prefix was computed beside other rows than a cold one).
    """

    config: ModelConfig
    backend: Backend
    embed: np.ndarray
    lm_head: np.ndarray
    norm: np.ndarray
    prefill_chunk: int
    kv_dtype: type
    batch_invariant: bool

    def new_pool(self, positions: int) -> BlockPool:
        """The KV pool of one engine: ``positions // block_tokens`` blocks, a fixed number (a
        ``kv_cache.KVPool`` where the cache is host memory; a plain ``BlockPool`` that only counts
        where the backend stores the KV itself)."""

    def new_cache(self, capacity: int = 0, pool: BlockPool | None = None) -> KVCacheLike:
        """An empty cache taking its blocks from ``pool`` (``new_pool``); without one, from a
        pool of its own that grows on demand (``capacity``, tokens, is a hint)."""

    def forward_batch(self, token_rows: list[np.ndarray], caches: list[KVCacheLike], *,
                      taps: tuple[int, ...] = (), logit_rows: list[int] | None = None) -> ForwardOutput:
        """One step for ``B`` sequences: ``token_rows[b]`` ``[T_b]`` int appended to ``caches[b]``
        (distinct caches; ``T_b >= 1``).

        Args:
            taps: 0-based layer indices whose output (the residual stream after that layer, before
                the final norm) to return, concatenated in this order: the DFlash draft's context
                features (docs/dflash.md).
            logit_rows: per sequence, how many of its LAST rows need logits (``0 <= n_b <= T_b``:
                a prefill chunk needs 1 or none, a verify pass all of them); None: every row.
        Returns:
            logits ``[sum n_b, V]`` float32 of the selected rows, sequence after sequence; taps
            ``[sum T_b, len(taps) * E]`` float32 of EVERY row, or None without ``taps``. Prefill
            chunks, plain decode rows and DFlash verify rows of several sequences go through it
            (the engine's continuous batching). If it raises, no cache's length has changed.
        """


def forward(model: TargetModel, token_ids: np.ndarray, cache: KVCacheLike, *, all_logits: bool = False,
            taps: tuple[int, ...] = ()) -> ForwardOutput:
    """Append ``T`` positions (``token_ids`` ``[T]`` int) to ``cache``: one sequence's
    ``forward_batch``. Logits ``[T, V]`` (``all_logits``: a verify pass, perplexity) or ``[1, V]``
    float32 of the last position; taps ``[T, len(taps) * E]`` or None."""
    token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # [T]
    return model.forward_batch([token_ids], [cache], taps=taps, logit_rows=[token_ids.size if all_logits else 1])


def prefill_chunks(model: TargetModel, token_ids: np.ndarray, cache: KVCacheLike, *,
                   taps: tuple[int, ...] = ()) -> Iterator[ForwardOutput]:
    """Prefill a prompt ``model.prefill_chunk`` positions per ``forward``; yields each chunk's
    output (last-position logits ``[1, V]``, and its taps ``[T_chunk, n*E]`` when asked), so that
    a caller can consume the taps chunk by chunk instead of holding a whole prompt's."""
    token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    assert token_ids.size > 0, "prefill needs at least one token"
    for s in range(0, token_ids.size, model.prefill_chunk):
        yield forward(model, token_ids[s : s + model.prefill_chunk], cache, taps=taps)


def prefill(model: TargetModel, token_ids: np.ndarray, cache: KVCacheLike, *,
            taps: tuple[int, ...] = ()) -> ForwardOutput:
    """Chunked prefill of a whole prompt: logits ``[V]`` of its last position, taps of every
    prompt position ``[T, len(taps) * E]`` or None."""
    outs = list(prefill_chunks(model, token_ids, cache, taps=taps))
    return ForwardOutput(outs[-1].logits[0], np.concatenate([o.taps for o in outs]) if taps else None)


def decode(model: TargetModel, token_id: int, cache: KVCacheLike) -> ForwardOutput:
    """One plain decode step (the 1-token layer): logits ``[V]`` of the new position, taps None."""
    return ForwardOutput(forward(model, np.array([token_id]), cache).logits[0], None)


__all__ = ["Backend", "KVCacheLike", "TargetModel", "decode", "forward", "prefill", "prefill_chunks"]
