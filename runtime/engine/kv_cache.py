"""Per-sequence KV cache: preallocated arrays indexed by position, where truncation is the rollback.

Axis legend (whole runtime): L layers, Hkv key/value heads, S capacity (positions), D head dim.
"""

from __future__ import annotations

import numpy as np

GROWTH_QUANTUM = 256  # positions; capacity grows in multiples of this to amortize reallocation


class KVCache:
    """Keys and values of one sequence for every layer.

    ``k`` and ``v`` are ``[L, Hkv, S, D]`` float32; positions ``0 .. length-1`` are valid. Appending
    past the capacity reallocates (doubling, rounded up to ``GROWTH_QUANTUM``) up to ``max_length``.
    Rolling back (speculative decoding, a rejected block) is ``trim(n)``: the rows past ``n`` are
    simply overwritten by the next append.

    Args:
        n_layers, n_kv_heads, head_dim: model geometry (L, Hkv, D).
        max_length: the model's context length (tokens); appending past it is a bug (assert).
        capacity: initial capacity (tokens), clamped to ``max_length``.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_length: int, capacity: int = 0):
        self.max_length = max_length
        self.length = 0
        cap = min(max_length, _round_up(max(capacity, 1)))
        self.k = np.zeros((n_layers, n_kv_heads, cap, head_dim), dtype=np.float32)  # [L, Hkv, S, D]
        self.v = np.zeros_like(self.k)  # [L, Hkv, S, D]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

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
        for name in ("k", "v"):
            old = getattr(self, name)
            new = np.zeros(old.shape[:2] + (cap,) + old.shape[3:], dtype=old.dtype)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store new keys/values ``[Hkv, T, D]`` of ``layer`` at positions ``length .. length+T-1``.

        ``reserve(T)`` must have been called for this step; ``commit(T)`` advances ``length`` once all
        layers are written.
        """
        t = k.shape[1]
        self.k[layer, :, self.length : self.length + t] = k
        self.v[layer, :, self.length : self.length + t] = v

    def commit(self, n_new: int) -> None:
        """Advance ``length`` by ``n_new`` positions written by ``write`` for every layer."""
        self.length += n_new

    def trim(self, length: int) -> None:
        """Roll back to ``length`` positions (drop everything after)."""
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        self.length = length


def _round_up(n: int) -> int:
    return -(-n // GROWTH_QUANTUM) * GROWTH_QUANTUM
