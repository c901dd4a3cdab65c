"""Retrieval proposers: the one interface of the proposers that copy tokens instead of running a
model (prompt lookup, ``ngram.py``; the suffix proposer, ``suffix.py``), their proposal and their
acceptance record.

A retrieval proposer is one sequence's (``SpecState.proposers``): it is told the tokens its
target KV cache holds (``extend``, in step with the cache: ``len(proposer) == cache.length``),
proposes tokens after the anchor with a confidence per token (``find``: a ``Lookup``), and scores
each of its proposals against the tokens the step kept (``observe``), verified or not. The
confidence is what the draft's softmax probability is to the draft's tokens: the chance that the
token is accepted once those before it were, so the same gate (``outputs.confident_length``) and
the same expected-accepted figure (``outputs.expected_accepted``) compare every proposal of a step
(``speculative.choose``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from flm_runtime.outputs import expected_accepted

# Each observed proposal scales the earlier counts by this: a record follows about the last 16
# proposals (the text may change from copying to free writing), as the policy's tracker does.
DECAY = 15 / 16
# A record's prior, in tokens: one accepted out of two compared (rate 0.5), soon outweighed by the
# request's own proposals.
PRIOR_ACCEPTED, PRIOR_COMPARED = 1.0, 2.0


class Lookup(NamedTuple):
    """One step's proposal of a retrieval proposer.

    Attributes:
        ids: ``[g]`` int64 proposed tokens after the confidence gate (g = 0: none).
        match: the length of the context matched to find them (0: no match).
        confidence: ``[g]`` float32, the confidence in each token.
    """

    ids: np.ndarray
    match: int
    confidence: np.ndarray

    @property
    def expected(self) -> float:
        """The expected accepted tokens of ``ids`` (``outputs.expected_accepted`` of their
        confidence), 0.0 without ids."""
        return expected_accepted(self.confidence)


NO_LOOKUP = Lookup(np.zeros(0, dtype=np.int64), 0, np.zeros(0, dtype=np.float32))


def common_prefix(proposed: np.ndarray, kept: list[int]) -> int:
    """How many leading tokens of ``proposed`` equal those of ``kept``."""
    n = min(len(proposed), len(kept))
    differ = np.flatnonzero(np.asarray(proposed[:n]) != np.asarray(kept[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


@dataclass
class AcceptanceRecord:
    """How often a proposer's tokens were accepted in this request: decayed counts of proposed
    tokens accepted and compared, from the prior (``PRIOR_ACCEPTED`` of ``PRIOR_COMPARED``)."""

    accepted: float = PRIOR_ACCEPTED
    compared: float = PRIOR_COMPARED

    @property
    def rate(self) -> float:
        """Accepted over compared: the chance that a proposed token is accepted."""
        return self.accepted / self.compared

    def observe(self, proposed: np.ndarray, kept: list[int]) -> None:
        """Score ``proposed`` against the tokens the step kept (its accepted tokens and the
        bonus): whether it was verified or not, its first ``a = common_prefix`` tokens would have
        been accepted (the verifier's draws do not depend on the proposal), then a rejected one
        unless all compared tokens matched (all proposed, or all kept: the rest is unknown)."""
        accepted = common_prefix(proposed, kept)
        compared = accepted + (accepted < min(len(proposed), len(kept)))
        self.accepted = DECAY * self.accepted + accepted
        self.compared = DECAY * self.compared + compared


class Retrieval(Protocol):
    """One sequence's retrieval proposer (module docstring).

    Attributes:
        name: the proposer's name in the stats (``SpecStats.counts``) and in
            ``StepRecord.proposer``: ``"ngram"``, ``"suffix"``.
    """

    name: str

    def __len__(self) -> int:
        """Tokens it was told of (the target cache's length)."""

    def extend(self, ids: Iterable[int]) -> None:
        """Tokens the target cache now holds (a prompt chunk, a step's kept rows)."""

    def find(self, anchor_id: int, most: int, min_confidence: float) -> Lookup:
        """Its proposal of at most ``most`` tokens after ``anchor_id`` (the token at position
        ``len(self)``), cut by ``confident_length(confidence, min_confidence)``; ``NO_LOOKUP``
        when it has none."""

    def observe(self, lookup: Lookup | None, kept: list[int]) -> None:
        """Score its proposal of the step against the tokens the step kept; None or a
        ``NO_LOOKUP`` records nothing."""

    def copy(self) -> Retrieval:
        """An independent proposer with the same tokens and record (a request's ``n`` choices)."""
