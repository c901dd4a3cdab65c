"""The suffix proposer on hand-made token sequences: the engine-wide index (longest match, most
frequent continuation, its tie rule, probabilities, eviction, the cap), the per-request proposer
(confidence, record, copies) and its setting."""

from __future__ import annotations

import numpy as np
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.settings import SUFFIX_CACHE_TOKENS, Settings
from flm_runtime.speculation.retrieval import DECAY, NO_LOOKUP
from flm_runtime.speculation.suffix import SuffixIndex, SuffixProposer


def index_of(*sequences: list[int], max_tokens: int = 1000, depth: int = 16) -> SuffixIndex:
    out = SuffixIndex(max_tokens, depth)
    for seq in sequences:
        out.add(seq)
    return out


def proposed(index: SuffixIndex, context: list[int], most: int = 7) -> tuple[list[int], int, list[float]]:
    ids, match, probability = index.propose(context, most)
    return ids.tolist(), match, probability.tolist()


def test_proposes_the_most_frequent_continuation_of_the_longest_match():
    index = index_of([1, 2, 3, 4, 5], [1, 2, 3, 9], [8, 2, 3, 4])
    # (7, 1, 2) occurs nowhere, (1, 2) twice: 3 followed it both times, then 4 and 9 once each
    # (a tie: the smaller token), then 5 followed (1, 2, 3, 4) its one time.
    assert proposed(index, [7, 1, 2]) == ([3, 4, 5], 2, [1.0, 0.5, 1.0])
    # (2, 3) occurs three times: 4 followed it twice, 9 once; (2, 3, 4) twice, 5 followed once
    # (the other ends its sequence).
    assert proposed(index, [6, 2, 3]) == ([4, 5], 2, pytest.approx([2 / 3, 1 / 2]))
    assert proposed(index, [6, 2, 3], most=1) == ([4], 2, pytest.approx([2 / 3]))


def test_a_longer_match_wins_over_a_more_frequent_shorter_one():
    index = index_of([5, 1, 7], [1, 8], [1, 8], [1, 8])
    assert proposed(index, [5, 1]) == ([7], 2, [1.0])
    assert proposed(index, [6, 1]) == ([8], 1, [0.75])


def test_a_tie_goes_to_the_smaller_token_whatever_the_order():
    assert proposed(index_of([4, 9], [4, 3]), [4])[0] == proposed(index_of([4, 3], [4, 9]), [4])[0] == [3]
    assert proposed(index_of([4, 9], [4, 3], [4, 9]), [4]) == ([9], 1, pytest.approx([2 / 3]))


@pytest.mark.parametrize("context", [[], [42], [1, 2, 42]])
def test_no_match_proposes_nothing(context):
    ids, match, probability = index_of([1, 2, 3]).propose(context, 7)
    assert (ids.shape, match, probability.shape) == ((0,), 0, (0,))
    assert ids.dtype == np.int64 and probability.dtype == np.float32


def test_the_pattern_leaves_room_for_the_proposal_within_the_depth():
    index = index_of(list(range(10, 30)), depth=6)
    # At most 6 - 2 = 4 context tokens are matched, so that 2 fit below them.
    assert proposed(index, list(range(10, 20)), most=2) == ([20, 21], 4, [1.0, 1.0])
    assert proposed(index, list(range(10, 20)), most=5) == ([20, 21, 22, 23, 24], 1, [1.0] * 5)
    # The proposal stops at the sequence's end.
    assert proposed(index, [27, 28], most=4) == ([29], 2, [1.0])


def test_a_sequence_longer_than_the_cap_keeps_its_last_tokens():
    index = index_of(list(range(20)), max_tokens=8)
    assert (index.tokens, index.sequences) == (8, 1)
    assert proposed(index, [12], most=3) == ([13, 14, 15], 1, [1.0] * 3)
    assert proposed(index, [11], most=3)[1] == 0  # before the kept tail


def test_the_cap_evicts_the_oldest_sequences_whole():
    index = index_of([1, 2, 3], [4, 5, 6], max_tokens=7)
    index.add([7, 8])  # 3 + 3 + 2 > 7: [1, 2, 3] goes
    assert (index.tokens, index.sequences) == (5, 2)
    assert proposed(index, [1])[1] == 0 and proposed(index, [4]) == ([5, 6], 1, [1.0, 1.0])
    index.add(list(range(100, 107)))  # 7 tokens: all the others go
    assert (index.tokens, index.sequences, index.nodes) == (7, 1, index_of(list(range(100, 107))).nodes)


def all_answers(index: SuffixIndex, contexts: list[list[int]]) -> list:
    return [proposed(index, c, most) for c in contexts for most in range(1, index.depth)]


def test_eviction_leaves_exactly_the_index_of_the_rest():
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 5, n).tolist() for n in (60, 50, 40))  # 5 tokens: many branches and ties
    evicted = index_of(a, b, max_tokens=110, depth=8)
    evicted.add(c)  # 110 + 40 > 110: a goes
    fresh = index_of(b, c, depth=8)
    assert (evicted.tokens, evicted.sequences, evicted.nodes) == (fresh.tokens, fresh.sequences, fresh.nodes) == (
        90, 2, fresh.nodes)
    contexts = [s[:i] for s in (a, b, c) for i in range(1, len(s) + 1)]
    assert all_answers(evicted, contexts) == all_answers(fresh, contexts)
    assert any(len(answer[0]) == 7 and min(answer[2]) < 1.0 for answer in all_answers(fresh, contexts))


