"""The integer products of the cpu backend (``kernels/qgemm.py``): every instruction-set path
this host runs gives the same bits as the portable path, a row's result does not depend on the
rows beside it, and the product is within activation-quantization error of the float32 one."""

from __future__ import annotations

import numpy as np
import pytest

from flm_runtime.kernels import qgemm, quant

FORMATS = {  # name -> weight of 40 outputs x 160 inputs (40 rows: the last tile of 16 is partly padding)
    "q4 symmetric": lambda w: quant.quantize(w, 4),
    "q8 symmetric": lambda w: quant.quantize(w, 8),
    "q4 with mins": lambda w: quant.from_blocks(*_q4_with_mins(w), 4, w.shape[1]),
    # a Q4_K_M file's fused QKV: 8-bit codes of every value 0..255 (AVX2 centres them) with mins
    "q8 with mins": lambda w: quant.as_format(quant.quantize(w, 8), 8, True),
}


def _q4_with_mins(w: np.ndarray):
    """Q4_1's rule: per block, min and (max - min) / 15."""
    blocks = w.reshape(w.shape[0], -1, quant.BLOCK)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = ((hi - lo) / 15).astype(np.float16)
    codes = np.clip(np.rint((blocks - lo[..., None]) / scale.astype(np.float32)[..., None]), 0, 15)
    return codes.astype(np.uint8).reshape(w.shape), scale, lo.astype(np.float16)


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


# Every path on every format (each path and format compiles its own kernel), against the portable
# one (which is the reference, so not compared with itself).
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", [isa for isa in qgemm.host_isas() if isa != "portable"])
def test_every_path_gives_the_portable_bits(weights, x, fmt, isa):
    w = weights[fmt]
    for rows in (1, 3, 8, 13, 16):  # up to a verify pass of a block of 16
        assert np.array_equal(qgemm.qlinear(x[:rows], w, isa), qgemm.qlinear(x[:rows], w, "portable")), (isa, rows)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", qgemm.host_isas())
def test_the_largest_codes_and_activations_do_not_saturate(isa, bits):
    # Codes at both ends of their range against activations at +-127 (every input of a block of
    # one magnitude): AVX2's int16 pair sums at their bounds (docstring), 30480 and 32512.
    k, top = 256, 2**bits - 1
    codes = np.zeros((32, k), dtype=np.uint8)
    codes[1::2] = top  # weight rows alternately all 0 and all top
    codes[2::4, ::2] = top // 2  # and some rows of mixed codes
    ones = np.ones((32, k // quant.BLOCK), dtype=np.float32)
    for mins in (None, -0.5 * ones):
        w = quant.from_blocks(codes, ones, mins, bits, k)
        x = np.stack([np.ones(k), -np.ones(k), np.resize([1, -1], k), np.resize([-1, -1, 1, 1], k)]).astype(np.float32)
        want = x.astype(np.float64) @ w.dequantize().T.astype(np.float64)  # x is exactly 127 steps of 1/127
        np.testing.assert_allclose(qgemm.qlinear(x, w, isa), want, rtol=1e-6, atol=1e-3)


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
    # One int8 level rounds each activation to half a step dx = max|x| / 127 of its block: the
    # error of a dot product is at most sum_i |w_i| * dx_b / 2 over the blocks, plus float32 rounding.
    dx = np.abs(x.reshape(16, -1, quant.BLOCK)).max(-1) / 127  # [16, K/32]
    absw = np.abs(w.dequantize())
    bound = 0.5 * dx @ absw.reshape(40, -1, quant.BLOCK).sum(-1).T + 1e-6 * np.abs(x) @ absw.T  # [16, 40]
    assert np.all(np.abs(got - want) <= bound)
    assert np.array_equal(got[3] == 0, want[3] == 0)  # nothing else special about a zero block
    # one level: coarser than the two of before (1e-4), as fine as llama.cpp's Q8_0 activations
    assert 1e-4 < np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_an_unavailable_path_is_refused(weights, x):
    with pytest.raises(ValueError, match="not available here"):
        qgemm.qlinear(x, weights["q8 symmetric"], "sse9")


def test_activations_are_quantized_by_the_q8_0_rule(x):
    # The rule of the module docstring in numpy, on a width that is not whole blocks (the last
    # block padded with zeros): q = rint(x / dx), dx = max|x| / 127, per block of 32.
    k, padded = 150, 160
    xq, dx, sx, s = qgemm.quantize_activations(np.ascontiguousarray(x[:, :k]), padded)
    blocks = np.pad(x[:, :k], ((0, 0), (0, padded - k))).reshape(16, -1, quant.BLOCK)
    want_dx = np.abs(blocks).max(-1) / np.float32(127)
    safe = np.where(want_dx > 0, want_dx, 1)[..., None]
    q = np.where(want_dx[..., None] > 0, np.clip(np.rint(blocks * (np.float32(1) / safe)), -127, 127), 0)
    assert np.array_equal(xq, q.reshape(16, -1).astype(np.int8))
    assert np.array_equal(dx, want_dx)
    assert np.array_equal(s, q.sum(-1).astype(np.int32))
    assert np.array_equal(sx, want_dx * s.astype(np.float32))
    assert np.all(xq[3, :32] == 0) and np.all(xq[:, k:] == 0)
    assert np.abs(xq).max() == 127 and np.all(np.abs(xq).max(-1) == 127)  # every row's largest input
