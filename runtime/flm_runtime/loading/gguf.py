"""GGUF reader for the model families we run (``flm_runtime.families``: llama, qwen2, qwen3,
gemma3, phi3, and Mistral written as llama): weights under Hugging Face names.

``open_gguf`` memory-maps the file and parses its header here; gguf-py supplies the format's
constants and its dequantization (docs/design.md, "Model families"). Each matrix is kept in the
cpu backend's block format (``flm_runtime.kernels.quant``) or as float32, as the weight kind asks
(``WEIGHT_KINDS``; docs/design.md, "Quantized weights"):

- ``auto`` (the default for a served model): Q4_0, Q4_1 and Q4_K stay 4-bit, Q6_K 6-bit (but for a
  part of a fused matrix of other widths: ``quant.as_format``), Q8_0 8-bit, everything else 8-bit;
- ``q4`` / ``q8``: every matrix 4- / 8-bit (a 4-bit source widened to 8-bit codes with its own
  scales and mins, exactly; another width dequantized and quantized again);
- ``f32``: every tensor dequantized (``gguf.quants.dequantize``): the reference.

Norm weights are float32 always; Gemma 3's are stored as ``1 + w``, our convention. GGUF lists
dimensions fastest-first, so a GGUF shape ``[in, out]`` is the numpy array ``[out, in]``. The
family says the config (its ``{arch}.*`` keys), each tensor's name (another tensor is refused,
named) and which rows llama.cpp permuted: ``unpermute_rope`` restores Hugging Face's rotate-half
order of the Llama family's Q/K rows. RoPE factor tensors (``rope_freqs``,
``rope_factors_long`` / ``_short``) go to the config's RoPE scaling.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import Q4_K, dequantize

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import quant
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.loading import converted
from flm_runtime.loading.weights import WEIGHT_KINDS, Weight, check_shapes, check_weights
from flm_runtime.model_config import ModelConfig

if TYPE_CHECKING:
    from flm_runtime.families.llama import Llama

# llama.cpp's RoPE factor tensors: read into the config's RoPE scaling, not the weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFModel(NamedTuple):
    """What ``load_gguf`` returns.

    Attributes:
        config: hyper-parameters from the ``{arch}.*`` metadata (the family's config class).
        weights: Hugging Face name -> float32 array or ``QuantWeight`` (see
            ``flm_runtime.loading.weights``).
        metadata: every key/value of the file (``tokenizer.ggml.tokens`` is a ``list[str]`` ...).
    """

    config: ModelConfig
    weights: dict[str, Weight]
    metadata: dict[str, Any]


def load_gguf(path: str | Path, *, unpermute_qk: bool = True, weights: str = "f32",
              keep: Path | None = None, gguf_file: GGUFFile | None = None) -> GGUFModel:
    """Read a GGUF file of one of our families into Hugging Face weights, its config and its
    metadata.

    Args:
        path: the ``.gguf`` file.
        unpermute_qk: undo llama.cpp's Q/K row permutation (default). ``False`` returns the rows
            as stored (interleaved-pair RoPE order); for tests and comparisons only.
        weights: a weight kind of ``WEIGHT_KINDS`` (module docstring); ``load_model_files``
            chooses it for a served model.
        keep: a directory where converted weights are kept (``flm_runtime.loading.converted``):
            the weights are mapped from there when kept for this file and kind, else converted
            and kept. Not for ``f32`` (four times the file's size) or raw Q/K rows.
        gguf_file: ``open_gguf(path)`` when the caller has it already (it is not read again).

    Returns:
        ``GGUFModel(config, weights, metadata)``; the weights are copy-on-write maps of the kept
        ones (converted into the kept file first if need be, holding one tensor's pages of the
        GGUF at a time), or, without ``keep``, copies of the file's (it is unmapped when the last
        view of it is garbage-collected).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ModelFormatError: not a readable GGUF file (``open_gguf``), an architecture we do not
            run, a feature of it we do not (mixture of experts, partial rotary, a RoPE scaling
            type), a config value of the wrong type or out of range, an unsupported quantization
            type or tensor, shapes inconsistent with the metadata (checked before any tensor is
            converted), or a weight that is not finite; each named.
        DiskSpaceError: ``keep``'s disk has no room for the converted file (``converted.save``).
    """
    # Deferred: the registry imports this package (chat templates), and importing the provider
    # must load no kernel, which the families' layer types would (tests/test_public_api.py).
    from flm_runtime import families

    gguf_file = gguf_file or open_gguf(path)
    metadata = gguf_file.metadata
    family = families.for_gguf(metadata, str(path))
    config = config_from_gguf(gguf_file, family, source=str(path))
    expected = family.checkpoint_shapes(config)
    check_shapes(expected, {family.hf_name(t.name, str(path)): tuple(reversed(t.shape)) for t in gguf_file.tensors
                            if t.name not in ROPE_TENSORS}, str(path))  # before converting anything
    path, keep = Path(path), keep if unpermute_qk and weights != "f32" else None
    tensors = converted.load(keep, path, weights) if keep is not None else None
    if tensors is None:
        tensors = load_gguf_weights(gguf_file, config, family, unpermute_qk=unpermute_qk, kind=weights,
                                    source=str(path), keep=None if keep is None else (keep, path))
    check_weights(expected, tensors, source=str(path))
    return GGUFModel(config, tensors, metadata)


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        tensor_type: its ``GGMLQuantizationType``.
        shape: GGUF's dimensions, fastest first (``ne[0]`` = in_features).
        data: a read-only view of the mapped file, ``shape`` reversed: elements of their own dtype
            for F32, F16, F64 and the integer types, else bytes (uint8), the last dimension holding
            a row's blocks (as gguf-py's ``ReaderTensor.data``, which ``gguf.quants`` takes).
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile(NamedTuple):
    """A parsed GGUF file: ``metadata`` (every key/value of the file; strings ``str``, arrays
    ``list``, numbers ``int``/``float``/``bool``) and its ``tensors`` in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUFValueType -> struct format of a scalar (little-endian); STRING and ARRAY are read apart.
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# Tensor types whose data are elements of a numpy dtype (the rest are blocks of bytes).
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}
_SUPPORTED_VERSIONS = (2, 3)  # gguf-py's reader's; version 1 used 32-bit lengths
_VALUE_TYPES = frozenset(t.value for t in GGUFValueType)
_TENSOR_TYPES = frozenset(t.value for t in GGMLQuantizationType if t in GGML_QUANT_SIZES)
_MAX_DIMS = 4  # GGML_MAX_DIMS: ggml's tensors have at most four dimensions