def test_the_trie_stays_within_its_node_bound():
    rng = np.random.default_rng(1)
    index = SuffixIndex(300, depth=8)
    for n in rng.integers(1, 120, 40):
        index.add(rng.integers(0, 1000, n).tolist())
        assert index.tokens <= 300 and index.nodes <= 8 * index.tokens


# ---- the per-request proposer ---------------------------------------------------------------------

def proposer_after(index: SuffixIndex, tokens: list[int]) -> SuffixProposer:
    out = SuffixProposer(index)
    out.extend(tokens)
    assert len(out) == len(tokens)
    return out


def test_a_proposal_leaves_half_the_depth_to_its_pattern():
    """A block of 16 may take 15 tokens, but the proposer asks the index for depth // 2 = 8, so
    the pattern may still be 8 tokens long: after (1 .. 8) the continuation of that context
    (100 ..), not of the last token alone (8 was last followed by 200 ..)."""
    first = list(range(1, 9)) + list(range(100, 120))
    index = index_of(first, [8] + list(range(200, 220)), [8] + list(range(200, 220)))
    got = proposer_after(index, list(range(1, 8))).find(8, 15, 0.0)
    assert (got.ids.tolist(), got.match) == (list(range(100, 108)), 8)


def test_the_proposer_matches_its_last_tokens_and_the_anchor():
    """Its tokens (7, 1) and the anchor 2: the index's proposal after (1, 2), each token's
    confidence the smaller of its probability (1, 0.5, 1) and the prior rate 0.5, cut by the
    gate (cumulative 0.5, 0.25, 0.125)."""
    index = index_of([1, 2, 3, 4, 5], [1, 2, 3, 9])
    proposer = proposer_after(index, [7, 1])
    got = proposer.find(2, 3, 0.0)
    assert (got.ids.tolist(), got.match, got.confidence.tolist()) == ([3, 4, 5], 2, [0.5, 0.5, 0.5])
    assert got.ids.dtype == np.int64 and got.confidence.dtype == np.float32
    assert proposer.find(2, 3, 0.3).ids.tolist() == [3]
    assert proposer.find(2, 3, 0.6) is NO_LOOKUP and proposer.find(2, 0, 0.0) is NO_LOOKUP
    assert proposer.find(42, 3, 0.0) is NO_LOOKUP  # no suffix ending at 42 occurs


def test_the_record_raises_the_confidence_up_to_the_index_probability():
    index = index_of([1, 2, 3, 4, 5], [1, 2, 3, 9])
    proposer = proposer_after(index, [7, 1])
    proposer.observe(proposer.find(2, 3, 0.0), [3, 4, 5, 6])  # all 3 accepted
    rate = (DECAY * 1 + 3) / (DECAY * 2 + 3)
    assert proposer.rate == pytest.approx(rate)
    assert proposer.find(2, 3, 0.0).confidence.tolist() == pytest.approx([rate, 0.5, rate])
    proposer.observe(proposer.find(2, 3, 0.0), [3, 8])  # 1 accepted, 1 rejected
    assert proposer.rate == pytest.approx((DECAY * (DECAY * 1 + 3) + 1) / (DECAY * (DECAY * 2 + 3) + 2))
    before = proposer.rate
    proposer.observe(NO_LOOKUP, [7])
    proposer.observe(None, [7])
    assert proposer.rate == before


def test_a_copy_is_independent_but_shares_the_index():
    index = index_of([1, 2, 3, 4, 5])
    proposer = proposer_after(index, [9, 1])
    twin = proposer.copy()
    twin.extend([2, 3])
    twin.observe(twin.find(4, 1, 0.0), [7])  # rejected
    assert (len(proposer), len(twin)) == (2, 4)
    assert proposer.find(2, 2, 0.0).ids.tolist() == [3, 4] and proposer.rate == 0.5 < 1.0 and twin.rate < 0.5
    assert twin.find(4, 1, 0.0).ids.tolist() == [5]
    index.add([1, 2, 8])  # the index is the engine's: both see it
    assert proposer.find(2, 1, 0.0).ids.tolist() == twin.find(2, 1, 0.0).ids.tolist() == [3]
    index.add([1, 2, 8])
    assert proposer.find(2, 1, 0.0).ids.tolist() == [8]


@pytest.mark.parametrize(("value", "cap"), [(None, SUFFIX_CACHE_TOKENS), ("0", 0), ("4096", 4096)])
def test_flm_suffix_cache_tokens_sets_the_cap(value, cap):
    assert Settings(suffix_cache_tokens=value).suffix_cache_cap() == cap
    assert Settings.from_env({} if value is None else {"FLM_SUFFIX_CACHE_TOKENS": value}).suffix_cache_cap() == cap


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_a_bad_flm_suffix_cache_tokens_is_refused(value):
    with pytest.raises(InvalidRequestError, match="FLM_SUFFIX_CACHE_TOKENS"):
        Settings(suffix_cache_tokens=value).suffix_cache_cap()
