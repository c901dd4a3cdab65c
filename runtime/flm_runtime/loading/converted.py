"""A model file's converted weights, kept on disk so that a later load maps them instead of
converting again.

A GGUF's matrices are converted to the cpu backend's tiled blocks at every load (0.15 s for the
embedded default on the AVX-512 host; a K-quant file's 6-bit matrices are dequantized and
quantized again, slower still). ``load`` gives the weights ``save`` wrote for the same source file
and weight kind, or None; the caller converts and saves then.

One file per (source file, weight kind) in the caller's directory (``paths.converted_dir()``):
``<key>-<kind>.flmw``, the key a digest of the source's absolute path (as the registry's
``.verified`` records: nothing is written beside a user's files). Its header records the
source's size, mtime and inode and a digest of the code whose rules the bytes follow
(``kernels/quant.py``, ``loading/gguf.py``, gguf-py's version); a file that does not match them
all, or that is unreadable, is not used, and the next ``save`` replaces it. A ``save`` writes a
temporary file and renames it, so a failed or concurrent write never leaves a partial file under
the name; a cache that cannot be written only costs the conversion next time.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON), then each
array's bytes at a 64-byte aligned offset. The file is mapped copy-on-write: the arrays are
writable views of it (numba compiles read-only arrays as another type), their pages read from the
page cache and shared by every process that maps them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

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
    from disk; None when there are none, or they are stale or unreadable."""
    path = cache_file(directory, source, kind)
    try:
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if mapped[:len(MAGIC)] != MAGIC:
            return None
        n = int.from_bytes(mapped[len(MAGIC):len(MAGIC) + 8], "little")
        header = json.loads(mapped[len(MAGIC) + 8:len(MAGIC) + 8 + n])
        start = _aligned(len(MAGIC) + 8 + n)
        if header["stamp"] != _stamp(source, kind) or start + header["length"] != len(mapped):
            return None
        return {name: _weight(mapped, start, spec) for name, spec in header["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing, truncated or foreign: convert again
        log.debug("not using %s: %s", path, e)
        return None


def save(directory: Path, source: Path, kind: str, weights: dict[str, Weight]) -> None:
    """Keep ``weights``, converted from ``source`` as ``kind``, in ``directory`` for ``load`` (best
    effort, atomic; the directory is created)."""
    path = cache_file(directory, source, kind)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    arrays: list[np.ndarray] = []
    length = 0  # of the data so far, each array's bytes padded to the alignment

    def entry(a: np.ndarray | None) -> list | None:  # [dtype, shape, offset from the data's start]
        nonlocal length
        if a is None:
            return None
        arrays.append(a)
        length += _aligned(a.nbytes)
        return [a.dtype.str, list(a.shape), length - _aligned(a.nbytes)]

    tensors = {name: {"bits": w.bits, "in": w.in_features, "out": w.out_features, "codes": entry(w.codes),
                      "scales": entry(w.scales), "mins": entry(w.mins)} if isinstance(w, QuantWeight)
               else {"array": entry(w)} for name, w in weights.items()}
    header = json.dumps({"stamp": _stamp(source, kind), "length": length, "tensors": tensors}).encode()
    start = _aligned(len(MAGIC) + 8 + len(header))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for a in arrays:
                f.write(bytes(_aligned(f.tell()) - f.tell()))
                f.write(np.ascontiguousarray(a).data)
            f.write(bytes(start + length - f.tell()))
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache only costs the conversion next time
        log.debug("cannot write %s: %s", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink()


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
