"""The agreement metrics on hand-built logits: bfloat16 rounding steps, the near-tie boundary
(exactly 2 steps is a near-tie, anything more is not), cosines, and adding counts."""

from __future__ import annotations

import numpy as np
import pytest

from flm_bench.agreement import NEAR_TIE_STEPS, Agreement, bf16_step, compare_logits


@pytest.mark.parametrize("x, step", [(1.0, 2.0**-7), (1.99, 2.0**-7), (2.0, 2.0**-6), (10.0, 2.0**-4),
                                     (-10.0, 2.0**-4), (0.3, 2.0**-9), (1000.0, 2.0**2), (0.0, 2.0**-133)])
def test_bf16_step_is_the_spacing_of_bfloat16_numbers(x, step):
    assert bf16_step(x) == step


def test_bf16_step_matches_bfloat16_rounding_of_float32():
    """Independent check: bfloat16 keeps the top 16 bits of a float32, so the next bfloat16 above x
    (for x exactly representable) is x + one step."""
    for x in (1.0, 3.0, 10.0, 37.5, 0.15625):
        bits = np.array([x], dtype=np.float32).view(np.uint32)
        nxt = ((bits >> 16) + 1 << 16).astype(np.uint32).view(np.float32)[0]
        assert nxt - np.float32(x) == bf16_step(x)


def logits(*rows) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


def test_same_pick_counts_as_same_top1():
    ref = logits([1.0, 5.0, 2.0], [0.0, -1.0, 3.0])
    a = compare_logits(ref, ref + 0.01)
    assert (a.positions, a.same_top1, a.beyond_near_tie, a.within_near_tie) == (2, 2, 0, 0)
    assert a.same_top1_pct == 100.0 and a.mean_cosine == pytest.approx(1.0, abs=1e-4)


def test_near_tie_boundary_is_exactly_two_bf16_steps():
    step = 2.0**-4  # at 10.0
    assert NEAR_TIE_STEPS == 2
    ref = logits([10.0, 10.0 - 2 * step, 0.0],           # pick trails by exactly 2 steps: near-tie
                 [10.0, 10.0 - 2 * step - 2.0**-20, 0.0],  # a hair more: beyond
                 [10.0, 10.0 - 3 * step, 0.0])             # 3 steps: beyond
    test = logits([0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0])  # the verify path picks token 1
    a = compare_logits(ref, test)
    assert (a.same_top1, a.within_near_tie, a.beyond_near_tie) == (0, 1, 2)
    assert a.beyond_near_tie_pct == pytest.approx(200 / 3)


def test_the_margin_is_to_the_pick_not_to_the_second_best():
    """A pick ranked third trails by the margin to it, even when the top-2 margin is a near-tie."""
    ref = logits([10.0, 10.0 - 2.0**-4, 9.0])
    a = compare_logits(ref, logits([0.0, 0.0, 1.0]))
    assert (a.same_top1, a.beyond_near_tie) == (0, 1)
    b = compare_logits(ref, logits([0.0, 1.0, 0.0]))
    assert (b.same_top1, b.within_near_tie) == (0, 1)


def test_cosine_and_largest_difference():
    ref = logits([1.0, 0.0], [3.0, 4.0])
    test = logits([0.0, 1.0], [6.0, 8.0])
    a = compare_logits(ref, test)
    assert a.mean_cosine == pytest.approx(0.5)  # (0 + 1) / 2
    assert a.max_abs_diff == pytest.approx(4.0)


def test_counts_add_up():
    a = Agreement(4, 3, 1, 3.9, 0.1) + Agreement(4, 4, 0, 4.0, 0.3)
    assert (a.positions, a.same_top1, a.beyond_near_tie, a.within_near_tie) == (8, 7, 1, 0)
    assert a.mean_cosine == pytest.approx(7.9 / 8) and a.max_abs_diff == 0.3
