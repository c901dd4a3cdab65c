"""Prefix caching: the KV caches of finished sequences, kept so that a later prompt that starts
with the same tokens does not compute them again.

LiteLLM is stateless: a chat client, an agent or a RAG app resends the whole conversation every
turn, and requests share system prompts and tool definitions. When a sequence ends, its cache
and the tokens it holds (the prompt and the generated tokens fed back, ``length`` positions) are
kept here; a new request takes a copy of the longest prefix any kept cache shares with its prompt
and prefills only the rest, as vLLM's automatic prefix caching and llama-server's
``cache_prompt`` do. A position's keys and values depend only on the tokens up to it, and the
quantized path computes a row the same bits whatever rows run beside it (docs/design.md, "Batch
invariance"), so a request served from the cache gets the logits it gets cold, bit for bit. At
least the prompt's last token is always computed (its logits give the first token).

The kept caches live in the engine's KV budget: they use what the running sequences leave, and the
least recently used go first when a request needs the room (``evict_to``). Copies are taken, not
the kept caches themselves, so that one prefix serves any number of requests at once.

This is the contiguous-cache form of the design; the paged KV pool will keep blocks keyed by the
hash of their tokens instead of whole caches, with the same contract.
"""

from __future__ import annotations

import collections

import numpy as np


class PrefixCache:
    """Finished sequences' KV caches by the tokens they hold (module docstring).

    Not thread-safe: the engine calls it with its lock held.
    """

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[int, tuple[np.ndarray, object]] = collections.OrderedDict()
        self._next_key = 0

    @property
    def nbytes(self) -> int:
        """Bytes the kept caches hold."""
        return sum(cache.nbytes for _, cache in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, prompt_ids: np.ndarray, capacity: int):
        """A new cache holding the longest prefix of ``prompt_ids`` a kept cache holds (but never
        the last prompt token), with room for ``capacity`` positions, and that prefix's length;
        ``(None, 0)`` when no kept cache shares one."""
        best, length = None, 0
        for key, (tokens, _) in self._kept.items():
            shared = _shared_prefix(tokens, prompt_ids[:-1])
            if shared > length:
                best, length = key, shared
        if best is None:
            return None, 0
        self._kept.move_to_end(best)
        return self._kept[best][1].copy_prefix(length, capacity), length

    def keep(self, tokens: np.ndarray, cache) -> None:
        """Keep ``cache``, which holds ``tokens`` (``[cache.length]`` int). A kept cache whose
        tokens are a prefix of these (the previous turn of the same chat) is dropped; nothing is
        kept when a kept cache already holds these tokens and more."""
        for key, (kept, _) in list(self._kept.items()):
            if _shared_prefix(kept, tokens) == min(kept.size, tokens.size):
                if kept.size >= tokens.size:
                    self._kept.move_to_end(key)
                    return
                del self._kept[key]
        self._kept[self._next_key] = (tokens, cache)
        self._next_key += 1

    def evict_to(self, nbytes: int) -> None:
        """Drop the least recently used caches until the rest hold at most ``nbytes``."""
        held = self.nbytes
        while self._kept and held > nbytes:
            held -= self._kept.popitem(last=False)[1][1].nbytes

    def clear(self) -> None:
        self._kept.clear()


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of the token arrays ``a`` and ``b``."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
