"""The integer products of the cpu backend (``kernels/qgemm.py``): every instruction-set path
this host runs gives the same bits as the portable path, a row's result does not depend on the
rows beside it, and the product is within activation-quantization error of the float32 one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flm_runtime.kernels import qgemm, quant

FORMATS = {  # name -> weight of 40 outputs x 160 inputs (40 rows: the last tile of 16 is partly padding)
    "q4 symmetric": lambda w: quant.quantize(w, 4),
    "q8 symmetric": lambda w: quant.quantize(w, 8),
    "q4 with mins": lambda w: quant.from_blocks(*_q4_with_mins(w), 4, w.shape[1]),
    "q6 sub-scales": lambda w: quant.from_six_bit(*_q6_with_sub_scales(w), w.shape[1]),
}


def _q4_with_mins(w: np.ndarray):
    """Q4_1's rule: per block, min and (max - min) / 15."""
    blocks = w.reshape(w.shape[0], -1, quant.BLOCK)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = ((hi - lo) / 15).astype(np.float16)
    codes = np.clip(np.rint((blocks - lo[..., None]) / scale.astype(np.float32)[..., None]), 0, 15)
    return codes.astype(np.uint8).reshape(w.shape), scale, lo.astype(np.float16)


def _q6_with_sub_scales(w: np.ndarray):
    """Q6_K's form: per 16 inputs ``sub * scale`` with a signed 8-bit ``sub`` (its largest
    magnitude -128, as llama.cpp quantizes), codes ``rint(w / (sub * scale)) + 32``."""
    n, k = w.shape
    halves = w.reshape(n, -1, 16)
    amax = np.abs(halves).max(-1)  # [N, K/16]
    scale = (amax.reshape(n, -1, 2).max(-1) / 32 / 128).astype(np.float16)  # [N, K/32]
    per16 = np.repeat(scale.astype(np.float32), 2, axis=1)
    subs = -np.clip(np.rint(amax / 32 / per16), 1, 128).astype(np.int16)  # negative: the sign flips codes
    step = per16 * subs
    codes = np.clip(np.rint(halves / step[..., None]) + 32, 0, 63).astype(np.uint8).reshape(n, k)
    return codes, scale, np.maximum(subs, -128).astype(np.int8)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((40, 160)).astype(np.float32) * 0.1
    return {name: make(w) for name, make in FORMATS.items()}


@pytest.fixture(scope="module")
def x():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 160)).astype(np.float32)
    x[3, :32] = 0  # an all-zero block: scale 0
    x[5, 7] = 40.0  # an outlier
    return x


