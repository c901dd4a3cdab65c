"""Synthetic xclbin files, written byte by byte from XRT's ``xclbin.h`` (``struct axlf``,
``axlf_section_header``, ``ip_layout`` / ``ip_data``) and the EMBEDDED_METADATA XML that
``xclbinutil --add-kernel`` writes for a DPU kernel. Independent of the reader under test."""

from __future__ import annotations

import struct
import uuid as uuidlib
from pathlib import Path
from xml.sax.saxutils import quoteattr

# The mlir-aie / manifest DPU signature: opcode, instructions, their count, then data buffers.
DPU_PREFIX = [("opcode", "uint64_t"), ("instr", "char *"), ("ninstr", "uint32_t")]
LAYER_ARGS = DPU_PREFIX + [(n, "void*") for n in ("x_in", "x_out", "weights", "kv", "step")]
HEAD_ARGS = DPU_PREFIX + [(n, "void*") for n in ("x_in", "weights", "logits", "step")]


def kernel_xml(kernels: dict[str, list[tuple[str, str]]]) -> bytes:
    """EMBEDDED_METADATA for ``{kernel name: [(arg name, C type), ...]}``, ids in list order."""
    parts = ['<?xml version="1.0" encoding="UTF-8"?>\n<project name="flm">\n <platform>\n  <device>\n   <core>\n']
    for name, args in kernels.items():
        parts.append(f"    <kernel name={quoteattr(name)} language=\"c\" type=\"dpu\">\n"
                     "     <extended-data subtype=\"DPU\" functional=\"0\" dpu_kernel_id=\"0x901\"/>\n")
        offset = 0
        for i, (arg, ctype) in enumerate(args):
            size = 8 if ctype.strip().endswith("*") or ctype == "uint64_t" else 4
            qualifier = 1 if ctype.strip().endswith("*") else 0
            parts.append(f"     <arg name={quoteattr(arg)} addressQualifier=\"{qualifier}\" id=\"{i}\" "
                         f"size=\"0x{size:x}\" offset=\"0x{offset:02x}\" hostOffset=\"0x0\" "
                         f"hostSize=\"0x{size:x}\" type={quoteattr(ctype)}/>\n")
            offset += size
        parts.append(f"     <instance name=\"{name.upper()}INST\"/>\n    </kernel>\n")
    parts.append("   </core>\n  </device>\n </platform>\n</project>\n")
    return "".join(parts).encode()


def ip_layout(names: list[str], ip_type: int = 7) -> bytes:
    """``struct ip_layout``: int32 count, 4 bytes padding, 80-byte ``ip_data`` entries."""
    out = struct.pack("<i4x", len(names))
    for name in names:
        out += struct.pack("<IIQ64s", ip_type, 0, 0xFFFFFFFFFFFFFFFF, name.encode())
    return out


def build_xclbin(kernels: dict[str, list[tuple[str, str]]], *, uid: str | None = None,
                 magic: bytes = b"xclbin2\0", ip_names: list[str] | None = None,
                 extra_sections: list[tuple[int, bytes]] = (), metadata: bytes | None = None) -> bytes:
    """A whole axlf container: header, section table (EMBEDDED_METADATA, IP_LAYOUT, AIE_PARTITION
    stand-in, extras), sections 8-byte aligned. ``metadata`` replaces the generated XML."""
    ip_names = ip_names if ip_names is not None else [f"{k}:{k.upper()}INST" for k in kernels]
    xml = metadata if metadata is not None else kernel_xml(kernels)
    sections = [(2, "metadata", xml), (8, "ip_layout", ip_layout(ip_names)),
                (32, "aie_partition", b"\0" * 184)]
    sections += [(kind, f"extra{i}", data) for i, (kind, data) in enumerate(extra_sections)]
    table = 456 + 40 * len(sections)
    body, headers, offset = b"", b"", _align8(table)
    for kind, name, data in sections:
        headers += struct.pack("<I16s4xQQ", kind, name.encode(), offset, len(data))
        padded = data + b"\0" * (_align8(len(data)) - len(data))
        body += padded
        offset += len(padded)
    total = _align8(table) + len(body)
    uid_bytes = uuidlib.UUID(uid).bytes if uid else uuidlib.uuid4().bytes
    head = bytearray(456)
    head[0:8] = magic
    struct.pack_into("<i", head, 8, -1)
    head[12:40] = b"\xff" * 28
    struct.pack_into("<QQQHBBHH", head, 304, total, 1_700_000_000, 0, 7, 2, 19, 0, 0)
    head[352:352 + 18] = b"xilinx_v1_ipu_0_0\0"
    head[416:432] = uid_bytes
    struct.pack_into("<I", head, 448, len(sections))
    return bytes(head) + headers + b"\0" * (_align8(table) - table) + body


def write_build(folder: Path, *, layer_args=LAYER_ARGS, head_args=HEAD_ARGS, words: int = 16,
                same_xclbin: bool = False) -> dict:
    """Write a complete synthetic kernel build into ``folder``; returns its manifest ``kernels``
    entry (paths relative to ``folder``). ``same_xclbin`` puts all three kernels in one file."""
    folder.mkdir(parents=True, exist_ok=True)
    instr = folder / "step.insts.bin"
    instr.write_bytes(struct.pack(f"<{words}I", *range(words)))
    roles = {"decode_layer": ("flm_decode_layer", layer_args), "verify_layer": ("flm_verify_layer", layer_args),
             "lm_head": ("flm_lm_head", head_args)}
    if same_xclbin:
        (folder / "model.xclbin").write_bytes(build_xclbin({k: a for k, a in roles.values()}))
    entry = {}
    for role, (kernel, args) in roles.items():
        name = "model.xclbin" if same_xclbin else f"{role}.xclbin"
        if not same_xclbin:
            (folder / name).write_bytes(build_xclbin({kernel: args}))
        entry[role] = {"xclbin": name, "kernel": kernel, "instructions": instr.name}
    return entry


def _align8(n: int) -> int:
    return -(-n // 8) * 8
