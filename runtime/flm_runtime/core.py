"""The types every layer shares: a model's hyper-parameters (``LlamaConfig``), a sequence's KV
cache (``KVCache``), what a target step returns (``ForwardOutput``) and what a draft proposes
(``Proposal``). It imports nothing of ``flm_runtime``: the backends, the models, the engine and the
loaders all build on it.

Axis legend (whole runtime): L layers, Hkv key/value heads, S capacity (positions), D head dim.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters, named as in a Hugging Face ``config.json`` (unknown keys are ignored).

    Attributes:
        vocab_size: tokens in the vocabulary (V).
        hidden_size: width of the residual stream (hidden).
        intermediate_size: SwiGLU FFN width.
        num_hidden_layers: decoder layers (L).
        num_attention_heads: query heads (H).
        num_key_value_heads: key/value heads (Hkv); H % Hkv == 0 (grouped-query attention).
        max_position_embeddings: context length (tokens).
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon inside RMSNorm.
        tie_word_embeddings: the LM head is the embedding matrix.
        head_dim: per-head width (D); defaults to hidden_size // num_attention_heads.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        assert self.num_attention_heads % self.num_key_value_heads == 0, "H must be a multiple of Hkv"

    @classmethod
    def from_dict(cls, config: dict) -> "LlamaConfig":
        """Build from a ``config.json`` mapping, ignoring keys this class does not name."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads


GROWTH_QUANTUM = 256  # positions; capacity grows in multiples of this to amortize reallocation
KEY_TILE = 16  # positions per tile of the key cache: one 16-lane float32 vector per head dimension


