"""A model file's converted weights, kept on disk so that a later load maps them instead of
converting again (docs/design.md, "How weights are held").

``load`` gives the weights ``save`` wrote for the same source file and weight kind, or None; the
caller then converts, ``save`` writing each part of a tensor as it is converted, and maps the file.
One file per (source, kind) in the caller's directory (``paths.converted_dir()``):
``<key>-<kind>.flmw``, the key a digest of the source's absolute path. Its header records the
source's size, mtime and inode and a digest of the code whose rules the bytes follow
(``kernels/quant.py``, ``loading/gguf.py``, gguf-py's version); a file that does not match them,
is unreadable or has another length than its header says is not used, saying why. ``save`` writes
through ``flm_runtime.files.written_whole``; a disk without room is a ``DiskSpaceError`` (nothing
left), any other write failure only costs the conversion next time.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON: each array's
dtype, shape and offset), then from a 64-byte aligned offset every matrix's codes in the caller's
order, their scales, their mins, then each float32 array (``_layout``); in a quantized model's
stacking order the stacked arrays are views of the mapping (``layers.stack.stack_weights``). The
mapping is copy-on-write: writable views (numba compiles read-only arrays as another type).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.files import remove_stale, written_whole
from flm_runtime.kernels import quant
from flm_runtime.kernels.quant import QuantWeight, Weight

log = logging.getLogger(__name__)

MAGIC = b"FLMW\x00\x00\x00\x01"  # format 1
_ALIGN = 64


def cache_file(directory: Path, source: Path, kind: str) -> Path:
    """Where in ``directory`` the converted weights of ``source`` as ``kind`` are kept (the file
    may not exist)."""
    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:32]
    return directory / f"{key}-{kind}.flmw"


def load(directory: Path, source: Path, kind: str) -> dict[str, Weight] | None:
    """The weights ``save`` kept in ``directory`` for ``source`` as it is now and ``kind``, mapped
    from disk; None when there are none, or they are stale (logged at INFO: the source or the
    code changed) or unusable (a WARNING naming the file and why: another length than its header
    says, not a kept file, unreadable)."""
    path = cache_file(directory, source, kind)
    try:
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable, or empty (mmap refuses length 0)
        log.warning("not using the kept conversion %s (%s); converting again", path, e)
        return None
    try:
        if mapped[:len(MAGIC)] != MAGIC:
            raise ValueError("not a kept conversion of this format")
        n = int.from_bytes(mapped[len(MAGIC):len(MAGIC) + 8], "little")
        header = json.loads(mapped[len(MAGIC) + 8:len(MAGIC) + 8 + n])
        start = _aligned(len(MAGIC) + 8 + n)
        if start + header["length"] != len(mapped):
            raise ValueError(f"{len(mapped):,} bytes where its header says {start + header['length']:,}: "
                             "cut short or damaged")
        if header["stamp"] != _stamp(source, kind):
            log.info("the kept conversion %s is of another version of %s or of this code; converting again",
                     path, source)
            return None
        return {name: _weight(mapped, start, spec) for name, spec in header["tensors"].items()}
    except (ValueError, KeyError, TypeError) as e:  # truncated or foreign: convert again
        log.warning("not using the kept conversion %s (%s); converting again", path, e)
        return None


class Entry(NamedTuple):
    """How one kept tensor is held: ``bits`` 4 or 8 for a ``QuantWeight`` (``mins``: it stores
    mins), 0 for a float32 array; ``shape``: the matrix's ``[out, in]``, or the array's shape."""

    bits: int
    mins: bool
    shape: tuple[int, ...]

    @classmethod
    def like(cls, part: Weight, rows: int) -> Entry:
        """The entry of a tensor of ``rows`` rows converted as its rows ``part`` were."""
        if isinstance(part, QuantWeight):
            return cls(part.bits, part.mins is not None, (rows, part.in_features))
        return cls(0, False, (rows, *part.shape[1:]))


def save(directory: Path, source: Path, kind: str, entries: dict[str, Entry],
         parts: Iterable[tuple[str, int, Weight]]) -> bool:
    """Keep the weights converted from ``source`` as ``kind`` in ``directory`` for ``load``,
    written part by part as ``parts`` gives them (atomic: ``files.written_whole``; the directory
    is created, and temporary files that ended processes left in it removed).

    Args:
        entries: every tensor's format and shape; their order is the layout's (``_layout``).
        parts: ``(name, first row, weight)``: the rows ``first ..`` of tensor ``name``
            (``first`` a multiple of ``quant.TILE`` for a ``QuantWeight``), each row once.

    Returns:
        Whether the weights were kept; False (nothing written under the name): the directory or
        the file cannot be written (a read-only cache), or ``parts`` did not cover every row.

    Raises:
        DiskSpaceError: the directory's disk has no room for the file; nothing is left of it.
        ModelFormatError: from ``parts`` (the source's).
    """
    path = cache_file(directory, source, kind)
    tensors, length = _layout(entries)
    header = json.dumps({"stamp": _stamp(source, kind), "length": length, "tensors": tensors}).encode()
    start = _aligned(len(MAGIC) + 8 + len(header))
    rows = dict.fromkeys(entries, 0)  # written so far, per tensor
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale(directory):
            log.warning("removed %s, a conversion left unfinished by a process that ended while writing it", stale)
        with written_whole(path, start + length) as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            f.flush()
            for name, first, part in parts:
                rows[name] += _write_part(f.fileno(), start, tensors[name], first, part)
            if rows != {name: e.shape[0] for name, e in entries.items()}:
                raise ValueError(f"rows written {rows} are not the tensors' rows")
        return True
    except ModelFormatError:  # the source's, not the cache's
        raise
    except (OSError, ValueError) as e:  # a read-only cache only costs the conversion next time
        log.debug("cannot write %s: %s", path, e)
        return False


def _layout(entries: dict[str, Entry]) -> tuple[dict, int]:
    """The header's tensor entries (arrays as ``[dtype, shape, offset from the data's start]``) and
    the data's length. The matrices' codes come one after the other in ``entries``' order, then
    their scales, then the mins of those that store them, then each float32 array at an aligned
    offset: so that consecutive matrices' arrays are one array (``quant.joined``) and the
    stacked model's arrays are views of the mapping (``layers.stack.stack_weights``)."""
    matrices = {name: e for name, e in entries.items() if e.bits}
    shapes = {name: quant.tiled_shapes(e.bits, *e.shape) for name, e in matrices.items()}
    tensors: dict[str, dict] = {name: {"bits": e.bits, "out": e.shape[0], "in": e.shape[1], "mins": None}
                                for name, e in matrices.items()}
    length = 0

    def place(dtype: str, shape: tuple[int, ...]) -> list:
        nonlocal length
        at, length = length, length + int(np.prod(shape)) * np.dtype(dtype).itemsize
        return [dtype, list(shape), at]

    for field, dtype, shape_of in (("codes", "|u1", 0), ("scales", "<f2", 1), ("mins", "<f2", 1)):
        length = _aligned(length)
        for name, e in matrices.items():
            if field != "mins" or e.mins:
                tensors[name][field] = place(dtype, shapes[name][shape_of])
    for name, e in entries.items():
        if not e.bits:
            length = _aligned(length)
            tensors[name] = {"array": place("<f4", e.shape)}
    return tensors, _aligned(length)


