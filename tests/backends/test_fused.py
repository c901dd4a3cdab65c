"""The compiled layer's elementwise helpers (``backends/fused.py``)."""

from __future__ import annotations

import numba
import numpy as np

from flm_runtime.backends import fused


@numba.njit
def _exp_all(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = fused._exp(x[i])
    return out


def test_exp_is_within_two_ulp_and_clamps_outside_float32_range():
    x = np.linspace(-87, 88, 400_001, dtype=np.float32)
    got, want = _exp_all(x), np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2 * 2.0**-23
    edges = _exp_all(np.array([-1e30, -100, 100, 1e30], dtype=np.float32))
    assert np.array_equal(edges, _exp_all(np.array([-87, -87, 88, 88], dtype=np.float32)))
    assert np.all(np.isfinite(edges)) and edges[0] > 0