def open_gguf(path: str | Path) -> GGUFFile:
    """Memory-map a GGUF file (read-only) and parse its header: metadata and tensor table.
    Little-endian files only (llama.cpp's; a big-endian file is refused, not misread).

    Every count and length is checked against the bytes left in the file before anything is read
    or allocated for it, so a hostile header costs no more memory than the file's size.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ModelFormatError: the file is not a readable GGUF (bad magic, version, byte order, a
            count, length, value type, tensor type or dimension out of range, a string that is not
            UTF-8, a duplicate key or tensor name, a tensor's data misaligned or beyond the end of
            the file), naming the file and the key or tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "GGUF model file not found", str(path))
    try:
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while a view lives
        return _parse(mapped)
    except (ValueError, OSError) as e:  # an empty file (mmap), or _parse's refusal
        raise ModelFormatError(f"{path}: not a readable GGUF file ({e})") from e


class _Cursor:
    """Reads GGUF's little-endian values from ``buf`` forward from ``pos``; each read is checked
    against the bytes left first (ValueError naming ``what`` was read)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def need(self, n: int, what: str) -> None:
        left = len(self.buf) - self.pos
        if n > left:
            raise ValueError(f"{what}: {n} bytes needed at offset {self.pos}, {left} left in the file")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"{what}, its length")
        self.need(n, what)
        try:
            text = self.buf[self.pos:self.pos + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not UTF-8 ({e.reason} at its byte {e.start})") from None
        self.pos += n
        return text

    def value_type(self, what: str) -> GGUFValueType:
        code = self.scalar("<I", what)
        if code not in _VALUE_TYPES:
            raise ValueError(f"{what}: {code} is not a GGUF value type")
        return GGUFValueType(code)

    def skip(self, vtype: GGUFValueType, what: str) -> None:
        """Move past a value of ``vtype`` without building it (an array's strings: their lengths only)."""
        if vtype == GGUFValueType.ARRAY:
            item = self.value_type(f"{what}, its item type")
            count = self.scalar("<Q", f"{what}, its item count")
            if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                for i in range(count):
                    self.skip(item, f"{what}[{i}]")
                return
            n = count * struct.calcsize(_SCALARS[item])
        else:
            n = self.scalar("<Q", f"{what}, its length") if vtype == GGUFValueType.STRING else struct.calcsize(
                _SCALARS[vtype])
        self.need(n, what)
        self.pos += n

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[vtype], what)
        item = self.value_type(f"{what}, its item type")
        count = self.scalar("<Q", f"{what}, its item count")
        if item == GGUFValueType.ARRAY:
            raise ValueError(f"{what} is an array of arrays (not supported)")
        if item == GGUFValueType.STRING:  # each at least its 8-byte length
            self.need(count * 8, f"{what}, {count} strings")
            return [self.string(f"{what}[{i}]") for i in range(count)]
        dtype = np.dtype(_SCALARS[item])
        self.need(count * dtype.itemsize, f"{what}, {count} items")
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()  # one numpy read, not one per item
        self.pos += count * dtype.itemsize
        return values


# The fewest bytes a key/value (an empty key's length, a value type, a one-byte value) and a
# tensor entry (an empty name's length, one dimension, its type and offset) take in the header.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


def _parse(buf: mmap.mmap) -> GGUFFile:
    """``open_gguf``'s parser over the mapped file ``buf`` (gguf.md's layout).

    Raises:
        ValueError: what ``open_gguf`` refuses, naming the key or tensor.
    """
    c = _Cursor(buf)
    if c.scalar("<I", "the magic") != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version = c.scalar("<I", "the version")
    if version not in _SUPPORTED_VERSIONS:
        order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version} is not supported{order}")
    n_tensors, n_kv = c.scalar("<Q", "the tensor count"), c.scalar("<Q", "the key/value count")
    c.need(n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES, f"{n_kv} key/values and {n_tensors} tensor entries")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"key #{i}")
        if key in metadata:
            raise ValueError(f"key {key!r} appears twice")
        metadata[key] = c.value(c.value_type(f"key {key!r}, its value type"), f"key {key!r}")
    infos = [_tensor_info(c, i) for i in range(n_tensors)]
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-c.pos // alignment) * alignment
    tensors, names = [], set()
    for name, qtype, shape, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        if offset % alignment:  # gguf.md: "Must be a multiple of ALIGNMENT"
            raise ValueError(f"tensor {name!r}: its data offset {offset} is not a multiple of the alignment {alignment}")
        tensors.append(GGUFTensor(name, qtype, shape, _tensor_data(buf, start + offset, qtype, shape, name)))
    return GGUFFile(metadata, tensors)