def _write_part(fd: int, start: int, spec: dict, first: int, part: Weight) -> int:
    """Write ``part``, the rows ``first ..`` of the tensor of header entry ``spec``, at its place in
    the file ``fd`` (data from ``start``); returns its rows.

    Raises:
        ValueError: the part's format or shape is not the entry's.
    """
    if isinstance(part, QuantWeight):
        if part.bits != spec.get("bits") or part.in_features != spec["in"] or first % quant.TILE or \
                (part.mins is not None) != (spec["mins"] is not None):
            raise ValueError(f"a part of {part.bits}-bit rows from {first} does not fit {spec}")
        arrays = [(part.codes, spec["codes"]), (part.scales, spec["scales"]), (part.mins, spec["mins"])]
        at, rows = first // quant.TILE, part.out_features
    else:
        if "array" not in spec or list(part.shape[1:]) != spec["array"][1][1:] or part.dtype != np.float32:
            raise ValueError(f"a part of shape {part.shape} does not fit {spec}")
        arrays, at, rows = [(part, spec["array"])], first, part.shape[0]
    for a, entry in arrays:
        if a is not None:  # entry: [dtype, shape, offset]
            a = np.ascontiguousarray(a)
            os.pwrite(fd, a.data.cast("B"), start + entry[2] + at * a[0].nbytes)
    return rows


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _weight(mapped: mmap.mmap, start: int, spec: dict) -> Weight:
    """One header entry's weight, its arrays views of ``mapped`` (data from ``start``)."""
    def array(entry: list | None) -> np.ndarray | None:
        if entry is None:
            return None
        dtype, shape, offset = np.dtype(entry[0]), tuple(entry[1]), entry[2]
        return np.frombuffer(mapped, dtype, int(np.prod(shape)), start + offset).reshape(shape)

    if "array" in spec:
        return array(spec["array"])
    return QuantWeight(spec["bits"], array(spec["codes"]), array(spec["scales"]), array(spec["mins"]), spec["in"],
                       spec["out"])


def _stamp(source: Path, kind: str) -> dict:
    """What the kept weights must have been converted from and by to be used."""
    st = source.stat()
    return {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "kind": kind, "code": _code_digest()}


@functools.cache
def _code_digest() -> str:
    """A digest of the code whose rules converted weights follow: the block format and the GGUF
    conversions (their sources' bytes) and gguf-py (its version: its dequantization)."""
    h = hashlib.sha256(importlib.metadata.version("gguf").encode())
    for source in (Path(quant.__file__), Path(__file__).with_name("gguf.py")):
        h.update(source.read_bytes())
    return h.hexdigest()
