"""The copy ceiling's parts (``flm_bench.ceiling``): the suffix automaton's longest-prefix answers
equal a brute-force search, the copy lengths of small cases exactly, and the cheapest cost equal
to an exhaustive search over every schedule of steps."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest

from flm_bench.ceiling import SubstringIndex, cheapest_cost, copy_lengths
from flm_bench.options import cost_curve
from flm_bench.workload_bench import Cell, Pair, Reply, copy_ceilings
from flm_bench.workloads import Answer, Task


def brute_longest(texts: list[list[int]], pattern: list[int]) -> int:
    return max((m for text in texts for m in range(len(pattern) + 1) for s in range(len(text) - m + 1)
                if text[s:s + m] == pattern[:m]), default=0)


@pytest.mark.parametrize("seed", range(6))
def test_longest_prefix_equals_a_brute_force_search_over_separate_sequences(seed):
    rng = np.random.default_rng(seed)
    texts = [rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist() for _ in range(3)]
    index = SubstringIndex()
    for text in texts:
        index.add_sequence(text)
    for _ in range(200):
        pattern = rng.integers(0, 4, size=int(rng.integers(1, 10))).tolist()
        assert index.longest_prefix(pattern) == brute_longest(texts, pattern)
    # A run across two sequences' edge is not in the text.
    assert index.longest_prefix(texts[0][-1:] + texts[1][:1]) == brute_longest(texts, texts[0][-1:] + texts[1][:1])


def test_longest_prefix_of_long_texts_and_repeated_tokens_equals_a_brute_force_search():
    rng = np.random.default_rng(7)
    texts = [rng.integers(0, 3, size=400).tolist(), [5] * 60, rng.integers(0, 50, size=300).tolist()]
    index = SubstringIndex()
    for text in texts:
        index.add_sequence(text)
    patterns = [[5] * 61, [5] * 59 + [0], texts[2][100:140], texts[0][7:60] + [9]]
    patterns += [rng.integers(0, 3, size=12).tolist() for _ in range(100)]
    for pattern in patterns:
        assert index.longest_prefix(pattern) == brute_longest(texts, pattern)
    assert index.longest_prefix([5] * 61) == 60 and index.longest_prefix(texts[2][100:140]) == 40


@pytest.mark.parametrize("seed", range(4))
def test_copy_lengths_equal_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    prompt, output = (rng.integers(0, 3, size=n).tolist() for n in (20, 40))
    others = [rng.integers(0, 3, size=15).tolist() for _ in range(2)]
    earlier = SubstringIndex()
    for text in others:
        earlier.add_sequence(text)
    want = [brute_longest([prompt + output[:i], *others], output[i:i + 5]) for i in range(1, 40)]
    assert copy_lengths(prompt, output, earlier, most=5) == want


def test_copy_lengths_of_a_small_case():
    prompt = [5, 6, 7, 8]
    output = [1, 6, 7, 8, 9, 1, 6, 4]
    earlier = SubstringIndex()
    earlier.add_sequence([9, 9, 4])
    # Position 1: 6 7 8 from the prompt, then 9 is nowhere after 8; position 4: 9 alone (earlier);
    # position 5: 1 6 from the output itself, not 1 6 4; position 7: 4 (earlier).
    assert copy_lengths(prompt, output, earlier, most=7) == [3, 2, 1, 1, 2, 1, 1]
    assert copy_lengths(prompt, output, earlier, most=2) == [2, 2, 1, 1, 2, 1, 1]


def brute_cost(lengths: list[int], ratio: list[float]) -> float:
    """Every schedule: at each position a plain step or a step verifying k <= lengths[i] tokens."""
    n, best = len(lengths), float("inf")
    for choice in itertools.product(range(len(ratio) + 1), repeat=n):
        i, cost = 0, 0.0
        while i < n:
            k = min(choice[i], lengths[i])
            cost += ratio[k - 1] if k else 1.0
            i += k + 1
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_cheapest_cost_equals_an_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, size=7).tolist()
    ratio = np.cumsum(rng.uniform(0.1, 0.9, size=3)).round(3).tolist()
    ratio = [1.0 + r for r in ratio]
    assert cheapest_cost(lengths, ratio) == pytest.approx(brute_cost(lengths, ratio))


def test_cheapest_cost_of_a_whole_copy_and_of_nothing_to_copy():
    # 15 positions, each copyable to the end: a step of 7 (2.0) covers 8, a step of 6 (1.8) the other 7.
    assert cheapest_cost([15 - i for i in range(15)], [1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0]) == pytest.approx(3.8)
    assert cheapest_cost([0] * 10, [1.1] * 7) == 10.0


def test_copy_ceilings_let_an_answer_copy_the_earlier_answers_of_the_run():
    task = Task("chat", "chat-1", {"messages": []})

    def pair(prompt: list[int], output: list[int]) -> Pair:
        reply = Reply(Answer("-"), len(output), {}, tuple(prompt), tuple(output))
        return Pair(task, 1, "greedy", reply, reply)

    first, second = copy_ceilings([pair([1, 2], [7, 8, 9, 10]), pair([3], [5, 8, 9, 10])], [1.5, 2.0])
    # The first answer has nothing to copy (3 plain steps); the second copies 8 9 10 from the
    # first: one step verifying 2 of them (K = 2, cost 2.0) pushes all three positions.
    assert (first.copy, second.copy) == ((3, 3.0), (3, 2.0))
    assert Cell([first, second]).ceiling == pytest.approx(6 / 5.0)
    # Runs of at least 4 tokens only: the second answer's run of 3 no longer counts.
    assert [p.copy for p in copy_ceilings([first, second], [1.5, 2.0], min_run=4)] == [(3, 3.0), (3, 3.0)]
    # A run of 4 counts with runs of at least 4 though K is 2: it verifies 2 of them a step.
    first, second = copy_ceilings([pair([1], [7, 8, 9, 10, 11]), pair([3], [5, 8, 9, 10, 11])], [1.5, 2.0], min_run=4)
    assert (first.copy, second.copy) == ((4, 4.0), (4, 3.0))


def test_an_answer_that_copies_its_prompt_gets_the_ceiling_of_whole_blocks():
    task = Task("chat", "chat-1", {"messages": []})
    prompt = list(range(100, 130))
    reply = Reply(Answer("-"), 22, {}, tuple(prompt), tuple(prompt[:22]))
    (copied,) = copy_ceilings([Pair(task, 1, "greedy", reply, reply)], [1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0])
    # 21 decode positions, each copyable to the end: three steps of 7 (1.8 each) or 8, 7 and 6
    # positions (2.0 + 1.8 + 1.6) cost least.
    assert copied.copy == (21, pytest.approx(5.4))
    assert Cell([copied]).ceiling == pytest.approx(21 / 5.4)


def test_a_cost_curve_option_is_numbers_of_at_least_one_that_never_fall():
    assert cost_curve("1.16,1.27,1.27,1.5") == [1.16, 1.27, 1.27, 1.5]
    for bad in ("1.2,x", "0.9,1.2", "1.5,1.2", "1.2,nan", "1.2,inf", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            cost_curve(bad)
