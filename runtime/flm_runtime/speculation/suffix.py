"""The suffix proposer: continuations seen in earlier requests of the engine, beside the draft and
prompt lookup (docs/dflash.md, "Suffix proposer: continuations of earlier requests").

After SuffixDecoding (Oliaro et al., arXiv:2411.04975). ``SuffixIndex`` is one engine's index of
the outputs of its recently finished requests (each after the end of its prompt:
``SpeculativeDecoder.finish``): a suffix trie of bounded depth (every suffix of every sequence,
cut at ``depth`` tokens), each node counting the occurrences of its path. ``propose`` finds the
longest suffix of a request's context that the index holds and follows the most frequent child,
each token with probability ``count(child) / count(node)``.

Bound: at most ``max_tokens`` tokens; adding a sequence evicts the oldest whole (their counts taken
back exactly: the index is then the index of the others), and a sequence longer than the cap keeps
its last ``max_tokens``. So at most ``depth * max_tokens`` nodes, of about 150-190 bytes; adding
or evicting a token costs O(``depth``) dict and array operations.

``SuffixProposer`` is one sequence's proposer over the engine's index (a ``retrieval.Retrieval``):
it keeps the sequence's last tokens and its own acceptance record; a token's confidence is the
smaller of its probability in the index and the record's acceptance rate.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from flm_runtime.outputs import confident_length
from flm_runtime.speculation.retrieval import NO_LOOKUP, AcceptanceRecord, Lookup

# Tokens on a trie path: the longest pattern matched plus the tokens proposed after it (a pattern
# of up to depth - most tokens, so that a K = 7 proposal follows a pattern of up to 9; a request
# proposes at most depth // 2, so that a block of 16 still matches patterns of 8).
DEPTH = 16
ROOT = 0
NONE = -1  # no node (an empty child list, no best child)


class SuffixIndex:
    """A bounded suffix trie over whole token sequences, oldest evicted first (module docstring).

    Node ``i`` stands for the token string on its path from the root; ``count[i]`` is how many
    times that string starts at a position of an indexed sequence (within ``depth`` tokens of the
    start; a string at a sequence's end has no child there, so the children's counts sum to at
    most the node's). Children are found through one dict keyed by ``(parent << 32) | token``;
    each node also keeps its children in a doubly linked list (to rescan them) and its best
    child: the largest count, the smallest token id on a tie, a rule that does not depend on the
    order of insertions, so that evicting a sequence leaves exactly the index of the others.

    Args:
        max_tokens: the cap on tokens indexed (``>= 1``).
        depth: ``DEPTH``, the longest path (``>= 2``).
    """

    def __init__(self, max_tokens: int, depth: int = DEPTH):
        assert max_tokens >= 1 and depth >= 2, f"max_tokens {max_tokens}, depth {depth}"
        self.max_tokens, self.depth = max_tokens, depth
        self._sequences: deque[tuple[int, ...]] = deque()  # oldest first
        self._tokens = 0
        self._child: dict[int, int] = {}  # (parent << 32) | token -> node
        # Per node (the root is node 0): its token, count, best child, first child, siblings.
        self._token, self._count, self._best = array("l", [NONE]), array("l", [0]), array("l", [NONE])
        self._first, self._prev, self._next = array("l", [NONE]), array("l", [NONE]), array("l", [NONE])
        self._free: list[int] = []  # freed node ids, reused first

    @property
    def tokens(self) -> int:
        """Tokens indexed (at most ``max_tokens``)."""
        return self._tokens

    @property
    def sequences(self) -> int:
        """Sequences indexed."""
        return len(self._sequences)

    @property
    def nodes(self) -> int:
        """Trie nodes, the root left out (at most ``depth * tokens``)."""
        return len(self._child)

    def add(self, ids: Iterable[int]) -> None:
        """Index a sequence (a finished request's output after its prompt's end), first evicting the oldest
        sequences until it fits; of a sequence longer than ``max_tokens`` its last
        ``max_tokens`` tokens. An empty sequence is ignored."""
        seq = tuple(int(t) for t in ids)[-self.max_tokens :]
        if not seq:
            return
        while self._tokens + len(seq) > self.max_tokens:
            old = self._sequences.popleft()
            self._tokens -= len(old)
            for i in range(len(old)):
                self._remove_path(old[i : i + self.depth])
        self._sequences.append(seq)
        self._tokens += len(seq)
        for i in range(len(seq)):
            self._add_path(seq[i : i + self.depth])

    def propose(self, context: Sequence[int], most: int) -> tuple[np.ndarray, int, np.ndarray]:
        """The most frequent continuation of the longest suffix of ``context`` that the index
        holds.

        The pattern is the longest suffix of ``context`` of at most ``depth - most`` tokens (so
        that ``most`` tokens fit below it) found in the trie, ``m`` tokens long (every suffix of an
        indexed string is indexed too, so the longest is found by bisection). From its node the
        proposal follows the best child (largest count, smallest token on a tie) for up to
        ``most`` tokens, stopping where a node has none; token ``j``'s probability is
        ``count(child) / count(node)`` of that edge.

        Args:
            context: the request's last tokens, ending at the anchor (only the last ``depth -
                most`` are read).
            most: tokens to propose at most (``1 <= most < depth``).
        Returns:
            ``(ids, m, probability)``: ``[g]`` int64 tokens (g <= most), the match length ``m``
            (0: no suffix of the context occurs, and g = 0), ``[g]`` float32 probabilities.
        """
        assert 1 <= most < self.depth, f"most {most} with depth {self.depth}"
        tail = [int(t) for t in context[max(len(context) - (self.depth - most), 0) :]]
        lo, hi, node = 0, len(tail), ROOT  # the suffix of lo tokens occurs (at node), of hi + 1 not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self._walk(tail[len(tail) - mid :])
            if found == NONE:
                hi = mid - 1
            else:
                lo, node = mid, found
        ids, probability = [], []
        while lo and len(ids) < most and (child := self._best[node]) != NONE:
            ids.append(self._token[child])
            probability.append(self._count[child] / self._count[node])
            node = child
        return np.array(ids, dtype=np.int64), lo, np.array(probability, dtype=np.float32)

    def _walk(self, path: list[int]) -> int:
        """The node of ``path`` (from the root), or ``NONE``."""
        node = ROOT
        for token in path:
            node = self._child.get((node << 32) | token, NONE)
            if node == NONE:
                break
        return node

    def _add_path(self, path: tuple[int, ...]) -> None:
        """One more occurrence of every prefix of ``path``: counts up, nodes made as needed."""
        children, count, best = self._child, self._count, self._best  # the hot loop's, bound once
        parent = ROOT
        for token in path:
            key = (parent << 32) | token
            node = children.get(key, NONE)
            if node == NONE:
                node = children[key] = self._new_node(parent, token)
            count[node] += 1
            if parent != ROOT:  # the root's best child is never asked for
                b = best[parent]
                if b == NONE or self._beats(node, b):
                    best[parent] = node
            parent = node

    def _remove_path(self, path: tuple[int, ...]) -> None:
        """One occurrence fewer of every prefix of ``path`` (added before): counts down, and a
        node that reaches 0 freed (its one child left, if any, is the next on the path, which
        reaches 0 too: the children's counts sum to at most the node's)."""
        parent = ROOT
        for token in path:
            key = (parent << 32) | token
            node = self._child[key]
            self._count[node] -= 1
            if not self._count[node]:
                del self._child[key]
                self._unlink(parent, node)
            if parent != ROOT and self._best[parent] == node:  # it may have lost its place
                self._best[parent] = self._best_child(parent)
            parent = node

    def _beats(self, a: int, b: int) -> bool:
        """Node ``a`` ranks above its sibling ``b``: a larger count, or equal and a smaller token."""
        return (self._count[a], -self._token[a]) > (self._count[b], -self._token[b])

    def _best_child(self, parent: int) -> int:
        """The best of ``parent``'s children by a scan of its list; ``NONE`` without one."""
        best, child = NONE, self._first[parent]
        while child != NONE:
            if best == NONE or self._beats(child, best):
                best = child
            child = self._next[child]
        return best

    def _new_node(self, parent: int, token: int) -> int:
        """A node of count 0 for ``token`` under ``parent``, first in its list of children."""
        if self._free:
            node = self._free.pop()
            self._token[node], self._count[node], self._best[node] = token, 0, NONE
            self._first[node], self._prev[node], self._next[node] = NONE, NONE, self._first[parent]
        else:
            node = len(self._token)
            for column, value in ((self._token, token), (self._count, 0), (self._best, NONE), (self._first, NONE),
                                  (self._prev, NONE), (self._next, self._first[parent])):
                column.append(value)
        if self._first[parent] != NONE:
            self._prev[self._first[parent]] = node
        self._first[parent] = node
        return node

    def _unlink(self, parent: int, node: int) -> None:
        """Take ``node`` (count 0, no children) out of ``parent``'s list and free its id."""
        prev, nxt = self._prev[node], self._next[node]
        if prev == NONE:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if nxt != NONE:
            self._prev[nxt] = prev
        self._free.append(node)


