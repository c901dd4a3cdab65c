"""The cpu backend's quantized weight format: blocks of 32 unsigned codes with a float16 scale and
an optional float16 min, so that a weight is ``w = scale * code + min`` (docs/design.md,
"Quantized weights").

Three widths:

- 4-bit: codes 0..15, two per byte. GGUF's Q4_0 (``min = -8 * scale``), Q4_1 (its own min) and
  Q4_K (sub-block scales and mins folded into per-32 values, rounded to float16) load as they are.
- 6-bit: GGUF's Q6_K as it is: codes 0..63, and per half block (16 inputs) a signed 8-bit
  sub-scale ``sub``, so that ``w = scale * sub * (code - 32)`` with ``scale`` the super-block's
  ``d`` (the block's float16 scale; no mins). 7 bits a weight where Q6_K's file takes 6.56 (its
  ``d`` once per 256 inputs).
- 8-bit: codes 0..255, one per byte. GGUF's Q8_0 (``min = -128 * scale``) loads as it is; every
  other source (Q5 K-quants, F16, BF16, F32 GGUF tensors, safetensors) is quantized to it.

Layout: tiles of ``TILE`` = 16 output rows. A row's ``K`` inputs are padded with zero blocks to
``Kp``, a multiple of ``BLOCK``; the rows to ``Np``, a multiple of ``TILE`` (zero scales and mins).
Within tile ``t`` and block ``b``, the codes of "group" ``g`` (inputs ``32b + 4g .. 32b + 4g + 3``)
of the tile's 16 rows are one 64-byte vector, row after row, four codes each: a kernel multiplies
it by four activations broadcast to every 32-bit lane, and lane ``l`` accumulates row ``16t + l``
(the layout of llama.cpp's repacked CPU kernels, in tiles of 16 rows). A tile's block takes
``block_bytes(bits)`` bytes of ``codes``:

- 8-bit: ``codes[t, 512b + 64g + 4l + i]`` is the code of row ``16t + l``, input ``32b + 4g + i``
  (``g < 8``).
- 4-bit: ``codes[t, 256b + 64g + 4l + i]`` holds group ``g`` (``g < 4``) in its low nibble and
  group ``g + 4`` in its high nibble.
- 6-bit: ``codes[t, 416b + ..]``: the codes' low four bits as 4-bit blocks pack them (256 bytes),
  then their high two bits, group ``g``'s at bits ``2 (g % 4)`` of byte ``256 + 64 (g // 4) + 4l +
  i`` (128 bytes), then the sub-scales, ``sub`` of row ``16t + l``, half ``h`` (groups ``4h ..
  4h + 3``) at byte ``384 + 16h + l`` (32 bytes).
- ``scales[t, 16b + l]`` / ``mins[t, 16b + l]``: row ``16t + l``, block ``b``. Without stored
  mins, ``min = -zero_point * scale`` (8 for 4-bit, 128 for 8-bit): a symmetric source needs no
  copy.

Memory: 4-bit 0.5625 bytes a weight (0.625 with mins), 6-bit 0.875, 8-bit 1.0625.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # inputs per scale
TILE = 16  # output rows per tile: one 32-bit lane each of a 512-bit vector
GROUP = 4  # inputs per lane of one code vector (what vpdpbusd sums in a lane)
ZERO_POINT = {4: 8, 6: 32, 8: 128}  # the code of weight 0 in a symmetric block
SUB_BLOCK = 16  # inputs per sub-scale of a 6-bit block
HIGH_BITS_AT = TILE * BLOCK // 2  # where a 6-bit tile block's high-bit planes start in its bytes
SUB_SCALES_AT = HIGH_BITS_AT + TILE * BLOCK // 4  # and its sub-scales


def block_bytes(bits: int) -> int:
    """Bytes of ``codes`` per tile and block (module docstring): the codes, and a 6-bit block's
    sub-scales."""
    return TILE * BLOCK * bits // 8 + (TILE * BLOCK // SUB_BLOCK if bits == 6 else 0)


@dataclass(frozen=True)
class QuantWeight:
    """A ``[out_features, in_features]`` linear weight in tiles of blocks (module docstring).

    Attributes:
        bits: 4, 6 or 8.
        codes: ``[Np/16, Kp/32 * block_bytes(bits)]`` uint8, C-contiguous.
        scales: ``[Np/16, Kp/32 * 16]`` float16.
        mins: like ``scales``, or None for ``-ZERO_POINT[bits] * scales``.
        in_features: ``K``, the unpadded input width.
        out_features: ``N``, the unpadded output width.
    """

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        tiles, nb = self.scales.shape[0], self.scales.shape[1] // TILE
        assert self.bits in ZERO_POINT and self.scales.shape[1] == nb * TILE and self.scales.dtype == np.float16
        assert nb * BLOCK - BLOCK < self.in_features <= nb * BLOCK
        assert tiles * TILE - TILE < self.out_features <= tiles * TILE
        assert self.codes.shape == (tiles, nb * block_bytes(self.bits)) and self.codes.dtype == np.uint8
        assert self.mins is None or (self.mins.shape == self.scales.shape and self.bits != 6)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def padded_in_features(self) -> int:
        return self.scales.shape[1] // TILE * BLOCK

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def rows(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A 4- or 8-bit weight's rows ``rows`` (default all ``N``) in input order: codes ``[R, Kp]``
        uint8, block scales and block mins ``[R, Kp/32]`` float32 (stored mins, or ``-zero_point *
        scale``). A 6-bit weight's: ``six_bit_rows``."""
        assert self.bits != 6
        t, lane, nb = self._lanes_of(rows)
        if self.bits == 8:
            codes = self.codes.reshape(-1, nb, BLOCK // GROUP, TILE, GROUP)[t, :, :, lane]  # [R, nb, 8, 4]
        else:
            packed = self.codes.reshape(-1, nb, BLOCK // GROUP // 2, TILE, GROUP)[t, :, :, lane]  # [R, nb, 4, 4]
            codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)
        scales = self.scales.reshape(-1, nb, TILE)[t, :, lane].astype(np.float32)  # [R, nb]
        if self.mins is None:
            mins = np.float32(-ZERO_POINT[self.bits]) * scales
        else:
            mins = self.mins.reshape(-1, nb, TILE)[t, :, lane].astype(np.float32)
        return codes.reshape(t.size, -1), scales, mins

    def six_bit_rows(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A 6-bit weight's rows ``rows`` (default all ``N``) as ``from_six_bit`` takes them: codes
        ``[R, Kp]`` uint8 (0..63), block scales ``[R, Kp/32]`` float32, sub-scales ``[R, Kp/16]``
        int8."""
        assert self.bits == 6
        t, lane, nb = self._lanes_of(rows)
        blocks = self.codes.reshape(-1, nb, block_bytes(6))
        low = blocks[..., :HIGH_BITS_AT].reshape(-1, nb, BLOCK // GROUP // 2, TILE, GROUP)[t, :, :, lane]  # [R, nb, 4, 4]
        high = blocks[..., HIGH_BITS_AT:SUB_SCALES_AT].reshape(-1, nb, 2, TILE, GROUP)[t, :, :, lane]  # [R, nb, 2, 4]
        codes = np.concatenate([low & 0x0F, low >> 4], axis=2)  # [R, nb, 8, 4]
        for g in range(BLOCK // GROUP):
            codes[:, :, g] |= ((high[:, :, g // 4] >> (2 * (g % 4))) & 3) << 4
        subs = blocks[..., SUB_SCALES_AT:].reshape(-1, nb, BLOCK // SUB_BLOCK, TILE)[t, :, :, lane].view(np.int8)  # [R, nb, 2]
        scales = self.scales.reshape(-1, nb, TILE)[t, :, lane].astype(np.float32)
        return codes.reshape(t.size, -1), scales, subs.reshape(t.size, -1)

    def _lanes_of(self, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        """The tile and lane of each of ``rows`` (default all), and the blocks of a row."""
        rows = np.arange(self.out_features) if rows is None else np.asarray(rows, dtype=np.int64)
        return rows // TILE, rows % TILE, self.scales.shape[1] // TILE

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The float32 weights ``[N, K]`` (or only ``rows``: ``[len(rows), K]``) as gguf-py computes
        them: ``scale * code + min`` in float32, 6-bit ones ``(scale * sub) * (code - 32)``."""
        if self.bits == 6:
            codes, scales, subs = self.six_bit_rows(rows)
            halves = codes.reshape(codes.shape[0], -1, SUB_BLOCK).astype(np.float32) - np.float32(ZERO_POINT[6])
            sub_scales = np.repeat(scales, BLOCK // SUB_BLOCK, axis=1) * subs.astype(np.float32)  # exact
            w = sub_scales[..., None] * halves
        else:
            codes, scales, mins = self.rows(rows)
            blocks = codes.reshape(codes.shape[0], -1, BLOCK).astype(np.float32)  # [R, nb, 32]
            w = scales[..., None] * blocks + mins[..., None]
        return w.reshape(codes.shape[0], -1)[:, : self.in_features]

    def take_rows(self, rows: np.ndarray) -> QuantWeight:
        """The weight of output rows ``rows`` (a permutation, a subset), still quantized."""
        return _retile(self, [_fields(self, rows)])


Weight = np.ndarray | QuantWeight  # a matrix: float32 ``[out, in]``, or this module's block format


def stack_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one input width stacked along the output rows (the fused QKV and gate/up), in
    ``fused_format``: parts of different formats (a Q4_K_M file's 6-bit ``attn_v`` beside 4-bit q
    and k) are tiled again in it (``as_format``)."""
    first = weights[0]
    assert all(w.in_features == first.in_features for w in weights)
    fused = fused_format(weights)
    parts = [as_format(w, *fused) for w in weights]
    if all(w.out_features % TILE == 0 for w in parts[:-1]):
        # Whole tiles (a model's Q, K and V rows are): stacking rows is stacking tiles, the bytes
        # joined instead of untiled and tiled again (a tenth of a load's time), with no copy when
        # they lie one after the other already (kept weights, laid out so).
        def stacked(arrays: list[np.ndarray]) -> np.ndarray:
            return joined(arrays).reshape(-1, arrays[0].shape[1])

        mins = None if parts[0].mins is None else stacked([w.mins for w in parts])
        return QuantWeight(parts[0].bits, stacked([w.codes for w in parts]), stacked([w.scales for w in parts]), mins,
                           first.in_features, sum(w.out_features for w in parts[:-1]) + parts[-1].out_features)
    return _retile(parts[0], [_fields(w) for w in parts])


def fused_format(weights: list[QuantWeight]) -> tuple[int, bool]:
    """``(bits, mins stored)`` of ``weights`` stacked by rows (``stack_rows``): their width when
    they share it; else the widest, 6-bit counted as 8 (``as_format``), with stored mins (the
    widths' zero points differ), as when one of them stores its own."""
    widths = {w.bits for w in weights}
    if len(widths) == 1:
        return widths.pop(), any(w.mins is not None for w in weights)
    return max(8 if bits == 6 else bits for bits in widths), True


def as_format(w: QuantWeight, bits: int, mins: bool) -> QuantWeight:
    """``w``'s weights as ``bits``-bit blocks with (``mins``) or without stored mins: ``w`` itself
    when it is held so, else tiled again with its mins stored, every weight keeping its value
    exactly (a code is a code of the same block scale and min at a wider width). A 6-bit weight's
    sub-scales have no place in 8-bit blocks: it is quantized to 8 bits (``quantize``), as every
    Q6_K weight was before 6-bit blocks; a weight changes by at most half an 8-bit step."""
    if (w.bits, w.mins is not None) == (bits, mins):
        return w
    if w.bits == 6:
        return as_format(quantize(w.dequantize(), 8), bits, mins)
    assert mins and bits >= w.bits, f"{w.bits}-bit blocks are not held exactly as {bits}-bit ones without mins"
    return _tiled(*w.rows(), bits, w.in_features)


def joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The ``arrays`` (one dtype) flattened and concatenated, ``[sum of sizes]``: a view, not a
    copy, when they are C-contiguous and lie one after the other in one buffer (the stacked layout
    of kept weights, ``loading.converted``), else a new array."""
    dtype, owner = arrays[0].dtype, owner_of(arrays[0])
    if all(a.dtype == dtype and a.flags.c_contiguous and owner_of(a) is owner for a in arrays) and all(
            a.ctypes.data + a.nbytes == b.ctypes.data for a, b in zip(arrays, arrays[1:])):
        offset = arrays[0].ctypes.data - np.frombuffer(owner, np.uint8).ctypes.data
        return np.frombuffer(owner, dtype, sum(a.size for a in arrays), offset)
    return np.concatenate([a.reshape(-1) for a in arrays])


def owner_of(a: np.ndarray) -> object:
    """The object whose memory ``a`` views: a mapped file (``mmap.mmap``), or the array that
    owns the data."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    owner = a if a.base is None else a.base
    while isinstance(owner, memoryview):  # np.frombuffer's base: a memoryview of the buffer
        owner = owner.obj
    return owner


def tiled_shapes(bits: int, out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of a ``QuantWeight``'s ``codes`` (uint8) and of its ``scales`` and ``mins``
    (float16) for an ``[out_features, in_features]`` matrix of ``bits``-bit codes."""
    tiles, blocks = -(-out_features // TILE), -(-in_features // BLOCK)
    return (tiles, blocks * block_bytes(bits)), (tiles, blocks * TILE)


def _fields(w: QuantWeight, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w``'s rows ``rows`` (default all) untiled: ``six_bit_rows`` of a 6-bit weight, else ``rows``."""
    return w.six_bit_rows(rows) if w.bits == 6 else w.rows(rows)


def _retile(like: QuantWeight, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> QuantWeight:
    """``_fields`` results stacked in order, tiled again in ``like``'s format."""
    codes, scales, third = (np.concatenate(a) for a in zip(*parts))
    if like.bits == 6:
        return from_six_bit(codes, scales, third, like.in_features)
    return _tiled(codes, scales, None if like.mins is None else third, like.bits, like.in_features)


def from_blocks(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int,
                in_features: int) -> QuantWeight:
    """A ``QuantWeight`` from codes in input order ``[N, K]`` (uint8) and per-block ``scales`` /
    ``mins`` ``[N, K/32]`` (any float dtype, stored as float16)."""
    n, k = codes.shape
    assert k == in_features and k % BLOCK == 0 and scales.shape == (n, k // BLOCK)
    return _tiled(codes, scales, mins, bits, in_features)


def from_packed(packed: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int,
                in_features: int) -> QuantWeight:
    """A ``QuantWeight`` from blocks whose bytes are already packed as a tile packs a lane's:
    ``packed[n, b]`` (``[N, K/32, 32 * bits/8]`` uint8, any strides) holds in byte ``j`` input
    ``32b + j`` (8-bit), or input ``32b + j`` in its low nibble and ``32b + j + 16`` in its high
    one (4-bit: GGUF's Q4_0 and Q4_1 packing); ``scales`` / ``mins`` ``[N, K/32]`` as
    ``from_blocks``. Byte ``j = 4g + i`` is group ``g``'s code ``i``, so tiling moves bytes and
    never splits them.
    """
    n, nb, width = packed.shape
    assert width == BLOCK * bits // 8 and in_features == nb * BLOCK and scales.shape == (n, nb)
    codes = np.zeros((-(-n // TILE), nb, width // GROUP, TILE, GROUP), dtype=np.uint8)  # [t, b, g, l, i]
    # A lane's GROUP codes move as one 32-bit word: a quarter of the elements to copy.
    _by_lane(codes.view(np.uint32)[..., 0].transpose(0, 3, 1, 2), packed.view(np.uint32))
    return QuantWeight(bits, codes.reshape(codes.shape[0], -1), _lanes(scales), None if mins is None else _lanes(mins),
                       in_features, n)


def from_six_bit(codes: np.ndarray, scales: np.ndarray, subs: np.ndarray, in_features: int) -> QuantWeight:
    """A 6-bit ``QuantWeight`` (``w = scale * sub * (code - 32)``) from codes in input order ``[N,
    Kp']`` (uint8, 0..63; ``Kp'`` a multiple of 32 covering ``in_features``), block scales ``[N,
    Kp'/32]`` (any float dtype, stored as float16) and sub-scales ``[N, Kp'/16]`` (int8)."""
    n, nb = scales.shape
    assert codes.shape == (n, nb * BLOCK) and subs.shape == (n, nb * BLOCK // SUB_BLOCK) and codes.max(initial=0) < 64
    pad = -n % TILE
    tiles = (n + pad) // TILE
    by_group = np.pad(codes.astype(np.uint8), ((0, pad), (0, 0))).reshape(tiles, TILE, nb, BLOCK // GROUP, GROUP)
    by_group = by_group.transpose(0, 2, 3, 1, 4)  # [t, b, g, l, i]
    half = BLOCK // GROUP // 2
    low = (by_group[:, :, :half] & 0x0F) | ((by_group[:, :, half:] & 0x0F) << 4)  # [t, b, 4, l, i]
    high = by_group >> 4
    planes = np.stack([high[:, :, 4 * j] | high[:, :, 4 * j + 1] << 2 | high[:, :, 4 * j + 2] << 4
                       | high[:, :, 4 * j + 3] << 6 for j in range(2)], axis=2)  # [t, b, 2, l, i]
    sub_lanes = np.pad(subs.astype(np.int8), ((0, pad), (0, 0))).view(np.uint8)
    sub_lanes = sub_lanes.reshape(tiles, TILE, nb, BLOCK // SUB_BLOCK).transpose(0, 2, 3, 1)  # [t, b, h, l]
    blocks = np.concatenate([a.reshape(tiles, nb, -1) for a in (low, planes, sub_lanes)], axis=2)
    return QuantWeight(6, np.ascontiguousarray(blocks.reshape(tiles, -1)), _lanes(scales), None, in_features, n)


def _lanes(a: np.ndarray) -> np.ndarray:
    """Per-block values ``[N, nb]`` in the tiled layout ``[Np/16, nb * 16]`` float16 (padding rows
    zero)."""
    n, nb = a.shape
    out = np.zeros((-(-n // TILE), nb, TILE), dtype=np.float16)
    _by_lane(out.transpose(0, 2, 1), a)
    return out.reshape(out.shape[0], -1)


def _by_lane(dst: np.ndarray, src: np.ndarray) -> None:
    """Row ``16t + l`` of ``src`` ``[N, ...]`` into ``dst[t, l]`` (``dst`` ``[Np/16, 16, ...]``, a
    view of a tiled array): one strided copy, no padded copy of ``src`` first."""
    full, rest = divmod(src.shape[0], TILE)
    dst[:full] = src[:full * TILE].reshape(full, TILE, *src.shape[1:])
    if rest:
        dst[full, :rest] = src[full * TILE:]


def _tiled(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int,
           in_features: int) -> QuantWeight:
    """Codes ``[N, Kp']`` in input order (``Kp'`` a multiple of 32 covering ``in_features``),
    block scales / mins ``[N, Kp'/32]`` -> the tiled layout; rows padded with zero scales and mins
    (a zero block adds nothing whatever its codes)."""
    n, nb = scales.shape
    pad = -n % TILE
    codes = np.pad(codes.astype(np.uint8), ((0, pad), (0, 0)))
    tiles = (n + pad) // TILE
    by_group = codes.reshape(tiles, TILE, nb, BLOCK // GROUP, GROUP).transpose(0, 2, 3, 1, 4)  # [t, b, g, l, i]
    if bits == 4:
        half = BLOCK // GROUP // 2
        by_group = by_group[:, :, :half] | (by_group[:, :, half:] << 4)
    return QuantWeight(bits, np.ascontiguousarray(by_group.reshape(tiles, -1)), _lanes(scales),
                       None if mins is None else _lanes(mins), in_features, n)


def widen(w: QuantWeight) -> QuantWeight:
    """A 4-bit weight as 8-bit blocks holding the same values exactly: the codes as they are with
    the stored mins, or, without mins, shifted by ``ZERO_POINT[8] - ZERO_POINT[4]`` so that the
    8-bit zero point gives ``scale * (code - 8)`` again."""
    assert w.bits == 4
    codes, scales, mins = w.rows()
    if w.mins is None:
        return _tiled(codes + np.uint8(ZERO_POINT[8] - ZERO_POINT[4]), scales, None, 8, w.in_features)
    return _tiled(codes, scales, mins, 8, w.in_features)


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
