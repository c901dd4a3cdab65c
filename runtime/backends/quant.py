"""The cpu backend's quantized weight format: blocks of 32 unsigned codes with a float16 scale and
an optional float16 min, so that a weight is ``w = scale * code + min`` (docs/design.md,
"Quantized weights").

Two widths, one formula:

- 4-bit: codes 0..15, two per byte. GGUF's Q4_0 (``min = -8 * scale``), Q4_1 (its own min) and
  Q4_K (sub-block scales and mins folded into per-32 values, rounded to float16) load as they are.
- 8-bit: codes 0..255, one per byte. GGUF's Q8_0 (``min = -128 * scale``) loads as it is; every
  other source (Q5/Q6 K-quants, F16, BF16, F32 GGUF tensors, safetensors) is quantized to it.

Layout of one weight row of ``K`` inputs, ``K`` padded with zero blocks to ``Kp``, a multiple of
``CHUNK`` = 64 (two blocks), so that the kernels step a whole 512-bit vector of codes at a time.
Inside a chunk the inputs are stored in "lane order", ``CHUNK_ORDER``: four inputs of the first
block, four of the second, and so on, so that a 32-bit lane of a vector holds four inputs of one
block and the lanes alternate between the chunk's two blocks (a kernel then needs only the two
block scales, broadcast, per chunk):

- 8-bit: ``codes[n, 64c + p]`` is the code of input ``64c + CHUNK_ORDER[p]``.
- 4-bit: chunk ``c`` is 32 bytes; byte ``p`` holds lane-order position ``p`` in its low nibble
  and position ``p + 32`` in its high nibble.
- ``scales[n, b]`` / ``mins[n, b]``: block ``b`` (inputs ``32b .. 32b+31``). Without stored mins,
  ``min = -zero_point * scale`` (8 for 4-bit, 128 for 8-bit): a symmetric source needs no copy.

Memory: 4-bit 0.5625 bytes a weight (0.625 with mins), 8-bit 1.0625.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # inputs per scale
CHUNK = 64  # inputs per kernel step: two blocks
ZERO_POINT = {4: 8, 8: 128}  # the code of weight 0 in a symmetric block
# Lane order: position p of a chunk holds input CHUNK_ORDER[p] (module docstring).
CHUNK_ORDER = np.array([BLOCK * ((p // 4) % 2) + (p // 8) * 4 + p % 4 for p in range(CHUNK)])


@dataclass(frozen=True)
class QuantWeight:
    """A ``[out_features, in_features]`` linear weight in blocks of 32 (module docstring).

    Attributes:
        bits: 4 or 8.
        codes: ``[N, Kp/2]`` (4-bit) or ``[N, Kp]`` (8-bit) uint8, C-contiguous.
        scales: ``[N, Kp/32]`` float16.
        mins: ``[N, Kp/32]`` float16, or None for ``-ZERO_POINT[bits] * scales``.
        in_features: ``K``, the unpadded input width.
    """

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    in_features: int

    def __post_init__(self) -> None:
        n, kp = self.scales.shape[0], self.scales.shape[1] * BLOCK
        assert self.bits in ZERO_POINT and kp % CHUNK == 0 and kp - CHUNK < self.in_features <= kp
        assert self.codes.shape == (n, kp * self.bits // 8) and self.codes.dtype == np.uint8
        assert self.scales.dtype == np.float16 and (self.mins is None or self.mins.shape == self.scales.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.in_features

    @property
    def padded_in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def block_mins(self) -> np.ndarray:
        """``[N, Kp/32]`` float32 mins (stored, or ``-zero_point * scale``)."""
        if self.mins is not None:
            return self.mins.astype(np.float32)
        return np.float32(-ZERO_POINT[self.bits]) * self.scales.astype(np.float32)

    def unpacked_codes(self) -> np.ndarray:
        """``[N, Kp]`` uint8 codes in input order."""
        n = self.codes.shape[0]
        if self.bits == 8:
            lanes = self.codes.reshape(n, -1, CHUNK)  # [N, Kp/64, 64] in lane order
        else:
            chunks = self.codes.reshape(n, -1, CHUNK // 2)  # [N, Kp/64, 32]
            lanes = np.concatenate([chunks & 0x0F, chunks >> 4], axis=-1)
        out = np.empty_like(lanes)
        out[..., CHUNK_ORDER] = lanes
        return out.reshape(n, -1)

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The float32 weights ``[N, K]`` (or only ``rows``: ``[len(rows), K]``), ``scale * code + min``
        in float32, as gguf-py computes them."""
        w = self if rows is None else self.take_rows(rows)
        n = w.scales.shape[0]
        codes = w.unpacked_codes().reshape(n, -1, BLOCK).astype(np.float32)  # [N, Kp/32, 32]
        scales, mins = w.scales.astype(np.float32)[..., None], w.block_mins()[..., None]
        return (scales * codes + mins).reshape(n, -1)[:, : self.in_features]

    def take_rows(self, rows: np.ndarray) -> QuantWeight:
        """The weight of output rows ``rows`` (a permutation, a subset), still quantized."""
        rows = np.asarray(rows, dtype=np.int64)
        mins = None if self.mins is None else np.ascontiguousarray(self.mins[rows])
        return QuantWeight(self.bits, np.ascontiguousarray(self.codes[rows]),
                           np.ascontiguousarray(self.scales[rows]), mins, self.in_features)


