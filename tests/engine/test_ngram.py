"""The prompt-lookup (n-gram) proposer on hand-made token histories: what it proposes, which match
wins, its gate and expected figure, and its acceptance record."""

from __future__ import annotations

import numpy as np
import pytest

from flm_runtime.speculation.ngram import PromptLookup
from flm_runtime.speculation.retrieval import DECAY, NO_LOOKUP


def lookup_of(tokens: list[int], chunks: int = 1) -> PromptLookup:
    """A proposer over ``tokens``, fed in ``chunks`` pieces."""
    out = PromptLookup()
    for piece in np.array_split(np.array(tokens, dtype=np.int64), chunks):
        out.extend(piece)
    assert len(out) == len(tokens)
    return out


def proposed(tokens: list[int], anchor: int, most: int = 7) -> tuple[list[int], int]:
    got = lookup_of(tokens).find(anchor, most, 0.0)
    return got.ids.tolist(), got.match


def test_proposes_what_followed_the_match():
    # (11, 12, 13) ends at position 3; the 4-gram (20, 11, 12, 13) occurs nowhere earlier.
    assert proposed([10, 11, 12, 13, 14, 15, 16, 17, 20, 11, 12], 13) == ([14, 15, 16, 17, 20, 11, 12], 3)
    assert proposed([10, 11, 12, 13, 14, 15, 16, 17, 20, 11, 12], 13, most=2) == ([14, 15], 3)


def test_the_most_recent_occurrence_wins():
    # (5, 6) ends at positions 1 and 4: the later one's continuation, up to the anchor.
    assert proposed([5, 6, 7, 5, 6, 8, 9, 5], 6, most=3) == ([8, 9, 5], 2)


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # (2, 3, 4) ends at 3; (3, 4) also ends at 6, later, but is shorter.
    assert proposed([1, 2, 3, 4, 9, 3, 4, 8, 2, 3], 4, most=3) == ([9, 3, 4], 3)


def test_a_copy_that_reaches_the_anchor_repeats_the_run():
    # (7, 8, 7, 8) ends at 3: what follows is 7, then the anchor 8, then the copy goes on.
    assert proposed([7, 8, 7, 8, 7], 8, most=5) == ([7, 8, 7, 8, 7], 4)
    assert proposed([3, 3, 3], 3, most=4) == ([3, 3, 3, 3], 3)


@pytest.mark.parametrize("tokens, anchor", [([1, 2, 3, 4], 5), ([1, 2, 3, 4], 1), ([], 1), ([9], 9)])
def test_no_match_proposes_nothing(tokens, anchor):
    """No earlier n-gram of 2 or more tokens ends with the anchor (a 1-token match does not count)."""
    assert lookup_of(tokens).find(anchor, 7, 0.0) is NO_LOOKUP
    assert lookup_of([1, 2, 1, 2]).find(1, 0, 0.0) is NO_LOOKUP  # nothing to propose


def test_extending_by_chunks_indexes_as_extending_at_once():
    tokens = np.random.default_rng(0).integers(0, 6, 200).tolist()  # a small vocabulary: many matches
    whole, chunked = lookup_of(tokens), lookup_of(tokens, chunks=13)
    for anchor in range(6):
        a, b = whole.find(anchor, 7, 0.0), chunked.find(anchor, 7, 0.0)
        assert a.ids.tolist() == b.ids.tolist() and a.match == b.match > 0


def test_gate_and_expected_accepted_follow_the_rate():
    """The prior rate 0.5 for every token: a gate of 0.2 keeps 2 (0.5, 0.25 >= 0.2 > 0.125),
    expected accepted 0.5 + 0.25; a gate over 0.5 keeps none."""
    history = lookup_of([1, 2, 3, 4, 5, 6, 1])
    got = history.find(2, 4, 0.2)
    assert (got.ids.tolist(), got.match, got.expected) == ([3, 4], 2, 0.75)
    assert history.find(2, 4, 0.6) is NO_LOOKUP


def test_observe_counts_accepted_and_rejected_tokens_per_match_length():
    history = lookup_of([1, 2, 3, 4, 5, 6, 1])
    lookup = history.find(2, 4, 0.0)  # [3, 4, 5, 6], match 2
    history.observe(lookup, [3, 4, 9])    # 2 accepted, the third rejected: 3 compared
    assert history.rate(2) == pytest.approx((DECAY * 1 + 2) / (DECAY * 2 + 3))
    assert history.rate(3) == 0.5         # another match length: untouched
    history.observe(lookup, [3])          # all compared tokens kept: 1 accepted, nothing rejected
    assert history.rate(2) == pytest.approx((DECAY * (DECAY * 1 + 2) + 1) / (DECAY * (DECAY * 2 + 3) + 1))
    before = history.rate(2)
    history.observe(NO_LOOKUP, [7])
    assert history.rate(2) == before


def test_copy_is_independent():
    history = lookup_of([1, 2, 3, 1])
    twin = history.copy()
    twin.observe(twin.find(2, 2, 0.0), [9])  # [3, 1] proposed, the first rejected
    twin.extend([2, 7, 1])
    assert len(history) == 4 and history.rate(2) == 0.5 and twin.rate(2) < 0.5
    assert history.find(2, 1, 0.0).ids.tolist() == [3] and twin.find(2, 1, 0.0).ids.tolist() == [7]
