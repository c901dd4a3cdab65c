"""The quantized weight format (``kernels/quant.py``) and the GGUF blocks read into it as they
are (``loading/gguf.py``): the same weights as gguf-py's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from flm_runtime.kernels import quant
from flm_runtime.loading import gguf as gguf_loader

N, K = 12, 512  # K: two Q4_K super-blocks, 16 blocks of 32


@pytest.fixture(scope="module")
def w():
    return (np.random.default_rng(3).standard_normal((N, K)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_native_blocks_dequantize_as_gguf_py(w, qtype):
    qtype = GGMLQuantizationType[qtype]
    raw = quantize(w, qtype)  # [N, bytes]
    got = gguf_loader._read_blocks(raw.reshape(N, K // quant.BLOCK, -1), qtype, K)
    assert got.bits == (8 if qtype == GGMLQuantizationType.Q8_0 else 4)
    assert (got.mins is not None) == (qtype == GGMLQuantizationType.Q4_1)
    assert np.array_equal(got.dequantize(), dequantize(raw, qtype).reshape(N, K))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_widened_4_bit_blocks_hold_the_same_weights(w, qtype):
    # The q8 kind of a 4-bit file: 8-bit codes, the source's own scales (and mins), no rounding.
    qtype = GGMLQuantizationType[qtype]
    four = gguf_loader._read_blocks(quantize(w, qtype).reshape(N, K // quant.BLOCK, -1), qtype, K)
    eight = quant.widen(four)
    assert eight.bits == 8 and (eight.mins is not None) == (four.mins is not None)
    assert np.array_equal(eight.dequantize(), four.dequantize())


def test_q4_k_folds_into_blocks_of_32():
    # Any bytes are Q4_K super-blocks (6-bit scales and mins, 4-bit codes) once d and dmin are
    # finite: random ones exercise every scale/min packing.
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (N, K // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = np.array([0.01, 0.002], np.float16).view(np.uint8)  # d, dmin
    got = gguf_loader._read_q4_k(raw, K)
    want = dequantize(raw.reshape(N, -1), GGMLQuantizationType.Q4_K).reshape(N, K)
    # Sub-block scale x super-block scale rounded to float16: within 2^-11 of each weight's scale.
    np.testing.assert_allclose(got.dequantize(), want, rtol=0, atol=np.abs(want).max() * 2e-3)
    assert np.abs(got.dequantize() - want).max() > 0  # the rounding is real: not a copy of the reference


def _q6_k_bytes(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K super-blocks ``[n, k/256, 210]``: any bytes are, once ``d`` is finite, so every
    code, high-bit plane and sub-scale sign is exercised."""
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = np.float16(0.003).reshape(1).view(np.uint8)
    return raw


