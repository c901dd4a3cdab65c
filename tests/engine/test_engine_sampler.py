"""Sampler: exact masks on hand-built logits, the filter order, the draw, seeds, defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.request import SamplingParams
from flm_runtime.sampling.sampler import (FALLBACK_SAMPLING, GREEDY, SamplingDefaults, default_sampling, new_rng,
                                        sample, sample_from_probs, warp)

P4 = np.array([0.5, 0.3, 0.15, 0.05])          # a distribution whose cumulative masses are known
LOGITS4 = np.log(P4).astype(np.float32)


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def test_greedy_picks_lowest_id_on_ties():
    logits = np.array([1.0, 5.0, 5.0, 2.0], dtype=np.float32)
    assert sample(logits, SamplingParams(temperature=0.0), new_rng(0)) == 1
    np.testing.assert_array_equal(warp(logits, SamplingParams()), [0, 1, 0, 0])


def test_greedy_draws_nothing_from_the_rng():
    rng = new_rng(3)
    before = rng.bit_generator.state
    sample(np.array([0.0, 1.0], dtype=np.float32), SamplingParams(), rng)
    assert rng.bit_generator.state == before


def test_temperature_only_is_the_softmax_of_scaled_logits():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    e = np.exp(logits.astype(np.float64) / 0.5)
    np.testing.assert_allclose(warp(logits, sp(temperature=0.5)), e / e.sum(), rtol=1e-12)


def test_top_k_keeps_k_best_and_ties_at_the_boundary():
    logits = np.array([4.0, 3.0, 3.0, 1.0, 0.0], dtype=np.float32)
    probs = warp(logits, sp(top_k=2))
    e = np.exp([4.0, 3.0, 3.0])
    np.testing.assert_allclose(probs, np.r_[e / e.sum(), 0, 0], rtol=1e-12)
    assert np.count_nonzero(warp(logits, sp(top_k=1))) == 1


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = warp(LOGITS4, sp(top_p=top_p))
    want = np.zeros(4)
    want[kept] = P4[kept] / P4[kept].sum()
    np.testing.assert_allclose(probs, want, rtol=1e-6)


@pytest.mark.parametrize("min_p, kept", [(0.05, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.7, [0])])
def test_min_p_drops_tokens_below_min_p_times_top1(min_p, kept):
    probs = warp(LOGITS4, sp(min_p=min_p))
    want = np.zeros(4)
    want[kept] = P4[kept] / P4[kept].sum()
    np.testing.assert_allclose(probs, want, rtol=1e-6)


def test_order_is_temperature_top_k_top_p_min_p():
    # top_k=3 first renormalizes to [.526, .316, .158]: top_p=0.83 then keeps 2 (top_p first: 3).
    assert np.count_nonzero(warp(LOGITS4, sp(top_k=3, top_p=0.83))) == 2
    # top_p=0.82 before min_p keeps 3, min_p=0.2 keeps them (min_p first, as vLLM: only 2).
    assert np.count_nonzero(warp(LOGITS4, sp(top_p=0.82, min_p=0.2))) == 3
    # temperature before top_p: T=2 flattens to [.41, .32, .22, .13]: top_p=0.7 needs 3 tokens.
    assert np.count_nonzero(warp(LOGITS4, sp(temperature=2.0, top_p=0.7))) == 3


def test_warp_on_batches_equals_warp_per_row():
    logits = np.random.default_rng(0).standard_normal((2, 3, 50)).astype(np.float32)
    for params in (sp(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05), SamplingParams()):
        batch = warp(logits, params)
        assert batch.shape == (2, 3, 50)
        for i in np.ndindex(2, 3):
            np.testing.assert_array_equal(batch[i], warp(logits[i], params))


def test_warp_handles_minus_inf_logits():
    logits = np.array([-np.inf, 0.0, 0.0, -np.inf], dtype=np.float32)
    np.testing.assert_allclose(warp(logits, sp(top_p=0.9)), [0, 0.5, 0.5, 0])


def _chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z=3.09 is alpha = 0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + alpha_z * math.sqrt(a)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    return float(np.sum((counts[mask] - expected[mask]) ** 2 / expected[mask]))


def test_sampling_follows_warp_probs_chi_square():
    logits = np.random.default_rng(1).standard_normal(12).astype(np.float32) * 2
    params = sp(temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    probs = warp(logits, params)
    rng = new_rng(1234)
    counts = np.bincount([sample(logits, params, rng) for _ in range(20000)], minlength=12)
    assert counts[probs == 0].sum() == 0
    df = int(np.count_nonzero(probs)) - 1
    assert _chi2(counts, probs) < _chi2_critical(df)
    # The check has power: the unwarped softmax is rejected.
    raw = np.exp(logits - logits.max())
    assert _chi2(counts, raw / raw.sum()) > 10 * _chi2_critical(df)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = np.zeros(1000, dtype=np.float32)
    params = sp(top_p=0.99)

    def run(seed):
        rng = new_rng(seed)
        return [sample(logits, params, rng) for _ in range(30)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_sample_from_probs_edges_never_pick_zero_mass():
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample_from_probs(probs, 0.0) == 1
    assert sample_from_probs(probs, 0.2499) == 1
    assert sample_from_probs(probs, 0.25) == 3
    assert sample_from_probs(probs, np.nextafter(1.0, 0.0)) == 3
    np.testing.assert_array_equal(sample_from_probs(np.stack([probs, probs[::-1]]), np.array([0.1, 0.9])), [1, 3])


def test_sampling_defaults_fill_only_unset_fields():
    params = FALLBACK_SAMPLING.resolve(temperature=0.7, top_p=None, seed=5, stop="END")
    assert (params.temperature, params.top_k, params.top_p, params.seed, params.stop) == (0.7, 64, 0.95, 5, ("END",))
    assert FALLBACK_SAMPLING.resolve(temperature=0).greedy
    assert GREEDY.resolve().greedy
    assert default_sampling(None) is FALLBACK_SAMPLING
    own = SamplingDefaults(temperature=0.2, top_k=0, top_p=0.9)
    assert default_sampling(own).resolve().top_p == 0.9


def test_sampling_defaults_reject_bad_values_naming_the_param():
    with pytest.raises(InvalidRequestError) as e:
        FALLBACK_SAMPLING.resolve(top_p=1.5)
    assert e.value.param == "top_p"


@pytest.mark.parametrize("params", [sp(top_k=64, top_p=0.95), sp(temperature=0.7, top_p=0.9), sp(min_p=0.1), sp()])
def test_sample_is_the_inverse_cdf_draw_on_warp(params):
    """The verifier's contract: one draw u per token; sample() == sample_from_probs(warp, u)."""
    logits = (np.random.default_rng(2).standard_normal(5000) * 3).astype(np.float32)
    a, b = new_rng(9), new_rng(9)
    probs = warp(logits, params)
    assert [sample(logits, params, a) for _ in range(200)] == [int(sample_from_probs(probs, b.random())) for _ in range(200)]


def test_top_p_fast_path_equals_a_full_sort():
    """top_p sorts the 512 most likely first; compare with a plain full stable sort, ties included."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 3000))
        logits = rng.standard_normal(n) * rng.choice([0.1, 1.0, 5.0, 20.0])
        if rng.random() < 0.3:
            logits = np.round(logits)                              # many exact ties
        top_p = float(rng.choice([0.1, 0.5, 0.9, 0.99, 0.999999]))
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(n, dtype=bool)
        keep[order[(before < top_p) | (np.arange(n) == 0)]] = True
        want = np.where(keep, probs, 0) / probs[keep].sum()
        np.testing.assert_allclose(warp(logits, sp(top_p=top_p)), want, rtol=1e-9, atol=1e-300)
