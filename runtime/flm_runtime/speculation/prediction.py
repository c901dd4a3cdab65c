"""The prediction proposer: a request's predicted output (OpenAI's predicted outputs, the
``prediction`` parameter) as a retrieval proposer.

An editor that asks for a file rewritten sends the file as the prediction: most of the answer
repeats it. The proposer keeps a cursor, where in the prediction the output has got to, and
proposes what follows it; where the output leaves the prediction (an edit), it finds its way back
by n-gram matching as prompt lookup does (``ngram.py``), preferring the first occurrence at or
after the cursor, since an edited file is written top to bottom. Its tokens are verified as any
proposal's (``speculative.choose``): a prediction is never trusted, so a wrong one costs verify
rows, never a wrong token.

Matching, at each step, from the anchor (the token at position ``len(proposer)``):

- *aligned*: the anchor equals the prediction's token at the cursor: propose what follows it
  (match length 1, which in the prediction's own order is specific where a 1-token match anywhere
  is not);
- else the last ``n - 1`` tokens and the anchor, ``n`` from ``MAX_MATCH`` down to ``MIN_MATCH``
  (prompt lookup's lengths), looked up among the prediction's n-grams.

Each match length keeps its own acceptance record (``retrieval.AcceptanceRecord``), whose rate is
the confidence of every token it proposes, as prompt lookup's.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from flm_runtime.outputs import confident_length
from flm_runtime.speculation.ngram import MAX_MATCH, MIN_MATCH
from flm_runtime.speculation.retrieval import NO_LOOKUP, AcceptanceRecord, Lookup, common_prefix

ALIGNED = 1  # the match length of an aligned proposal (module docstring)


class PredictionLookup:
    """One sequence's prediction proposer (a ``retrieval.Retrieval``; module docstring).

    Args:
        prediction: the predicted output's token ids, non-empty.
    """

    name = "prediction"

    def __init__(self, prediction: Sequence[int]):
        assert len(prediction), "an empty prediction proposes nothing"
        self._prediction = np.asarray(prediction, dtype=np.int64)
        # _starts[n]: n-gram -> ascending positions of its last token in the prediction (shared by copies)
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(MAX_MATCH, MIN_MATCH - 1, -1)}
        ids = self._prediction.tolist()
        for n, index in self._starts.items():
            for end in range(n - 1, len(ids)):
                index.setdefault(tuple(ids[end - n + 1 : end + 1]), []).append(end)
        self._length = 0
        self._tail: deque[int] = deque(maxlen=MAX_MATCH - 1)  # the last tokens before the anchor
        self._cursor = 0  # the prediction's position the output is expected to write next
        self._records = {n: AcceptanceRecord() for n in (ALIGNED, *self._starts)}
        self._proposed: tuple[np.ndarray, int] | None = None  # the last proposal's ids and their first position

    def __len__(self) -> int:
        """Tokens the sequence's target cache holds (positions ``0 .. len-1``)."""
        return self._length

    def copy(self) -> PredictionLookup:
        """An independent proposer with the same prediction (shared), cursor and records."""
        twin = object.__new__(PredictionLookup)
        twin._prediction, twin._starts = self._prediction, self._starts
        twin._length, twin._tail, twin._cursor = self._length, self._tail.copy(), self._cursor
        twin._records = {n: dataclasses.replace(r) for n, r in self._records.items()}
        twin._proposed = self._proposed
        return twin

    def extend(self, ids: Iterable[int]) -> None:
        """Tokens the target cache now holds (a prompt chunk, a step's kept rows)."""
        ids = [int(t) for t in ids]
        self._tail.extend(ids)
        self._length += len(ids)

    def find(self, anchor_id: int, most: int, min_confidence: float) -> Lookup:
        """The prediction's tokens after ``anchor_id`` (module docstring), at most ``most``, each
        with its match length's acceptance rate as confidence, cut by ``confident_length``.

        Returns:
            the ``Lookup`` (``match``: 1 aligned, else the n-gram's length); ``NO_LOOKUP`` when
            nothing matches, the match ends the prediction, ``most`` is 0 or the gate keeps
            nothing.
        """
        self._proposed = None
        if most <= 0:
            return NO_LOOKUP
        found = self._match(anchor_id)
        if found is None:
            return NO_LOOKUP
        match, start = found
        confidence = np.full(min(most, len(self._prediction) - start), self._records[match].rate, dtype=np.float32)
        kept = confident_length(confidence, min_confidence)
        if not kept:
            return NO_LOOKUP
        ids = self._prediction[start : start + kept]
        self._proposed = (ids, start)
        return Lookup(ids, match, confidence[:kept])

    def observe(self, lookup: Lookup | None, kept: list[int]) -> None:
        """Score ``lookup`` against the tokens the step kept, in its match length's record, and
        move the cursor past the tokens of it that the output repeated; None or a ``NO_LOOKUP``
        records nothing."""
        if lookup is None or not lookup.match:
            return
        self._records[lookup.match].observe(lookup.ids, kept)
        if self._proposed is not None and self._proposed[0] is lookup.ids:
            self._cursor = self._proposed[1] + common_prefix(lookup.ids, kept)

    def _match(self, anchor_id: int) -> tuple[int, int] | None:
        """``(match length, first proposed position)`` of the step's match, None without one."""
        ids, cursor = self._prediction, self._cursor
        if cursor + 1 < len(ids) and ids[cursor] == anchor_id:
            return ALIGNED, cursor + 1
        tail = list(self._tail)
        for n, index in self._starts.items():
            if len(tail) < n - 1:
                continue
            ends = index.get((*tail[len(tail) - n + 1 :], anchor_id))
            if not ends:
                continue
            at = bisect.bisect_left(ends, cursor)  # the first occurrence ending at or after the cursor
            end = ends[at] if at < len(ends) else ends[-1]
            if end + 1 < len(ids):
                return n, end + 1
        return None