class KVCache:
    """Keys and values of one sequence for every layer.

    ``v`` is ``[L, Hkv, S, D]`` of ``dtype`` (float32, or float16 for a quantized target: half
    the bytes a decode step reads at long context, as llama.cpp's default cache). ``k`` holds the keys of the same positions in tiles of
    ``KEY_TILE`` positions, transposed: ``[L, Hkv, S / KEY_TILE, D, KEY_TILE]``, the key of
    position ``p`` being ``k[l, h, p // KEY_TILE, :, p % KEY_TILE]``, so that the attention
    kernel scores a tile's 16 positions with one vector multiply-add per head dimension
    (``kernels/attention.py``); ``keys`` gives them back as ``[Hkv, N, D]``. Positions ``0 ..
    length-1`` are valid. Appending past the capacity reallocates (doubling, rounded up to
    ``GROWTH_QUANTUM``) up to ``max_length``. Rolling back (speculative decoding, a rejected
    block) is ``trim(n)``: the rows past ``n`` are simply overwritten by the next append.

    Args:
        n_layers, n_kv_heads, head_dim: model geometry (L, Hkv, D).
        max_length: the model's context length (tokens); appending past it is a bug (assert).
        capacity: initial capacity (tokens), clamped to ``max_length``.
        dtype: ``np.float32`` or ``np.float16``; written keys and values are rounded to it.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_length: int, capacity: int = 0,
                 dtype: type = np.float32):
        assert dtype in (np.float32, np.float16), f"KV cache dtype {dtype}"
        self.max_length = max_length
        self.length = 0
        cap = min(max_length, _round_up(max(capacity, 1)))
        self.k = np.zeros((n_layers, n_kv_heads, _tiles(cap), head_dim, KEY_TILE), dtype=dtype)
        self.v = np.zeros((n_layers, n_kv_heads, cap, head_dim), dtype=dtype)  # [L, Hkv, S, D]

    @property
    def capacity(self) -> int:
        return self.v.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the allocated arrays (not just the valid positions)."""
        return self.k.nbytes + self.v.nbytes

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more positions (grows the arrays if needed)."""
        need = self.length + n_new
        assert need <= self.max_length, f"KV cache overflow: {need} > context length {self.max_length}"
        if need <= self.capacity:
            return
        cap = min(self.max_length, _round_up(max(need, 2 * self.capacity)))
        for name, size in (("k", _tiles(cap)), ("v", cap)):  # both grow along axis 2
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (size,) + old.shape[3:], dtype=old.dtype)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store new keys/values ``[Hkv, T, D]`` of ``layer`` at positions ``length .. length+T-1``.

        ``reserve(T)`` must have been called for this step; ``commit(T)`` advances ``length`` once all
        layers are written.
        """
        t = k.shape[1]
        position, end = self.length, self.length + t
        while position < end:  # the runs of positions that share a key tile: slices, not fancy indexing
            tile, lane = divmod(position, KEY_TILE)
            n = min(end - position, KEY_TILE - lane)
            first = position - self.length
            self.k[layer, :, tile, :, lane : lane + n] = k[:, first : first + n].transpose(0, 2, 1)  # [Hkv, D, n]
            position += n
        self.v[layer, :, self.length : self.length + t] = v

    def keys(self, layer: int | None = None) -> np.ndarray:
        """The valid keys of ``layer`` ``[Hkv, length, D]`` (of every layer: ``[L, Hkv, length, D]``),
        untiled: a copy."""
        k = self.k if layer is None else self.k[layer]
        untiled = np.swapaxes(k, -1, -2).reshape(k.shape[:-3] + (-1, k.shape[-2]))  # [..., Hkv, S, D]
        return untiled[..., : self.length, :]

    def commit(self, n_new: int) -> None:
        """Advance ``length`` by ``n_new`` positions written by ``write`` for every layer."""
        self.length += n_new

    def trim(self, length: int) -> None:
        """Roll back to ``length`` positions (drop everything after)."""
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        self.length = length

    def copy_prefix(self, length: int, capacity: int) -> "KVCache":
        """A new cache holding this one's first ``length`` positions, with room for ``capacity``
        (a prefix cache's copy for a new request: ``scheduling.prefix_cache``)."""
        assert 0 <= length <= self.length, f"a prefix of {length} positions of a cache of {self.length}"
        l, hkv = self.v.shape[:2]
        out = KVCache(l, hkv, self.v.shape[3], self.max_length, max(capacity, length), self.v.dtype.type)
        out.k[:, :, :_tiles(length)] = self.k[:, :, :_tiles(length)]
        out.v[:, :, :length] = self.v[:, :, :length]
        out.length = length
        return out

    def copy(self) -> "KVCache":
        """An independent cache holding the same positions (the engine's ``n`` > 1: each choice
        decodes on its own copy of the prompt's keys and values), with the same capacity."""
        out = copy.copy(self)
        out.k, out.v = self.k.copy(), self.v.copy()
        return out


class ForwardOutput(NamedTuple):
    """What a target step returns (``TargetModel.forward_batch`` and the helpers over it in
    ``flm_runtime.backends``).

    Attributes:
        logits: float32 ``[N, V]`` of the rows the call asked logits for (or ``[V]`` of the one
            next position: ``prefill``, ``decode``).
        taps: ``[T, n_taps * E]`` float32, the tapped layers' outputs concatenated per position;
            None when no taps were asked.
    """

    logits: np.ndarray
    taps: np.ndarray | None


class Proposal(NamedTuple):
    """Drafted tokens of ``S`` sequences.

    Attributes:
        ids: ``[S, K]`` int64 target token ids ``d1 .. dK``.
        confidence: ``[S, K]`` float32, the draft's softmax probability of each drafted token (its
            top-1 probability over the draft vocabulary). The speculation policy reads it as an
            estimate of that token's acceptance (EAGLE-2: Li et al. 2024, arXiv:2406.16858, find
            draft confidence a good proxy of the acceptance rate, and so does
            ``benchmarks/draft_confidence.py`` for ours: docs/dflash.md, "Confidence").
    """

    ids: np.ndarray
    confidence: np.ndarray


def _round_up(n: int) -> int:
    return -(-n // GROWTH_QUANTUM) * GROWTH_QUANTUM


def _tiles(positions: int) -> int:
    """Key tiles holding ``positions`` positions (the last one maybe in part)."""
    return -(-positions // KEY_TILE)