class SuffixProposer:
    """One sequence's suffix proposer over the engine's ``SuffixIndex`` (module docstring).

    Args:
        index: the engine's index, shared by every sequence of the engine (not copied).
    """

    name = "suffix"

    def __init__(self, index: SuffixIndex):
        self.index = index
        self._length = 0
        self._tail: deque[int] = deque(maxlen=index.depth)  # the last tokens: the longest pattern is shorter
        self._record = AcceptanceRecord()

    def __len__(self) -> int:
        """Tokens the sequence's target cache holds (positions ``0 .. len-1``)."""
        return self._length

    def copy(self) -> SuffixProposer:
        """An independent proposer over the same index, with the same last tokens and record."""
        twin = SuffixProposer(self.index)
        twin._length, twin._tail, twin._record = self._length, self._tail.copy(), dataclasses.replace(self._record)
        return twin

    def extend(self, ids: Iterable[int]) -> None:
        """Tokens the target cache now holds (a prompt chunk, a step's kept rows)."""
        ids = [int(t) for t in ids]
        self._tail.extend(ids)
        self._length += len(ids)

    def find(self, anchor_id: int, most: int, min_confidence: float) -> Lookup:
        """The index's proposal after the sequence's last tokens and ``anchor_id``
        (``SuffixIndex.propose``, at most ``depth // 2`` tokens: the rest of a trie path is left to
        the pattern, which a longer proposal would shorten to a token or two and so match
        anywhere), each token's confidence the
        smaller of its probability and the record's rate, cut by ``confident_length(confidence,
        min_confidence)``.

        Returns:
            the ``Lookup`` (``match``: the matched suffix's length); ``NO_LOOKUP`` when nothing
            matches, ``most`` is 0 or the gate keeps nothing.
        """
        if most <= 0:
            return NO_LOOKUP
        ids, match, probability = self.index.propose([*self._tail, anchor_id], min(most, self.index.depth // 2))
        confidence = np.minimum(probability, np.float32(self._record.rate))
        kept = confident_length(confidence, min_confidence)
        if not kept:
            return NO_LOOKUP
        return Lookup(ids[:kept], match, confidence[:kept])

    def observe(self, lookup: Lookup | None, kept: list[int]) -> None:
        """Score ``lookup`` against the tokens the step kept (``AcceptanceRecord.observe``); None
        or a ``NO_LOOKUP`` records nothing."""
        if lookup is not None and lookup.match:
            self._record.observe(lookup.ids, kept)

    @property
    def rate(self) -> float:
        """The record's acceptance rate of a proposed token."""
        return self._record.rate
