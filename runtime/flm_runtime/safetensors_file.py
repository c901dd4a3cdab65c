"""The safetensors file format, read directly: float32 arrays of a file's F32, F16, BF16 and F64
tensors.

Checkpoints are usually bfloat16, which numpy has no dtype for: ``safetensors.numpy.load_file``
and ``safe_open(framework="np")`` raise ``TypeError: data type 'bfloat16' not understood``
(checked on safetensors 0.8.0). The format is small and documented
(https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length N, N
bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (plus an optional
``"__metadata__"``), then the byte buffer the offsets point into. The buffer is memory-mapped;
each tensor is cast to float32 (bfloat16 = the upper 16 bits of a float32).

A leaf module (numpy and ``errors`` only): the checkpoint loaders (``loading``) and the DFlash
draft's reader of published drafts (``models.dflash``) both read through it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flm_runtime.errors import ModelFormatError

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, cast to float32 (C-contiguous copies).

    Raises:
        ModelFormatError: malformed header, offsets past the end, or a non-float dtype.
    """
    return dict(iter_safetensors(path))


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """``read_safetensors`` one tensor at a time, as ``(name, array)``: a caller can convert each
    before the next is read.

    Raises:
        ModelFormatError: malformed header, offsets past the end, or a non-float dtype.
    """
    header, data_start = _read_header(path)
    size = path.stat().st_size - data_start
    # np.asarray: a plain ndarray view, so the casts below do not come back as np.memmap.
    buffer = (np.asarray(np.memmap(path, dtype=np.uint8, mode="r", offset=data_start,
                                   shape=(size,)))
              if size > 0 else np.zeros(0, np.uint8))
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= size:
            raise ModelFormatError(f"{path}: tensor {name} has offsets {begin}..{end} past "
                                   f"the {size}-byte buffer")
        raw = buffer[begin:end]  # [nbytes] uint8, a view into the memory map
        yield name, _to_float32(raw, info["dtype"], f"{path}: tensor {name}").reshape(info["shape"])


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            raise ModelFormatError(f"{path}: header length {n} is not plausible")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{path}: invalid safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: invalid safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + n


def _to_float32(raw: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """``raw`` bytes ([nbytes] uint8, little-endian) of ``dtype`` as a new float32 array."""
    if dtype == "BF16":
        # bfloat16 is the top half of an IEEE float32: shift it into place.
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    numpy_dtype = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}.get(dtype)
    if numpy_dtype is None:
        raise ModelFormatError(f"{what}: dtype {dtype} is not supported (F32, F16, BF16, F64)")
    return raw.view(numpy_dtype).astype(np.float32)