# Every path on the two formats SmolLM2 serves with and Q6_K's (each path and format compiles its
# own kernel), against the portable one (which is the reference, so not compared with itself).
@pytest.mark.parametrize("fmt", ["q4 with mins", "q8 symmetric", "q6 sub-scales"])
@pytest.mark.parametrize("isa", [isa for isa in qgemm.host_isas() if isa != "portable"])
def test_every_path_gives_the_portable_bits(weights, x, fmt, isa):
    w = weights[fmt]
    for rows in (1, 3, 8, 13, 16):  # up to a verify pass of a block of 16
        assert np.array_equal(qgemm.qlinear(x[:rows], w, isa), qgemm.qlinear(x[:rows], w, "portable")), (isa, rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gives_the_same_bits_alone_or_among_others(weights, x, fmt):
    w = weights[fmt]
    together = qgemm.qlinear(x, w)  # 16 rows: groups of 8
    alone = np.concatenate([qgemm.qlinear(x[i:i + 1], w) for i in range(16)])
    in_eights = np.concatenate([qgemm.qlinear(x[:8], w), qgemm.qlinear(x[8:], w)])
    in_threes = np.concatenate([qgemm.qlinear(x[i:i + 3], w) for i in range(0, 16, 3)])
    for other in (alone, in_eights, in_threes):
        assert np.array_equal(together, other)


@pytest.mark.parametrize("fmt", FORMATS)
def test_product_is_within_activation_quantization_error(weights, x, fmt):
    w = weights[fmt]
    got, want = qgemm.qlinear(x, w), x @ w.dequantize().T
    # Two levels round each activation to half a step of 1/128 of its block's int8 step: the error
    # of a dot product is at most sum_i |w_i| * step_b / 2 over the blocks, plus float32 rounding.
    step = np.abs(x.reshape(16, -1, quant.BLOCK)).max(-1) / 127 / 2**qgemm.LEVEL_SHIFT  # [16, K/32]
    absw = np.abs(w.dequantize())
    bound = 0.5 * step @ absw.reshape(40, -1, quant.BLOCK).sum(-1).T + 1e-6 * np.abs(x) @ absw.T  # [16, 40]
    assert np.all(np.abs(got - want) <= bound)
    assert np.array_equal(got[3] == 0, want[3] == 0)  # nothing else special about a zero block
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


@pytest.mark.parametrize("isa", qgemm.host_isas())
def test_the_largest_6_bit_block_sum_is_exact(isa):
    # |sub * (code - 32) * xw| summed over a block is below 128 * 32 * 16383 * 32 < 2**31, so the
    # int32 sums hold it (code 0 with sub -128 against activations all at their largest magnitude).
    w = quant.from_six_bit(np.zeros((16, 64), np.uint8), np.ones((16, 2), np.float16), np.full((16, 4), -128, np.int8), 64)
    x = np.array([[1.0] * 64, [-1.0] * 64], dtype=np.float32)
    assert np.array_equal(qgemm.qlinear(x, w, isa), np.array([[4096.0 * 64] * 16, [-4096.0 * 64] * 16], np.float32))


def test_an_unavailable_path_is_refused(weights, x):
    with pytest.raises(ValueError, match="not available here"):
        qgemm.qlinear(x, weights["q8 symmetric"], "sse9")


def test_activations_are_quantized_by_the_two_level_rule(x):
    # The rule of the module docstring in numpy, on a width that is not whole blocks (the last
    # block padded with zeros): q1 = rint(x / dx), q2 = rint((x - dx q1) / step), step = dx / 128.
    k, padded = 150, 160
    xq, xw, step, sx, s = qgemm.quantize_activations(np.ascontiguousarray(x[:, :k]), padded)
    blocks = np.pad(x[:, :k], ((0, 0), (0, padded - k))).reshape(16, -1, quant.BLOCK)
    dx = np.abs(blocks).max(-1) / np.float32(127)
    want_step = dx / np.float32(2**qgemm.LEVEL_SHIFT)
    safe = np.where(dx > 0, dx, 1)[..., None]
    q1 = np.where(dx[..., None] > 0, np.clip(np.rint(blocks * (np.float32(1) / safe)), -127, 127), 0).astype(np.float32)
    q2 = np.where(dx[..., None] > 0, np.clip(np.rint((blocks - dx[..., None] * q1)
                                                     * (np.float32(1) / (safe / np.float32(128)))), -127, 127), 0)
    assert np.array_equal(xq, np.concatenate([q1.reshape(16, -1), q2.reshape(16, -1)], axis=1).astype(np.int8))
    assert np.array_equal(xw, (128 * q1 + q2).reshape(16, -1).astype(np.int16))  # the joined levels
    assert np.array_equal(step, want_step)
    joined = (128 * q1 + q2).reshape(16, -1, 16)  # per half block
    assert np.array_equal(s, joined.sum(-1).reshape(16, -1).astype(np.int32))
    assert np.array_equal(sx, want_step * s.reshape(16, -1, 2).sum(-1).astype(np.float32))
    assert np.all(xq[3, :32] == 0) and np.all(xq[:, k:padded] == 0) and np.all(xq[:, padded + k:] == 0)


# A process's product of one real weight (smollm2's first down projection, Q4_1 -> 4-bit with
# mins) on three rows, saved to argv[2]: nothing else runs in it before the product.
_PRODUCT_IN_A_NEW_PROCESS = """
import sys
import numpy as np
from flm_runtime.kernels import qgemm
from flm_runtime.loading import load_model_files
w = load_model_files(sys.argv[1], weights="auto").weights["model.layers.0.mlp.down_proj.weight"]
x = np.sin(np.arange(3 * w.in_features, dtype=np.float32)).reshape(3, w.in_features)
np.save(sys.argv[2], qgemm.qlinear(x, w))
"""


def test_a_product_loaded_from_numbas_disk_cache_runs(smollm2_gguf, tmp_path):
    # numba's disk cache, filled the way processes fill it: the first process compiles and saves
    # the product's team step (its format bound); its entry gone, the second compiles it again
    # beside the team's cached functions; the third loads it. Each gives the same bits.
    root = Path(qgemm.__file__).parents[2]  # this checkout's flm_runtime in the children too
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}

    def product(run: int) -> np.ndarray:
        out = tmp_path / f"{run}.npy"
        done = subprocess.run([sys.executable, "-c", _PRODUCT_IN_A_NEW_PROCESS, str(smollm2_gguf), str(out)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (run, done.returncode, done.stderr[-2000:])
        return np.load(out)

    first = product(0)
    callers = list((tmp_path / "numba").rglob("*_product_step.locals.step*"))
    assert callers
    for f in callers:
        f.unlink()
    second, third = product(1), product(2)
    assert np.array_equal(first, second) and np.array_equal(first, third)
    assert first.shape == (3, 576) and np.all(np.isfinite(first)) and np.abs(first).max() > 0.1