def test_q6_k_reads_as_it_is():
    # ggml's dequantize_row_q6_K (through gguf-py), bit for bit: d * sc * (q - 32) in 6-bit blocks
    # with their signed sub-scales, at 7 bits a weight (0.875 bytes).
    raw = _q6_k_bytes(N, K, 11)
    got = gguf_loader._read_q6_k(raw, K)
    assert got.bits == 6 and got.mins is None
    assert np.array_equal(got.dequantize(), dequantize(raw.reshape(N, -1), GGMLQuantizationType.Q6_K).reshape(N, K))
    rows = -(-N // quant.TILE) * quant.TILE
    assert got.nbytes == rows * K * 7 // 8
    codes, scales, subs = got.six_bit_rows()
    assert codes.max() == 63 and codes.min() == 0 and subs.min() < 0 < subs.max()
    back = quant.from_six_bit(codes, scales, subs, K)
    assert back.codes.tobytes() == got.codes.tobytes() and back.scales.tobytes() == got.scales.tobytes()


@pytest.mark.parametrize("qtype, kind, held", [
    ("Q4_K", "auto", (4, True)), ("Q6_K", "auto", (6, True)), ("Q8_0", "auto", (8, True)),
    ("Q5_0", "auto", (8, False)), ("F16", "auto", (8, False)),
    ("Q4_0", "q8", (8, True)), ("Q6_K", "q8", (8, False)), ("Q8_0", "q4", (4, False)), ("Q6_K", "q4", (4, False)),
])
def test_each_gguf_type_is_held_in_its_own_blocks_where_the_kernels_have_them(qtype, kind, held):
    # What `litellm-flm list` reports and quantized_tensor does: a 4-bit type widened exactly to
    # 8 bits is still read as it is; any other change of width is a quantization again.
    assert gguf_loader.held_as(GGMLQuantizationType[qtype], kind) == held


def test_six_bit_rows_are_taken_and_stacked():
    # The LM head of a reduced vocabulary (take_rows) and a fused matrix of 6-bit parts (whole
    # tiles joined, a ragged last part tiled again) keep every weight; beside parts of another
    # width a 6-bit part is held in 8 bits with stored mins, within half an 8-bit step.
    six = gguf_loader._read_q6_k(_q6_k_bytes(40, 256, 12), 256)
    rows = np.array([39, 0, 17, 16])
    assert np.array_equal(six.take_rows(rows).dequantize(), six.dequantize()[rows])
    for parts in ([six, six], [six.take_rows(np.arange(32)), six.take_rows(np.arange(5))]):
        got = quant.stack_rows(parts)
        assert got.bits == 6 and np.array_equal(got.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    four = quant.quantize(np.random.default_rng(13).standard_normal((16, 256)).astype(np.float32), 4)
    assert quant.fused_format([four, six]) == (8, True)
    fused = quant.stack_rows([four, six])
    assert fused.bits == 8 and fused.mins is not None
    assert np.array_equal(fused.dequantize()[:16], four.dequantize())
    step = np.abs(six.dequantize()).reshape(40, -1, quant.BLOCK).max(-1) / 127  # Q8_0's step per block
    err = np.abs(fused.dequantize()[16:] - six.dequantize()).reshape(40, -1, quant.BLOCK).max(-1)
    assert np.all(err <= step * 0.5 * (1 + 1e-2))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_rounds_each_weight_to_its_block_grid(w, bits):
    q = quant.quantize(w, bits)
    scales = np.repeat(q.rows()[1], quant.BLOCK, axis=1)[:, :K]
    err = np.abs(q.dequantize() - w)
    # Half a step; 4-bit (Q4_0's rule) maps the largest magnitude to code 0, so the other end of
    # the block may clip at code 15, a whole step away.
    assert np.all(err <= np.abs(scales) * (0.5 if bits == 8 else 1.0) * (1 + 1e-3))
    rows = -(-N // quant.TILE) * quant.TILE  # rows padded to whole tiles
    assert q.nbytes == rows * K * bits // 8 + rows * K // quant.BLOCK * 2  # codes + one float16 scale a block


def test_rows_taken_and_stacked_as_float32(w):
    a, b = quant.quantize(w, 4), quant.quantize(w[::-1].copy(), 4)
    stacked = quant.stack_rows([a, b])
    assert np.array_equal(stacked.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    rows = np.array([5, 0, 11])
    assert np.array_equal(a.take_rows(rows).dequantize(), a.dequantize()[rows])
    assert np.array_equal(a.dequantize(rows), a.dequantize()[rows])


@pytest.mark.parametrize("bits,mins", [(4, False), (4, True), (8, False)])
def test_stacking_whole_tiles_gives_the_bytes_of_tiling_again(bits, mins):
    # Q, K and V of a model have whole tiles of rows: their tiles are concatenated, and the result
    # is byte for byte what untiling and tiling the rows again gives (the last part may be ragged).
    rng = np.random.default_rng(8)
    parts = [quant.quantize(rng.standard_normal((n, 64)).astype(np.float32), bits) for n in (32, 16, 12)]
    if mins:
        parts = [quant.from_blocks(*p.rows(), bits, 64) for p in parts]  # stored mins (-zero point * scale)
        assert all(p.mins is not None for p in parts)
    got = quant.stack_rows(parts)
    want = quant._retile(parts[0], [p.rows() for p in parts])
    assert got.shape == want.shape == (60, 64)
    for name in ("codes", "scales", "mins"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or (a.tobytes() == b.tobytes() and a.shape == b.shape), name


@pytest.mark.parametrize("mins", [False, True])
def test_parts_of_different_widths_stack_in_the_widest_with_every_value_kept(mins):
    # A Q4_K_M file's QKV: 4-bit q and k (with stored mins, as Q4_K's) beside an 8-bit v (Q6_K's
    # conversion; symmetric, as Q8_0's): one 8-bit matrix, each weight's value unchanged.
    rng = np.random.default_rng(9)
    q, k = (quant.quantize(rng.standard_normal((n, 64)).astype(np.float32), 4) for n in (32, 16))
    if mins:
        q, k = (quant.from_blocks(*p.rows(), 4, 64) for p in (q, k))
    v = quant.quantize(rng.standard_normal((16, 64)).astype(np.float32), 8)
    got = quant.stack_rows([q, k, v])
    assert got.bits == 8 and got.mins is not None and got.shape == (64, 64)
    assert np.array_equal(got.dequantize(), np.concatenate([q.dequantize(), k.dequantize(), v.dequantize()]))


def test_a_weight_held_in_a_fused_format_keeps_every_value():
    # How a kept file holds a fused matrix's parts (loading.gguf): each in the fused format, so
    # that stacking them joins their bytes; a part already so held is not copied.
    rng = np.random.default_rng(10)
    q4, q8 = (quant.quantize(rng.standard_normal((24, 64)).astype(np.float32), bits) for bits in (4, 8))
    assert quant.fused_format([q4, q4]) == (4, False) and quant.fused_format([q4, q8]) == (8, True)
    for w in (q4, q8):
        held = quant.as_format(w, 8, True)
        assert (held.bits, held.shape) == (8, (24, 64)) and held.mins is not None
        assert np.array_equal(held.dequantize(), w.dequantize())
        assert quant.as_format(held, 8, True) is held


def test_arrays_lying_one_after_the_other_join_without_a_copy():
    # Adjacent views of one mapped buffer (kept weights) join as a view of it; apart, or from
    # different buffers, they are copied: the same values either way.
    import mmap

    buffer = mmap.mmap(-1, 4096)
    whole = np.frombuffer(buffer, np.uint16)
    whole[:] = np.arange(whole.size)
    a, b, c = (np.frombuffer(buffer, np.uint16, n, at).reshape(-1, 4) for n, at in ((8, 64), (12, 80), (4, 200)))
    view = quant.joined([a, b])
    assert view.tolist() == list(range(32, 52)) and quant.owner_of(view) is buffer and np.shares_memory(view, whole)
    view[0] = 7  # writable as the buffer is: the kernels take it as they take the parts
    assert a[0, 0] == 7
    for apart in ([a, c], [a, b.copy()], [b, a]):
        copy = quant.joined(apart)
        assert copy.tolist() == np.concatenate([x.reshape(-1) for x in apart]).tolist()
        assert not np.shares_memory(copy, whole)


@pytest.mark.parametrize("n", [12, 32])
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_blocks_tile_as_their_codes_do(n, bits):
    # Q8_0's bytes (input j) and Q4_0 / Q4_1's (input j low, j + 16 high) read as they are equal
    # the codes in input order, tiled.
    rng = np.random.default_rng(9)
    packed = rng.integers(0, 256, (n, 3, bits * 4), dtype=np.uint8)
    scales, mins = rng.standard_normal((2, n, 3)).astype(np.float16)
    codes = (packed if bits == 8 else np.concatenate([packed & 0x0F, packed >> 4], axis=-1)).reshape(n, 96)
    for m in (None, mins):
        got, want = quant.from_packed(packed, scales, m, bits, 96), quant.from_blocks(codes, scales, m, bits, 96)
        for name in ("codes", "scales", "mins"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or (a.tobytes() == b.tobytes() and a.shape == b.shape), name
