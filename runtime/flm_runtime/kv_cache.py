"""The paged KV cache: a pool of fixed-size blocks, and each sequence's cache as a table of them.

A ``BlockPool`` counts blocks of ``block_tokens`` positions: which are free, how many sequences
reference each, and which hold a known run of tokens (prefix caching). A ``KVPool`` is a block pool
with storage, the keys and values of every block for every layer; a ``KVCache`` is one sequence's
``BlockTable`` into a ``KVPool``: position ``p`` lives in block ``table[p // block_tokens]``, at
``p % block_tokens``. Sequences take blocks as they grow and give them back when they end or roll
back, so the memory a sequence holds follows its length, not its worst case (vLLM's PagedAttention:
Kwon et al. 2023, arXiv:2309.06180).

An engine makes one pool of a fixed size for all its sequences (``TargetModel.new_pool``); a
cache made without one (``new_cache()``: tests, benchmarks, the DFlash draft's context) has a
private pool that grows on demand. Backends whose storage is their own (the npu backend, the
engine's test fakes) take their positions' blocks from a plain ``BlockPool`` all the same, so the
engine counts and preempts every backend alike.

Prefix caching. A full block's contents depend only on the tokens up to its end, so a full block
is named by the digest of its tokens chained with the previous block's digest
(``block_digests``). A block registered under its digest (``BlockPool.register``) outlives the
sequence that wrote it: with no reference left it stays in the pool, least recently used first to
be reused, and a later sequence whose prompt starts with the same tokens takes it
(``BlockPool.lookup``) instead of computing it again. Blocks are only shared whole and only below a
sequence's length, and a sequence writes only past its length, so a shared block is never written.

Storage layout (``KVPool``), L layers, NB blocks, Hkv key-value heads, B = ``block_tokens``, D head
dim: ``k`` ``[L, NB, Hkv, B/16, D, 16]``, the keys of a block in tiles of ``KEY_TILE`` positions,
transposed, so that attention scores a tile's 16 positions with one vector multiply-add per head
dimension (``kernels/attention.py``); ``v`` ``[L, NB, Hkv, B, D]``.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable

import numpy as np

KEY_TILE = 16  # positions per tile of the key cache: one 16-lane float32 vector per head dimension

BLOCK_TOKENS = 64  # positions per block: 4 key tiles; the prefix cache reuses whole blocks


class KVPoolExhausted(Exception):
    """No free block is left in a fixed-size pool. ``BlockPool.can_allocate`` and
    ``BlockTable.fits`` say so beforehand, as a value (the engine's scheduler asks them)."""


class BlockPool:
    """Blocks of ``block_tokens`` positions: free ones, references, and digests (module docstring).

    Args:
        n_blocks: blocks in the pool (at start, for a ``growable`` one).
        block_tokens: positions per block, a multiple of ``KEY_TILE``.
        growable: ``allocate`` grows the pool instead of raising ``KVPoolExhausted``.

    Not thread-safe: one owner (an engine, under its lock or on its thread; or one cache).
    """

    def __init__(self, n_blocks: int, block_tokens: int = BLOCK_TOKENS, *, growable: bool = False):
        assert n_blocks >= 0 and block_tokens % KEY_TILE == 0, (n_blocks, block_tokens)
        self.block_tokens = block_tokens
        self.growable = growable
        self.n_blocks = 0
        self._refs = np.zeros(0, dtype=np.int32)
        self._free: list[int] = []                       # unreferenced, holding nothing known
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, registered; LRU first
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._add_blocks(n_blocks)

    @property
    def available(self) -> int:
        """Blocks ``allocate`` can hand out without growing: free, or cached and unreferenced."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks some sequence references."""
        return self.n_blocks - self.available

    @property
    def cached(self) -> int:
        """Unreferenced blocks kept for their tokens (prefix caching)."""
        return len(self._cached)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_tokens)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` finds its blocks: ``n`` available, or the pool grows."""
        return self.growable or n <= self.available

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each referenced once: free ones first, then cached ones, least recently
        used first (they are forgotten).

        Raises:
            KVPoolExhausted: fewer than ``n`` available and the pool does not grow (nothing is
                taken).
        """
        if n > self.available:
            if not self.growable:
                raise KVPoolExhausted(f"{n} blocks asked, {self.available} of {self.n_blocks} available")
            self._add_blocks(max(n - self.available, self.n_blocks))
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._digest_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def share(self, blocks) -> None:
        """One reference more to each of ``blocks`` (held ones)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not held"
            self._refs[block] += 1

    def release(self, blocks) -> None:
        """One reference less to each of ``blocks``; a block with none left becomes available
        (kept for its tokens if it is registered)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} released more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """``block`` (held, full) holds the tokens ``digest`` names (``block_digests``). A digest
        already registered keeps its block."""
        if digest not in self._block_of and block not in self._digest_of:
            self._block_of[digest] = block
            self._digest_of[block] = digest

    def lookup(self, digest: bytes) -> int | None:
        """The block registered under ``digest``, with one reference more; None if there is none."""
        block = self._block_of.get(digest)
        if block is not None:
            self._cached.pop(block, None)
            self._refs[block] += 1
        return block

    def clear_cached(self) -> None:
        """Forget every unreferenced cached block (they become free)."""
        for block in self._cached:
            del self._block_of[self._digest_of.pop(block)]
            self._free.append(block)
        self._cached.clear()

    def _add_blocks(self, n: int) -> None:
        """Grow the pool by ``n`` free blocks (storage too, in ``KVPool``)."""
        self._refs = np.concatenate([self._refs, np.zeros(n, dtype=np.int32)])
        self._free[:0] = range(self.n_blocks + n - 1, self.n_blocks - 1, -1)  # lowest handed out first
        self.n_blocks += n


class KVPool(BlockPool):
    """A ``BlockPool`` with storage: the keys and values of every block for every layer
    (module docstring, "Storage layout"), zeroed (numpy's zeroed pages cost no memory until
    written).

    Args:
        n_layers, n_kv_heads, head_dim: the model's geometry (L, Hkv, D).
        dtype: ``np.float32`` or ``np.float16``; written keys and values are rounded to it.
        n_blocks, block_tokens, growable: as ``BlockPool``.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: type, n_blocks: int,
                 block_tokens: int = BLOCK_TOKENS, *, growable: bool = False):
        assert dtype in (np.float32, np.float16), f"KV cache dtype {dtype}"
        self.k = np.zeros((n_layers, 0, n_kv_heads, block_tokens // KEY_TILE, head_dim, KEY_TILE), dtype=dtype)
        self.v = np.zeros((n_layers, 0, n_kv_heads, block_tokens, head_dim), dtype=dtype)
        super().__init__(n_blocks, block_tokens, growable=growable)

    @property
    def dtype(self) -> type:
        return self.v.dtype.type

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block, every layer, keys and values."""
        return (self.k[:, 0].nbytes + self.v[:, 0].nbytes) if self.n_blocks else 0

    def _add_blocks(self, n: int) -> None:
        grown = []
        for old in (self.k, self.v):  # both grow along the block axis
            new = np.zeros(old.shape[:1] + (old.shape[1] + n,) + old.shape[2:], dtype=old.dtype)
            new[:, : old.shape[1]] = old
            grown.append(new)
        self.k, self.v = grown
        super()._add_blocks(n)


class BlockTable:
    """One sequence's blocks in a ``BlockPool``: positions ``0 .. length-1`` are held, in blocks
    ``blocks[p // block_tokens]``.

    ``fits(n)`` says whether the pool has the blocks of ``n`` more positions, ``reserve(n)``
    takes them, ``commit(n)`` advances ``length`` once they are written, ``trim(n)`` rolls back (a
    rejected speculative block) and gives back the blocks past it, ``release()`` gives back every
    block.

    ``copy``: a table whose storage can be copied (``KVCache``) defines ``copy()``, an independent
    table holding the same positions, or None when the pool has no block left for it; None
    (declared here: a table that only counts, or the npu backend's cache in a buffer of its own)
    means it cannot be, and the engine prefills each choice of a request itself.

    Args:
        pool: where its blocks come from.
        max_length: the model's context length (tokens); reserving past it is a bug (assert).
    """

    copy: Callable[[], BlockTable | None] | None = None

    def __init__(self, pool: BlockPool, max_length: int):
        self.pool = pool
        self.max_length = max_length
        self.length = 0
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        """Positions its blocks hold."""
        return len(self.blocks) * self.pool.block_tokens

    @property
    def table(self) -> np.ndarray:
        """``blocks`` as an int64 array ``[n_blocks]`` (what the kernels take)."""
        return np.asarray(self.blocks, dtype=np.int64)

    def fits(self, n_new: int) -> bool:
        """Whether ``reserve(n_new)`` finds its blocks (``BlockPool.can_allocate``)."""
        return self.pool.can_allocate(self._missing(n_new))

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more positions.

        Raises:
            KVPoolExhausted: the pool has no free block (nothing is taken); ``fits`` tells before.
        """
        more = self._missing(n_new)
        if more > 0:
            self.blocks += self.pool.allocate(more)

    def _missing(self, n_new: int) -> int:
        """Blocks ``n_new`` more positions take beyond those held."""
        need = self.length + n_new
        assert need <= self.max_length, f"KV cache overflow: {need} > context length {self.max_length}"
        return self.pool.blocks_for(need) - len(self.blocks)

    def commit(self, n_new: int) -> None:
        """Advance ``length`` by ``n_new`` positions written for every layer."""
        assert self.length + n_new <= self.capacity, "commit past the reserved room"
        self.length += n_new

    def trim(self, length: int) -> None:
        """Roll back to ``length`` positions (drop everything after); blocks past it go back."""
        assert 0 <= length <= self.length, f"cannot trim a cache of {self.length} to {length}"
        self.length = length
        keep = self.pool.blocks_for(length)
        self.pool.release(self.blocks[keep:])
        del self.blocks[keep:]

    def release(self) -> None:
        """Give every block back; the table is empty afterwards."""
        self.pool.release(self.blocks)
        self.blocks, self.length = [], 0

    def adopt(self, blocks: list[int], length: int) -> None:
        """Start from ``blocks`` (references already taken: ``BlockPool.lookup``), which hold the
        first ``length`` positions (a prefix taken from the cache). The table must be empty."""
        assert not self.blocks and self.pool.blocks_for(length) == len(blocks)
        self.blocks, self.length = list(blocks), length

    def full_blocks(self) -> list[int]:
        """The blocks every position of which is held."""
        return self.blocks[: self.length // self.pool.block_tokens]


class KVCache(BlockTable):
    """Keys and values of one sequence for every layer, in blocks of a ``KVPool`` (module
    docstring). ``write`` stores a layer's new positions, ``keys`` gives the held keys back
    untiled; ``copy`` shares the full blocks with the copy.

    Args:
        pool: a ``KVPool`` (its geometry and dtype are the cache's).
        max_length: the model's context length (tokens).
    """

    pool: KVPool

    @classmethod
    def private(cls, n_layers: int, n_kv_heads: int, head_dim: int, max_length: int, capacity: int = 0,
                dtype: type = np.float32, block_tokens: int = BLOCK_TOKENS) -> "KVCache":
        """A cache with a pool of its own, sized for ``capacity`` positions and growing on
        demand."""
        blocks = -(-min(max(capacity, 1), max_length) // block_tokens)
        pool = KVPool(n_layers, n_kv_heads, head_dim, dtype, blocks, block_tokens, growable=True)
        return cls(pool, max_length)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks it holds."""
        return len(self.blocks) * self.pool.block_nbytes

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store new keys/values ``[Hkv, T, D]`` of ``layer`` at positions ``length .. length+T-1``.

        ``reserve(T)`` must have been called for this step; ``commit(T)`` advances ``length`` once
        all layers are written.
        """
        b = self.pool.block_tokens
        position, end = self.length, self.length + k.shape[1]
        while position < end:  # the runs of positions that share a key tile: slices, not fancy indexing
            block, slot = self.blocks[position // b], position % b
            tile, lane = divmod(slot, KEY_TILE)
            n = min(end - position, KEY_TILE - lane)
            first = position - self.length
            self.pool.k[layer, block, :, tile, :, lane : lane + n] = k[:, first : first + n].transpose(0, 2, 1)
            self.pool.v[layer, block, :, slot : slot + n] = v[:, first : first + n]
            position += n

    def keys(self, layer: int | None = None) -> np.ndarray:
        """The held keys of ``layer`` ``[Hkv, length, D]`` (of every layer: ``[L, Hkv, length,
        D]``), untiled: a copy."""
        k = self.pool.k[:, self.blocks]  # [L, nb, Hkv, B/16, D, 16]
        k = np.swapaxes(k, -1, -2)  # [L, nb, Hkv, B/16, 16, D]
        l, nb, hkv, _, _, d = k.shape
        k = k.reshape(l, nb, hkv, -1, d).transpose(0, 2, 1, 3, 4).reshape(l, hkv, -1, d)[:, :, : self.length]
        return k if layer is None else k[layer]

    def values(self, layer: int | None = None) -> np.ndarray:
        """The held values, as ``keys`` gives the keys."""
        v = self.pool.v[:, self.blocks]  # [L, nb, Hkv, B, D]
        l, nb, hkv, b, d = v.shape
        v = v.transpose(0, 2, 1, 3, 4).reshape(l, hkv, nb * b, d)[:, :, : self.length]
        return v if layer is None else v[layer]

    def copy(self) -> "KVCache | None":
        """An independent cache in the same pool holding the same positions (the engine's ``n`` >
        1: each choice decodes on its own copy of the prompt's keys and values): the full blocks
        are shared, a last block in part is copied. None when the pool has no block left for
        that copy (nothing is taken)."""
        full = self.full_blocks()
        partial = self.length > len(full) * self.pool.block_tokens
        if partial and not self.pool.can_allocate(1):
            return None
        out = type(self)(self.pool, self.max_length)
        if partial:
            (block,) = self.pool.allocate(1)
            last = self.blocks[len(full)]
            self.pool.k[:, block], self.pool.v[:, block] = self.pool.k[:, last], self.pool.v[:, last]
            tail = [block]
        else:
            tail = []
        self.pool.share(full)
        out.blocks, out.length = full + tail, self.length
        return out

    def __del__(self) -> None:
        # A cache dropped without release() (tests, benchmarks) gives its blocks back.
        if getattr(self, "blocks", None):
            self.release()


def block_digests(tokens: np.ndarray, block_tokens: int) -> list[bytes]:
    """The digest of each full block of ``tokens`` (``[T]`` ints): SHA-256 of the previous
    block's digest and the block's tokens as int64, so that a digest names the whole prefix up to
    its block's end. ``T // block_tokens`` digests."""
    ids = np.ascontiguousarray(tokens, dtype=np.int64)
    digests, previous = [], b""
    for i in range(ids.size // block_tokens):
        previous = hashlib.sha256(previous + ids[i * block_tokens:(i + 1) * block_tokens].tobytes()).digest()
        digests.append(previous)
    return digests
