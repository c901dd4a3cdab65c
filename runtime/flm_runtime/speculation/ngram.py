"""Prompt lookup: an n-gram proposer for text that copies its context (summaries, code edits,
quotes), beside the DFlash draft.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's
``ngram`` proposer, its ``prompt_lookup_max`` / ``prompt_lookup_min``): the last ``n`` tokens of
the sequence (ending at the anchor) are looked up among its earlier tokens, prompt and output
alike, and the tokens that followed their most recent earlier occurrence are proposed. No model
runs, so a proposal costs only verify rows; ``SpeculativeDecoder.prepare`` verifies it instead of
the draft's when it expects it to keep more tokens, and alone, without the draft, where the policy
plans a plain step and the proposal is expected to pay for its rows (an n-gram-only step;
docs/dflash.md, "Prompt lookup").

``PromptLookup`` is one sequence's proposer: an index of the tokens its target KV cache holds
(``extend``, kept in step with the cache: ``len(lookup) == cache.length``), the lookup
(``find``), and the per-request record of how often its proposals were accepted (``observe``),
from which a proposal gets a confidence per token as the draft's does (its softmax probability),
so the same confidence gate and the same expected-accepted figure apply to every proposer.

Match lengths: ``n`` from ``MAX_MATCH`` = 4 down to ``MIN_MATCH`` = 2, the longest that occurs
(a longer match is a more specific context, so its continuation is likelier the text's; vLLM's
n-gram example sets ``prompt_lookup_max`` 4). A 1-token match is left out: in free text the last
token alone recurs often and what followed it says little. Our choice, not a tuned value.

Cost: ``extend`` indexes each new token once per ``n`` (dict inserts; a prompt of 8k tokens in a
few milliseconds, in C through ``dict.update``), ``find`` does one dict look-up per ``n`` and
copies at most K tokens: microseconds, whatever the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from flm_runtime.outputs import confident_length
from flm_runtime.speculation.retrieval import NO_LOOKUP, AcceptanceRecord, Lookup

MAX_MATCH, MIN_MATCH = 4, 2  # n-gram lengths looked up, longest first (module docstring)


class PromptLookup:
    """One sequence's n-gram proposer (a ``retrieval.Retrieval``): its tokens, indexed, and its
    acceptance record per match length.

    Args:
        max_match, min_match: the n-gram lengths looked up, longest first (``MAX_MATCH``,
            ``MIN_MATCH``); ``1 <= min_match <= max_match``.
    """

    name = "ngram"

    def __init__(self, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH):
        assert 1 <= min_match <= max_match, f"match lengths {min_match} .. {max_match}"
        self.max_match, self.min_match = max_match, min_match
        self._tokens: list[int] = []
        # _last[n]: n-gram (tuple of ids) -> position of its last token, the most recent occurrence
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._lengths()}
        self._records = {n: AcceptanceRecord() for n in self._lengths()}

    def __len__(self) -> int:
        """Tokens indexed (the target cache's length, positions ``0 .. len-1``)."""
        return len(self._tokens)

    def copy(self) -> PromptLookup:
        """An independent proposer with the same tokens and record (a request's ``n`` choices)."""
        twin = PromptLookup(self.max_match, self.min_match)
        twin._tokens = list(self._tokens)
        twin._last = {n: dict(d) for n, d in self._last.items()}
        twin._records = {n: dataclasses.replace(r) for n, r in self._records.items()}
        return twin

    def extend(self, ids: Iterable[int]) -> None:
        """Append tokens the target cache now holds (a prompt chunk, a step's kept rows) and index
        every n-gram that ends in them (a later occurrence replaces an earlier one)."""
        tokens = self._tokens
        old = len(tokens)
        tokens.extend(int(t) for t in ids)
        end = len(tokens)
        for n, last in self._last.items():
            first = max(old - n + 1, 0)  # the first n-gram start with its end among the new tokens
            columns = [tokens[first + i : end - n + 1 + i] for i in range(n)]
            last.update(zip(zip(*columns), range(first + n - 1, end)))

    def find(self, anchor_id: int, most: int, min_confidence: float) -> Lookup:
        """The n-gram proposal after ``anchor_id`` (the token at position ``len(self)``, not yet
        indexed).

        For ``n = max_match .. min_match``: the query is the last ``n - 1`` indexed tokens and the
        anchor; at its most recent occurrence among the indexed tokens (ending at position ``e <
        len(self)``) the proposal is the ``most`` tokens from ``e + 1`` on, copied as LZ77 copies
        (a copy that reaches the anchor goes on with the tokens it has just proposed, so a
        repeating run of period ``len(self) - e`` is proposed ``most`` tokens long). The longest
        ``n`` with a match wins. Each proposed token gets the record's acceptance rate for ``n``
        as its confidence, and the proposal keeps ``confident_length(confidence,
        min_confidence)`` tokens.

        Returns:
            the ``Lookup`` (``NO_LOOKUP`` when no n-gram matches, ``most`` is 0 or the gate
            keeps nothing).
        """
        tokens, length = self._tokens, len(self._tokens)
        if most <= 0:
            return NO_LOOKUP
        for n in self._lengths():
            if length < n:  # a query of n tokens needs one earlier occurrence
                continue
            end = self._last[n].get((*tokens[length - n + 1 :], anchor_id))
            if end is None:
                continue
            source = tokens[end + 1 : end + 1 + most]  # what followed the occurrence
            if len(source) < most:  # it reaches the anchor: one period of a repeating run
                source.append(anchor_id)
            confidence = np.full(most, self.rate(n), dtype=np.float32)
            kept = confident_length(confidence, min_confidence)
            if not kept:
                return NO_LOOKUP
            ids = np.array([source[i % len(source)] for i in range(kept)], dtype=np.int64)
            return Lookup(ids, n, confidence[:kept])
        return NO_LOOKUP

    def observe(self, lookup: Lookup | None, kept: list[int]) -> None:
        """Score ``lookup`` against the tokens the step kept (``AcceptanceRecord.observe``), in
        the record of its match length; None or a ``NO_LOOKUP`` records nothing."""
        if lookup is not None and lookup.match:
            self._records[lookup.match].observe(lookup.ids, kept)

    def rate(self, match: int) -> float:
        """The record's acceptance rate of a proposed token after a ``match``-token match."""
        return self._records[match].rate

    def _lengths(self) -> range:
        return range(self.max_match, self.min_match - 1, -1)