Weight = np.ndarray | QuantWeight  # a matrix: float32 ``[out, in]``, or this module's block format


def stack_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one input width stacked along the output rows (the fused QKV and gate/up)."""
    first = weights[0]
    assert all(w.bits == first.bits and w.in_features == first.in_features for w in weights)
    if all(w.mins is None for w in weights):
        mins = None
    else:
        mins = np.concatenate([w.block_mins().astype(np.float16) if w.mins is None else w.mins for w in weights])
    return QuantWeight(first.bits, np.concatenate([w.codes for w in weights]),
                       np.concatenate([w.scales for w in weights]), mins, first.in_features)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[N, Kp]`` uint8 codes in input order -> the stored layout (module docstring)."""
    n = codes.shape[0]
    lanes = codes.reshape(n, -1, CHUNK)[..., CHUNK_ORDER].astype(np.uint8)  # [N, Kp/64, 64] in lane order
    if bits == 4:
        lanes = lanes[..., : CHUNK // 2] | (lanes[..., CHUNK // 2 :] << 4)
    return np.ascontiguousarray(lanes.reshape(n, -1))


def from_blocks(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int,
                in_features: int) -> QuantWeight:
    """A ``QuantWeight`` from codes in input order ``[N, K]`` (uint8) and per-block ``scales`` /
    ``mins`` ``[N, K/32]`` (any float dtype, stored as float16), padding ``K`` to a whole chunk."""
    n, k = codes.shape
    assert k == in_features and k % BLOCK == 0 and scales.shape == (n, k // BLOCK)
    pad = -k % CHUNK
    codes = np.pad(codes.astype(np.uint8), ((0, 0), (0, pad)))
    # A zero block has scale 0 and min 0: it adds nothing whatever its codes.
    scales = np.pad(np.asarray(scales, dtype=np.float16), ((0, 0), (0, pad // BLOCK)))
    if mins is not None:
        mins = np.pad(np.asarray(mins, dtype=np.float16), ((0, 0), (0, pad // BLOCK)))
    return QuantWeight(bits, pack_codes(codes, bits), np.ascontiguousarray(scales),
                       None if mins is None else np.ascontiguousarray(mins), in_features)


def quantize(w: np.ndarray, bits: int) -> QuantWeight:
    """Symmetric round-to-nearest quantization of a float weight ``[N, K]`` (``K % 32 == 0``).

    Per block: ``scale = max|w| / 127`` and ``code = rint(w / scale) + 128`` for 8-bit (Q8_0's
    rule); for 4-bit, llama.cpp's Q4_0 rule: the block value of largest magnitude maps to code 0,
    ``scale = that value / -8``, ``code = clip(rint(w / scale) + 8, 0, 15)``.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"a quantized weight needs in_features divisible by {BLOCK}, got {k}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    if bits == 8:
        scale = np.abs(blocks).max(axis=-1) / np.float32(127.0)  # [N, K/32]
    else:
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        scale = np.take_along_axis(blocks, idx, axis=-1)[..., 0] / np.float32(-8.0)
    scale = scale.astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
    zero = ZERO_POINT[bits]
    codes = np.clip(np.rint(blocks * inv) + zero, 0, 2 * zero - 1).astype(np.uint8).reshape(n, k)
    return from_blocks(codes, scale, None, bits, k)
