"""Byte layouts of the npu backend's buffers, as ``xclbins/flm_xclbins/manifest.json`` states them.

bfloat16 has no numpy dtype: it is carried as ``uint16`` (the upper half of a float32), rounded to
nearest-even on the way in. Weight buffers pack named tensors in the manifest's order, each at a
multiple of the layout's ``alignment_bytes``; ``pack`` writes them and ``unpack`` reads them back
(the numpy reference kernels and the tests use it).
"""

from __future__ import annotations

import numpy as np

from flm_runtime.backends.npu.manifest import Manifest

STEP_FIELDS = ("start", "T", "S", "first_row")  # the int32[4] "step" buffer, manifest abi.step
_ITEMSIZE = {"bfloat16": 2, "float32": 4, "int32": 4}


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (``uint16``), round to nearest, ties to even (NaN stays NaN)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (``uint16``) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def layout_entries(manifest: Manifest, layout: str, geometry: dict) -> tuple[list[tuple[str, tuple, int]], int]:
    """``([(tensor, shape, byte offset)], total bytes)`` of a weight layout for ``geometry``."""
    spec = manifest.layouts[layout]
    align, itemsize = int(spec["alignment_bytes"]), _ITEMSIZE[spec["dtype"]]
    entries, offset = [], 0
    for name, shape in manifest.layout_shapes(layout, geometry):
        entries.append((name, shape, offset))
        offset += _round_up(int(np.prod(shape)) * itemsize, align)
    return entries, offset


def pack(manifest: Manifest, layout: str, geometry: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """float32 tensors -> one ``uint8`` buffer in ``layout`` (bfloat16, aligned, zero padding).

    Raises:
        AssertionError: a tensor is missing or its shape is not the layout's (a bug: the caller
            passes the model's own, shape-checked, arrays).
    """
    entries, total = layout_entries(manifest, layout, geometry)
    buf = np.zeros(total, dtype=np.uint8)
    for name, shape, offset in entries:
        a = tensors[name]
        assert tuple(a.shape) == shape, f"{layout}.{name}: shape {a.shape}, layout says {shape}"
        bits = to_bf16(a).reshape(-1)
        buf[offset : offset + bits.nbytes] = bits.view(np.uint8)
    return buf


def unpack(manifest: Manifest, layout: str, geometry: dict, buf) -> dict[str, np.ndarray]:
    """A ``layout`` buffer (any bytes-like of at least its size) -> float32 tensors by name."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    entries, total = layout_entries(manifest, layout, geometry)
    assert raw.size >= total, f"{layout}: buffer of {raw.size} bytes, layout needs {total}"
    return {name: from_bf16(raw[offset : offset + 2 * int(np.prod(shape))].view(np.uint16)).reshape(shape)
            for name, shape, offset in entries}


def step_array(start: int, t: int, capacity: int, first_row: int) -> np.ndarray:
    """The ``step`` buffer's contents: int32 ``[start, T, S, first_row]``."""
    return np.array([start, t, capacity, first_row], dtype=np.int32)


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum
