"""Hostile GGUF files made from a valid one by structured mutation of its layout (issue #33, item 6).

``layout`` reads a GGUF file's header on its own (gguf.md's layout, independently of the loader's
reader), recording where each field lies; ``hostile_files`` then makes each case by changing the
bytes of fields in place (a count, a length, a type, a dimension, an offset, a key's name, a
weight), or by cutting the file at a field's boundary or inside a tensor's data. Every case is
one the loader must refuse; its id says what was changed.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# GGUFValueType -> struct format of a scalar (little-endian).
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1


class Span(NamedTuple):
    """Bytes ``start .. end-1`` of the file."""

    start: int
    end: int


class KV(NamedTuple):
    """One key/value: the spans of its key's length, key, value type and value (for a string: its
    length and bytes; for an array: its item type, count and each item's length and bytes, or
    one span for an array of scalars)."""

    key: str
    vtype: GGUFValueType
    key_len: Span
    key_bytes: Span
    type: Span
    value: Span  # the whole value
    str_len: Span | None  # a string value's length
    item_type: Span | None  # an array's item type
    count: Span | None  # an array's count
    items: list[tuple[Span, Span]]  # an array of strings: each one's length and bytes


class TensorInfo(NamedTuple):
    """One tensor's entry of the tensor table, and where its data lie in the file."""

    name: str
    name_len: Span
    name_bytes: Span
    n_dims: Span
    dims: list[Span]
    shape: tuple[int, ...]
    type: Span
    qtype: GGMLQuantizationType
    offset: Span
    data: Span


class Layout(NamedTuple):
    """A GGUF file's fields: header (magic, version, counts), key/values, tensor table, and the
    data section's start (``alignment`` its alignment)."""

    magic: Span
    version: Span
    n_tensors: Span
    n_kv: Span
    kvs: dict[str, KV]
    tensors: dict[str, TensorInfo]
    data_start: int
    alignment: int


def layout(data: bytes) -> Layout:
    """The layout of a valid little-endian GGUF file ``data``."""
    pos = 0

    def take(fmt: str) -> tuple[int, Span]:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        span = Span(pos, pos + struct.calcsize(fmt))
        pos = span.end
        return v, span

    def string() -> tuple[str, Span, Span]:
        nonlocal pos
        n, length = take("<Q")
        text, pos = data[pos:pos + n].decode(), pos + n
        return text, length, Span(length.end, pos)

    header = [take(f)[1] for f in ("<I", "<I", "<Q", "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    kvs = {}
    for _ in range(n_kv):
        key, key_len, key_bytes = string()
        vtype, vtype_span = take("<I")
        vtype = GGUFValueType(vtype)
        start, str_len, item_type, count, items = pos, None, None, None, []
        if vtype == GGUFValueType.STRING:
            _, str_len, _ = string()
        elif vtype == GGUFValueType.ARRAY:
            item, item_type = take("<I")
            n, count = take("<Q")
            if GGUFValueType(item) == GGUFValueType.STRING:
                items = [string()[1:] for _ in range(n)]
            else:
                pos += n * struct.calcsize(_SCALARS[GGUFValueType(item)])
        else:
            take(_SCALARS[vtype])
        kvs[key] = KV(key, vtype, key_len, key_bytes, vtype_span, Span(start, pos), str_len, item_type, count, items)
    alignment = int.from_bytes(data[kvs["general.alignment"].value.start:][:4], "little") \
        if "general.alignment" in kvs else 32
    infos = []
    for _ in range(n_tensors):
        name, name_len, name_bytes = string()
        n_dims, n_dims_span = take("<I")
        dims = [take("<Q") for _ in range(n_dims)]
        qtype, type_span = take("<I")
        offset, offset_span = take("<Q")
        infos.append((name, name_len, name_bytes, n_dims_span, dims, GGMLQuantizationType(qtype), type_span, offset,
                      offset_span))
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, name_len, name_bytes, n_dims_span, dims, qtype, type_span, offset, offset_span in infos:
        shape = tuple(d for d, _ in dims)
        block, size = GGML_QUANT_SIZES[qtype]
        start = data_start + offset
        tensors[name] = TensorInfo(name, name_len, name_bytes, n_dims_span, [s for _, s in dims], shape, type_span,
                                   qtype, offset_span, Span(start, start + math.prod(shape) // block * size))
    return Layout(*header, kvs, tensors, data_start, alignment)


class Case(NamedTuple):
    """One hostile file: ``id`` says what was changed; ``in_conversion``: the fault shows only
    when its tensor is converted (a non-finite weight), not in the header or shapes."""

    id: str
    data: bytes
    in_conversion: bool = False


def patched(data: bytes, span: Span, value: bytes) -> bytes:
    """``data`` with the bytes of ``span`` replaced by ``value`` (of the same length)."""
    assert len(value) == span.end - span.start, (span, value)
    return data[:span.start] + value + data[span.end:]


def _u(span: Span, value: int) -> bytes:
    """``value`` as the unsigned little-endian integer of ``span``'s width."""
    return value.to_bytes(span.end - span.start, "little")


def hostile_files(data: bytes, tag: str) -> Iterator[Case]:
    """The hostile files made from the valid GGUF file ``data`` (a tiny Llama with the tokenizer
    and tensors of ``tiny_llama_files.write_tiny_gguf``); ``tag`` prefixes each case's id."""
    lay = layout(data)
    for case in (*_header_cases(data, lay), *_kv_cases(data, lay), *_tensor_cases(data, lay),
                 *_truncations(data, lay)):
        yield case._replace(id=f"{tag}-{case.id}")


def _header_cases(data: bytes, lay: Layout) -> Iterator[Case]:
    yield Case("magic-GGML", patched(data, lay.magic, b"GGML"))
    yield Case("magic-zero", patched(data, lay.magic, bytes(4)))
    for version in (0, 1, 4, _U32_MAX):
        yield Case(f"version-{version}", patched(data, lay.version, _u(lay.version, version)))
    yield Case("version-big-endian", patched(data, lay.version, (3).to_bytes(4, "big")))
    n_tensors = len(lay.tensors)
    for n in (n_tensors + 1, 2**32, 2**63, _U64_MAX):
        yield Case(f"tensor-count-{n}", patched(data, lay.n_tensors, _u(lay.n_tensors, n)))
    for n in (len(lay.kvs) + 1, 2**32, 2**63, _U64_MAX):
        yield Case(f"kv-count-{n}", patched(data, lay.n_kv, _u(lay.n_kv, n)))


# Value types no GGUF version defines, and bytes that are not UTF-8 (a lone continuation byte, an
# overlong "/", a UTF-16 surrogate, a code point past U+10FFFF).
_BAD_VALUE_TYPES = (13, 255, _U32_MAX)
_BAD_UTF8 = {"ff": b"\xff", "continuation": b"\x80", "overlong": b"\xc0\xaf", "surrogate": b"\xed\xa0\x80",
             "past-max": b"\xf4\x90\x80\x80"}


def _bad_utf8(data: bytes, span: Span) -> Iterator[tuple[str, bytes]]:
    """``data`` with the start of the string at ``span`` made invalid UTF-8, each way that fits."""
    for name, bad in _BAD_UTF8.items():
        if len(bad) <= span.end - span.start:
            yield name, patched(data, Span(span.start, span.start + len(bad)), bad)


def _kv_cases(data: bytes, lay: Layout) -> Iterator[Case]:
    kvs = lay.kvs
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.chat_template", "llama.block_count"):
        kv = kvs[key]
        for n in (2**40, _U64_MAX):
            yield Case(f"key-length-{n}:{key}", patched(data, kv.key_len, _u(kv.key_len, n)))
        for name, bad in _bad_utf8(data, kv.key_bytes):
            yield Case(f"key-utf8-{name}:{key}", bad)
        for t in _BAD_VALUE_TYPES:
            yield Case(f"value-type-{t}:{key}", patched(data, kv.type, _u(kv.type, t)))
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.chat_template"):
        kv = kvs[key]
        length = kv.str_len
        for n in (int.from_bytes(data[length.start:length.end], "little") + 1, len(data), 2**63, _U64_MAX):
            yield Case(f"string-length-{n}:{key}", patched(data, length, _u(length, n)))
        for name, bad in _bad_utf8(data, Span(length.end, kv.value.end)):
            yield Case(f"string-utf8-{name}:{key}", bad)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        kv = kvs[key]
        count = int.from_bytes(data[kv.count.start:kv.count.end], "little")
        for n in (count + 1, len(data), 2**62, _U64_MAX):
            yield Case(f"array-count-{n}:{key}", patched(data, kv.count, _u(kv.count, n)))
        for t in (*_BAD_VALUE_TYPES, GGUFValueType.ARRAY):
            yield Case(f"array-item-type-{t}:{key}", patched(data, kv.item_type, _u(kv.item_type, t)))
    token_type = kvs["tokenizer.ggml.token_type"]  # int32 items read as float32: the same bytes
    yield Case("array-item-type-FLOAT32:tokenizer.ggml.token_type",
               patched(data, token_type.item_type, _u(token_type.item_type, GGUFValueType.FLOAT32)))
    tokens = kvs["tokenizer.ggml.tokens"].items
    for i in (0, 3, len(tokens) - 1):  # a special token, a byte, a merge
        length, text = tokens[i]
        yield Case(f"token-length-{_U64_MAX}:token{i}", patched(data, length, _u(length, _U64_MAX)))
        for name, bad in _bad_utf8(data, text):
            yield Case(f"token-utf8-{name}:token{i}", bad)
    # A key renamed (to one of the same length) into a duplicate, into general.alignment, and
    # values of the config made hostile.
    keys = list(kvs)
    for first, later in [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if len(a) == len(b)][:3]:
        yield Case(f"key-duplicate:{later}->{first}", patched(data, kvs[later].key_bytes, first.encode()))
    block_count = kvs["llama.block_count"]
    assert len("general.alignment") == len(block_count.key)
    as_alignment = patched(data, block_count.key_bytes, b"general.alignment")
    for a in (0, 3, 48, 2**31):
        yield Case(f"alignment-{a}", patched(as_alignment, block_count.value, _u(block_count.value, a)))
    yield Case("alignment-float32", patched(as_alignment, block_count.type, _u(block_count.type, GGUFValueType.FLOAT32)))
    for key, values in ((block_count.key, (0, 3, 2**20, _U32_MAX)), ("llama.embedding_length", (0, 63, _U32_MAX)),
                        ("llama.attention.head_count", (0, 3, _U32_MAX)), ("llama.attention.head_count_kv", (0, 3)),
                        ("llama.feed_forward_length", (0, _U32_MAX)), ("llama.rope.dimension_count", (0, 15)),
                        ("llama.context_length", (0,)), ("tokenizer.ggml.bos_token_id", (_U32_MAX,)),
                        ("tokenizer.ggml.eos_token_id", (_U32_MAX,))):
        kv = kvs[key]
        for v in values:
            yield Case(f"value-{v}:{key}", patched(data, kv.value, _u(kv.value, v)))
        yield Case(f"value-type-FLOAT32:{key}", patched(data, kv.type, _u(kv.type, GGUFValueType.FLOAT32)))
        negative = patched(data, kv.value, struct.pack("<i", -1))
        yield Case(f"value-int32-negative:{key}", patched(negative, kv.type, _u(kv.type, GGUFValueType.INT32)))
    for key, zero in (("llama.rope.freq_base", True), ("llama.attention.layer_norm_rms_epsilon", False)):
        kv = kvs[key]
        for name, v in (("nan", math.nan), ("inf", math.inf), ("negative", -1.0), *([("zero", 0.0)] if zero else [])):
            yield Case(f"value-{name}:{key}", patched(data, kv.value, struct.pack("<f", v)))


# Tensor types no GGUF defines (4 and 5 were Q4_2 and Q4_3, long removed).
_BAD_TENSOR_TYPES = (4, 5, 99, _U32_MAX)
# Bit patterns of non-finite weights: float32 and float16 (a quantized block's scale).
_NON_FINITE_F32 = {"nan": struct.pack("<f", math.nan), "inf": struct.pack("<f", math.inf),
                   "-inf": struct.pack("<f", -math.inf)}
_NON_FINITE_F16 = {"nan": b"\x00\x7e", "inf": b"\x00\x7c", "-inf": b"\x00\xfc"}


def _tensor_cases(data: bytes, lay: Layout) -> Iterator[Case]:
    tensors = list(lay.tensors.values())
    embd, last = lay.tensors["token_embd.weight"], tensors[-1]
    for t in (embd, lay.tensors["blk.0.attn_q.weight"], last):
        yield Case(f"name-length-{_U64_MAX}:{t.name}", patched(data, t.name_len, _u(t.name_len, _U64_MAX)))
        for name, bad in _bad_utf8(data, t.name_bytes):
            yield Case(f"name-utf8-{name}:{t.name}", bad)
        for n in (0, 3, 5, _U32_MAX):
            yield Case(f"n-dims-{n}:{t.name}", patched(data, t.n_dims, _u(t.n_dims, n)))
        for i, dim in enumerate(t.dims):
            for n in (0, t.shape[i] + 1, 2**32, 2**62, _U64_MAX):
                yield Case(f"dim{i}-{n}:{t.name}", patched(data, dim, _u(dim, n)))
        if len(t.dims) == 2:  # dimensions whose product overflows 64 bits, each within it
            both = patched(data, t.dims[0], _u(t.dims[0], 2**33))
            yield Case(f"dims-product-2**66:{t.name}", patched(both, t.dims[1], _u(t.dims[1], 2**33)))
        for qtype in _BAD_TENSOR_TYPES:
            yield Case(f"tensor-type-{qtype}:{t.name}", patched(data, t.type, _u(t.type, qtype)))
        offset = int.from_bytes(data[t.offset.start:t.offset.end], "little")
        for name, n in (("misaligned", offset + 1), ("file-size", len(data)), ("past-end", len(data) - lay.data_start),
                        ("2**63", 2**63), ("u64-max", _U64_MAX)):
            yield Case(f"offset-{name}:{t.name}", patched(data, t.offset, _u(t.offset, n)))
    for rows in (embd.shape[1] - 1, embd.shape[1] // 2):  # fewer embedding rows than the vocabulary has tokens
        yield Case(f"vocab-{embd.shape[1]}-embedding-rows-{rows}", patched(data, embd.dims[1], _u(embd.dims[1], rows)))
    for first in ("blk.0.attn_q.weight", "blk.0.ffn_norm.weight"):  # renamed from blk.1's
        later = lay.tensors[first.replace("blk.0", "blk.1")]
        yield Case(f"tensor-duplicate:{first}", patched(data, later.name_bytes, first.encode()))
    yield from _non_finite_weights(data, lay)


def _non_finite_weights(data: bytes, lay: Layout) -> Iterator[Case]:
    """A weight made NaN or infinite in each kind of tensor: the embedding (first and last
    weight), a projection, a norm; in a quantized tensor, a block's scale (its first two bytes)."""
    for name in ("token_embd.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight", "output_norm.weight"):
        t = lay.tensors[name]
        if t.qtype == GGMLQuantizationType.F32:
            at, bit_patterns = (t.data.start, t.data.end - 4), _NON_FINITE_F32
        else:
            block = GGML_QUANT_SIZES[t.qtype][1]
            at, bit_patterns = (t.data.start, t.data.end - block), _NON_FINITE_F16
        for where in at:
            for value, bits in bit_patterns.items():
                yield Case(f"weight-{value}@{where - t.data.start}:{name}",
                           patched(data, Span(where, where + len(bits)), bits), in_conversion=True)


def _truncations(data: bytes, lay: Layout) -> Iterator[Case]:
    """The file cut at every boundary of the header's fields (an array of strings: after its first
    and last items), and inside the data: at each tensor's start, middle and last byte."""
    cuts = {0, 2, lay.magic.end, lay.version.end, lay.n_tensors.end, lay.n_kv.end}
    for kv in lay.kvs.values():
        cuts.update((kv.key_len.end, kv.key_bytes.end - 1, kv.key_bytes.end, kv.type.end, kv.value.end - 1, kv.value.end))
        for span in (kv.str_len, kv.item_type, kv.count):
            if span is not None:
                cuts.add(span.end)
        for length, text in kv.items[:1] + kv.items[-1:]:
            cuts.update((length.end, text.end - 1))
    for t in lay.tensors.values():
        cuts.update((t.name_len.end, t.name_bytes.end, t.n_dims.end, *(d.end for d in t.dims), t.type.end,
                     t.offset.end - 1, t.offset.end))
        cuts.update((t.data.start, (t.data.start + t.data.end) // 2, t.data.end - 1))
    for cut in sorted(cuts):
        yield Case(f"truncated-{cut}", data[:cut])