def gguf_context_length(path: str | Path) -> int | None:
    """A GGUF file's ``{general.architecture}.context_length`` (what ``config_from_gguf`` makes
    ``max_position_embeddings``), its header read only as far as that key, values before it
    skipped, not built: milliseconds where ``open_gguf`` takes most of a second on a large
    vocabulary (llama.cpp writes the architecture's keys before the tokenizer's). None when the
    file has no such key.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ModelFormatError: the header is not a readable GGUF header, as ``open_gguf`` says.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "GGUF model file not found", str(path))
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf)
            if c.scalar("<I", "the magic") != GGUF_MAGIC or c.scalar("<I", "the version") not in _SUPPORTED_VERSIONS:
                raise ValueError("GGUF magic or version invalid")
            c.scalar("<Q", "the tensor count")
            lengths: dict[str, Any] = {}  # key -> value of every *.context_length key read
            arch = None
            for i in range(c.scalar("<Q", "the key/value count")):
                key = c.string(f"key #{i}")
                vtype = c.value_type(f"key {key!r}, its value type")
                if key == "general.architecture" or key.endswith(".context_length"):
                    lengths[key] = c.value(vtype, f"key {key!r}")
                    arch = lengths.get("general.architecture")
                    if f"{arch}.context_length" in lengths:
                        break
                else:
                    c.skip(vtype, f"key {key!r}")
    except (ValueError, OSError) as e:
        raise ModelFormatError(f"{path}: not a readable GGUF file ({e})") from e
    length = lengths.get(f"{arch}.context_length")
    if length is not None and (type(length) is not int or length < 1):
        raise ModelFormatError(f"{path}: {arch}.context_length is {length!r}, not a positive integer")
    return length


def _tensor_info(c: _Cursor, i: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    """Entry ``i`` of the tensor table: name, type, shape (GGUF's order) and data offset."""
    name = c.string(f"tensor #{i}, its name")
    n_dims = c.scalar("<I", f"tensor {name!r}, its dimension count")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF's tensors have 1 to {_MAX_DIMS}")
    shape = tuple(c.scalar("<Q", f"tensor {name!r}, its dimensions") for _ in range(n_dims))
    code = c.scalar("<I", f"tensor {name!r}, its type")
    if code not in _TENSOR_TYPES:
        raise ValueError(f"tensor {name!r}: type {code} is not a GGML tensor type")
    return name, GGMLQuantizationType(code), shape, c.scalar("<Q", f"tensor {name!r}, its data offset")


def _tensor_data(buf: mmap.mmap, offset: int, qtype: GGMLQuantizationType, shape: tuple[int, ...],
                 name: str) -> np.ndarray:
    """The view of a tensor's data (``GGUFTensor.data``), its size checked against the file first."""
    dims = tuple(reversed(shape))
    n = math.prod(dims)  # Python's integers: dimensions whose product overflows 64 bits are refused below
    block, size = GGML_QUANT_SIZES[qtype]
    if dims[-1] % block:
        raise ValueError(f"tensor {name!r}: a row of {dims[-1]} is not a whole number of {qtype.name} blocks of {block}")
    nbytes = n // block * size
    if offset + nbytes > len(buf):
        raise ValueError(f"tensor {name!r} of shape {list(shape)} ({nbytes} bytes of {qtype.name} at offset {offset}) "
                         f"runs past the end of the file ({len(buf)} bytes)")
    if qtype in _ELEMENT_DTYPES:
        return np.frombuffer(buf, _ELEMENT_DTYPES[qtype], n, offset).reshape(dims)
    return np.frombuffer(buf, np.uint8, nbytes, offset).reshape(*dims[:-1], dims[-1] // block * size)


def config_from_gguf(gguf_file: GGUFFile, family: Llama, *, source: str = "GGUF") -> ModelConfig:
    """The config of a GGUF file of ``family`` (``families.for_gguf``): its ``{arch}.*`` keys and
    RoPE factor tensors, read by the family (``Llama.config_from_gguf``).

    Raises:
        ModelFormatError: a missing key, or a feature the family refuses (mixture of experts,
            partial rotary, a RoPE scaling type we lack), naming it.
    """
    from flm_runtime.families.checkpoint import GGUFMetadata  # deferred as in load_gguf

    rope_tensors = {t.name: dequantize_tensor(t, source) for t in gguf_file.tensors if t.name in ROPE_TENSORS}
    meta = GGUFMetadata(gguf_file.metadata, gguf_file.metadata["general.architecture"],
                        [t.name for t in gguf_file.tensors], rope_tensors, source)
    return family.config_from_gguf(meta)


def load_gguf_weights(gguf_file: GGUFFile, config: ModelConfig, family: Llama, *, unpermute_qk: bool = True,
                      kind: str = "f32", source: str = "GGUF",
                      keep: tuple[Path, Path] | None = None) -> dict[str, Weight]:
    """Every tensor (but the RoPE factors) under its Hugging Face name, as the weight kind
    ``kind`` asks.

    Args:
        gguf_file: an open GGUF file.
        config: its config (head counts for the Q/K un-permutation).
        family: its family (tensor names, which rows llama.cpp permuted).
        unpermute_qk: restore Hugging Face's rotate-half row order where llama.cpp permuted it.
        kind: a weight kind of ``WEIGHT_KINDS`` (module docstring).
        source: the file, for error messages.
        keep: ``(directory, source)``: convert into the kept file of ``source`` (this GGUF's path)
            as ``kind`` in ``directory`` (``converted.save``) tensor by tensor, in slices of rows,
            each slice's pages of the GGUF released once converted (``release_pages``), and return
            that file's weights, mapped; converted in memory only when it cannot be written. The
            matrices a model fuses (``fused_matrices``) are kept in the fused matrix's format
            (``quant.fused_format``): a Q4_K_M file's 4-bit Q and K beside a 6-bit V as 8-bit
            blocks with stored mins, each weight's value unchanged.

    Returns:
        name -> C-contiguous float32 array or ``QuantWeight``, ``[out_features, in_features]``
        for matrices.

    Raises:
        ModelFormatError: an unsupported tensor name or quantization type.
        DiskSpaceError: ``keep``'s disk has no room for the converted file.
    """
    assert kind in WEIGHT_KINDS, f"weight kind {kind!r} not in {WEIGHT_KINDS}"
    tensors = {family.hf_name(t.name, source): t for t in gguf_file.tensors if t.name not in ROPE_TENSORS}
    kept = None if keep is None else _converted_into(*keep, tensors, config, family, kind)
    if kept is not None:
        return kept
    return {name: _converted(_in_hf_order(name, tensor, config, family, unpermute_qk), kind, source)
            for name, tensor in tensors.items()}


def _converted_into(directory: Path, source: Path, tensors: dict[str, GGUFTensor], config: ModelConfig,
                    family: Llama, kind: str) -> dict[str, Weight] | None:
    """``load_gguf_weights``'s ``keep``: ``tensors`` (by Hugging Face name) converted into the kept
    file, laid out in the stacking order and each group of matrices the model fuses in the fused
    matrix's format (the stacked model's arrays are then views of it, not copies), and mapped from
    it; None when it cannot be written."""
    stacked = family.stacking_order(config)
    order = [n for n in stacked if n in tensors] + [n for n in tensors if n not in set(stacked)]
    # Each tensor's format is its first tile's: the same rules convert every row.
    firsts = {name: _converted(_rows(tensors[name], 0, quant.TILE), kind, str(source)) for name in order}
    formats = {}  # name -> (bits, mins) of the fused matrix it is a part of
    for group in family.fused_matrices(config):
        parts = [firsts[name] for name in group]
        if all(isinstance(w, QuantWeight) for w in parts):
            formats.update(dict.fromkeys(group, quant.fused_format(parts)))

    def held(name: str, w: Weight) -> Weight:
        return quant.as_format(w, *formats[name]) if name in formats else w

    def convert(name: str, tensor: GGUFTensor) -> Weight:
        return held(name, _converted(tensor, kind, str(source)))

    entries = {name: converted.Entry.like(held(name, w), tensors[name].data.shape[0]) for name, w in firsts.items()}
    if not converted.save(directory, source, kind, entries, _converted_parts(tensors, order, config, family, convert)):
        return None
    return converted.load(directory, source, kind)


# Weights converted at a time when converting into a kept file: its largest temporary is a slice
# of this many float32 weights (16 MB), however large the tensor.
_SLICE_WEIGHTS = 1 << 22


def _converted_parts(tensors: dict[str, GGUFTensor], order: list[str], config: ModelConfig, family: Llama,
                     convert: Callable[[str, GGUFTensor], Weight]) -> Iterator[tuple[str, int, Weight]]:
    """``converted.save``'s parts: the tensors in ``order``, converted (``convert(name, rows)``)
    slice by slice of rows (whole tiles; about ``_SLICE_WEIGHTS`` weights each), each slice's GGUF
    pages released once it is converted."""
    for name in order:
        data = tensors[name].data
        tensor = _in_hf_order(name, tensors[name], config, family, True)  # q/k: the whole tensor read once, reordered
        rows = data.shape[0]
        step = rows if data.ndim != 2 else max(quant.TILE, _SLICE_WEIGHTS // tensor.shape[0] // quant.TILE
                                                  * quant.TILE)
        for first in range(0, rows, step):
            yield name, first, convert(name, _rows(tensor, first, first + step))
            release_pages(data[first:first + step])


def _rows(tensor: GGUFTensor, first: int, stop: int) -> GGUFTensor:
    """Rows ``first .. stop-1`` of a matrix (clipped to its rows; a 1-D tensor whole)."""
    if len(tensor.shape) != 2:
        return tensor
    data = tensor.data[first:stop]
    return tensor._replace(shape=(tensor.shape[0], data.shape[0]), data=data)


def _in_hf_order(name: str, tensor: GGUFTensor, config: ModelConfig, family: Llama,
                 unpermute_qk: bool) -> GGUFTensor:
    """The tensor of Hugging Face name ``name`` with its rows in Hugging Face's order (un-permuted
    where llama.cpp's converter permuted them for ``family`` and ``unpermute_qk``: the stored rows
    move whole, before any conversion, as rows convert alone)."""
    heads = family.permuted_heads(name, config)
    return tensor._replace(data=unpermute_rope(tensor.data, heads)) if unpermute_qk and heads else tensor


def _converted(tensor: GGUFTensor, kind: str, source: str) -> Weight:
    """One tensor (or rows of it) as ``kind`` holds it: float32 for ``f32`` and 1-D tensors,
    else ``quantized_tensor``."""
    if kind == "f32" or len(tensor.shape) != 2:
        return dequantize_tensor(tensor, source)
    return quantized_tensor(tensor, kind, source)


def release_pages(view: np.ndarray) -> None:
    """Drop the pages under ``view`` (rows of a tensor of a file ``open_gguf`` mapped) from this
    process's resident set: they stay in the page cache, and a later read maps them again. A
    conversion so holds a slice's pages of the file at a time, not the whole file's."""
    mapped = quant.owner_of(view)
    if not isinstance(mapped, mmap.mmap) or not view.size or not hasattr(mmap, "MADV_DONTNEED"):
        return  # not a mapping, or a system without madvise (Windows): the pages stay
    offset = view.ctypes.data - np.frombuffer(mapped, np.uint8).ctypes.data
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, min(offset + view.nbytes, len(mapped)) - start)


# GGUF block types read as they are: type -> bits.
_NATIVE_BLOCKS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
# K-quants read as they are, in super-blocks of 256 (their sub-scales folded or kept): type -> bits.
_NATIVE_K_QUANTS = {GGMLQuantizationType.Q4_K: 4, GGMLQuantizationType.Q6_K: 6}


def quantized_tensor(tensor: GGUFTensor, kind: str, source: str = "GGUF") -> Weight:
    """One GGUF matrix in the cpu backend's block format (the module docstring's rules), or as
    float32 when its input width is not a whole number of blocks of 32.

    Raises:
        ModelFormatError: gguf-py cannot dequantize a type that must be converted, or a weight (a
            block's scale or min, read as it is) is not finite; naming ``source`` and the tensor.
    """
    qtype = tensor.tensor_type
    n, k = reversed(tensor.shape)
    if k % quant.BLOCK:
        return dequantize_tensor(tensor, source)
    bits, read = held_as(qtype, kind)
    if not read:
        return quant.quantize(dequantize_tensor(tensor, source), bits)
    if qtype in _NATIVE_K_QUANTS:
        read_k_quant = _read_q4_k if qtype == GGMLQuantizationType.Q4_K else _read_q6_k
        w = read_k_quant(np.asarray(tensor.data).reshape(n, k // 256, -1), k)
    else:
        w = _read_blocks(np.asarray(tensor.data).reshape(n, k // quant.BLOCK, -1), qtype, k)
    _check_finite(tensor, source, w.scales, w.mins)
    return w if w.bits == bits else quant.widen(w)  # 8-bit blocks hold a 4-bit source exactly


def held_as(qtype: GGMLQuantizationType, kind: str) -> tuple[int, bool]:
    """How a matrix of GGUF type ``qtype`` is held for weight kind ``kind`` (not ``f32``): its
    code width, and whether its own blocks are read (widened exactly where a 4-bit type is held
    8-bit) rather than dequantized and quantized again (the module docstring's rules)."""
    native = _NATIVE_BLOCKS.get(qtype, _NATIVE_K_QUANTS.get(qtype))
    bits = (native or 8) if kind == "auto" else int(kind[1:])
    return bits, native is not None and (bits == native or (native == 4 and bits == 8))


def _read_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType, k: int) -> QuantWeight:
    """Q4_0 / Q4_1 / Q8_0 blocks ``[N, K/32, bytes]`` (uint8) as a ``QuantWeight``, unchanged:
    Q4_0 ``w = d * (q - 8)``, Q4_1 ``w = d * q + m``, Q8_0 ``w = d * q`` with ``q`` int8."""
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]  # [N, K/32]
    if qtype == GGMLQuantizationType.Q8_0:  # int8 q + 128 as a byte: its sign bit flipped
        return quant.from_packed(np.bitwise_xor(blocks[..., 2:], np.uint8(0x80)), scales, None, 8, k)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == GGMLQuantizationType.Q4_1 else None
    return quant.from_packed(blocks[..., 4:] if mins is not None else blocks[..., 2:], scales, mins, 4, k)


def _read_q4_k(blocks: np.ndarray, k: int) -> QuantWeight:
    """Q4_K super-blocks ``[N, K/256, 144]`` as a 4-bit ``QuantWeight``: each sub-block of 32 gets
    ``scale = d * sc`` and ``min = -dmin * m`` (its 6-bit scale and min folded in, rounded to
    float16), codes unchanged."""
    n, ns, _ = blocks.shape
    flat = blocks.reshape(n * ns, -1)
    d = flat[:, :2].copy().view(np.float16).astype(np.float32)  # [n*ns, 1]
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(flat[:, 4:4 + Q4_K.K_SCALE_SIZE])  # [n*ns, 8] each
    qs = flat[:, 4 + Q4_K.K_SCALE_SIZE:].reshape(n * ns, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, k)
    scales = (d * sc.astype(np.float32)).reshape(n, k // quant.BLOCK)
    mins = (-dmin * mn.astype(np.float32)).reshape(n, k // quant.BLOCK)
    return quant.from_blocks(codes, scales, mins, 4, k)


def _read_q6_k(blocks: np.ndarray, k: int) -> QuantWeight:
    """Q6_K super-blocks ``[N, K/256, 210]`` as a 6-bit ``QuantWeight``, unchanged: ``w = d * sc *
    (q - 32)`` with ``q`` six bits (low four in ``ql``, high two in ``qh``), ``sc`` a signed byte
    per 16 inputs and ``d`` float16 per 256 (ggml's ``dequantize_row_q6_K``: each half of 128
    inputs holds quarters ``j`` of 32 in nibble ``j // 2`` of ``ql[32 (j % 2) + l]`` and bits
    ``2j`` of ``qh[l]``)."""
    n, ns, _ = blocks.shape
    flat = blocks.reshape(n * ns, -1)
    ql = flat[:, :128].reshape(-1, 2, 2, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (ql & 0x0F).transpose(0, 1, 3, 2, 4).reshape(-1, 2, 4, 32)  # [n*ns, half, quarter j, l]
    qh = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (low | (qh & 3) << 4).reshape(n, k)
    subs = flat[:, 192:208].view(np.int8).reshape(n, k // quant.SUB_BLOCK)
    d = flat[:, 208:210].copy().view(np.float16)  # [n*ns, 1]
    scales = np.repeat(d, 256 // quant.BLOCK, axis=1).reshape(n, k // quant.BLOCK)
    return quant.from_six_bit(codes, scales, subs, k)


def dequantize_tensor(tensor: GGUFTensor, source: str = "GGUF") -> np.ndarray:
    """One GGUF tensor as a float32 numpy array in row-major order (GGUF shape reversed).

    Raises:
        ModelFormatError: gguf-py cannot dequantize the tensor's type, or a weight is not finite;
            naming ``source`` and the tensor (and its type).
    """
    qtype = tensor.tensor_type
    try:
        w = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelFormatError(
            f"{source}: GGUF tensor {tensor.name!r}: quantization type {qtype.name} is not supported"
        ) from e
    _check_finite(tensor, source, w)
    w = w.reshape(tuple(reversed(tensor.shape)))
    if np.may_share_memory(w, tensor.data):
        w = w.copy()  # F32 comes back as a view of the read-only memory map
    return np.ascontiguousarray(w, dtype=np.float32)


def _check_finite(tensor: GGUFTensor, source: str, *arrays: np.ndarray | None) -> None:
    """Refuse ``tensor`` when one of ``arrays`` (its weights, or its blocks' scales and mins) holds a
    NaN or an infinity, which would spread through every activation it meets. ``min`` and
    ``max`` propagate NaN: two vectorized passes, no temporary.

    Raises:
        ModelFormatError: naming ``source`` and the tensor.
    """
    for a in arrays:
        if a is not None and a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
            raise ModelFormatError(f"{source}: GGUF tensor {tensor.name!r} has weights that are not finite "
                                   "(NaN or infinity)")


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face (rotate-half) row order -> llama.cpp (interleaved pairs) row order.

    The forward permutation of llama.cpp ``convert_hf_to_gguf.py`` ``CausalLM.permute``: inside
    each head, row ``i`` (i < D/2) moves to ``2i`` and row ``D/2 + i`` to ``2i + 1``.

    Args:
        w: ``[n_head*D, in]`` (or ``[n_head*D]`` for a bias) q_proj / k_proj weight.
        n_head: heads of this projection (H for q_proj, Hkv for k_proj).

    Returns:
        A new array of the same shape.
    """
    d = w.shape[0] // n_head
    assert d * n_head == w.shape[0] and d % 2 == 0, f"rows {w.shape[0]} vs {n_head} heads"
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp (interleaved pairs) row order -> Hugging Face (rotate-half) row order.

    The inverse of ``permute_rope``: per head, ``[H, D/2, 2, in] -> [H, 2, D/2, in]``.

    Args:
        w: ``[n_head*D, ...]`` q or k weight as stored in a GGUF file: its elements, or its rows
            of blocks (bytes), which move whole.
        n_head: heads of this projection (H for q_proj, Hkv for k_proj).

    Returns:
        A new C-contiguous array of the same shape.
    """
    d = w.shape[0] // n_head
    assert d * n_head == w.shape[0] and d % 2 == 0, f"rows {w.shape[0]} vs {n_head} heads"
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
