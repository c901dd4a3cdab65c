"""A pure-Python reader of xclbin files (the ``axlf`` container), enough to validate NPU kernels.

No XRT is needed: the npu backend validates every xclbin against ``xclbins/flm_xclbins/manifest.json`` before
it touches a device, and ``litellm-flm validate`` reports on them on machines without one.

The layout is XRT's ``struct axlf`` (``src/runtime_src/core/include/xrt/detail/xclbin.h`` in
github.com/Xilinx/XRT), every integer little-endian. The fields read (byte offsets): ``m_magic``
``b"xclbin2\\0"`` @0; in ``axlf_header``, ``m_length`` u64 @304 (the file's size),
``m_timeStamp`` u64 @312, ``m_versionPatch`` u16 @328, ``m_versionMajor`` u8 @330,
``m_versionMinor`` u8 @331, ``m_platformVBNV`` 64 @352, ``uuid`` 16 @416, ``m_numSections``
u32 @448; then from @456 one 40-byte ``axlf_section_header`` per section: ``m_sectionKind`` u32,
``m_sectionName`` 16, ``m_sectionOffset`` u64 @+24, ``m_sectionSize`` u64 @+32. Two sections name
the kernels:

- ``EMBEDDED_METADATA`` (kind 2): XML, ``project/platform/device/core/kernel`` elements (``name``,
  ``type``: ``dpu`` for an NPU kernel), one ``arg`` child per argument (``name``, ``id`` = the
  argument index, by which XRT orders them; ``addressQualifier``, ``type``, ``size``, ``offset``)
  and ``instance`` children.
- ``IP_LAYOUT`` (kind 8): ``int32 m_count``, 4 bytes padding, then ``m_count`` 80-byte
  ``ip_data``: ``m_type`` u32 (1 ``IP_KERNEL``, 7 ``IP_PS_KERNEL``: NPU kernels), ``properties``
  u32, ``m_base_address`` u64, ``m_name`` 64 (``"kernel:instance"``, NUL-padded).
"""

from __future__ import annotations

import os
import struct
import uuid as uuidlib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from flm_runtime.errors import FlmError

MAGIC = b"xclbin2\0"
HEADER_SIZE = 456            # magic .. m_header, where the section headers start
SECTION_HEADER_SIZE = 40
IP_DATA_SIZE = 80
MAX_SECTIONS = 0x10000       # XCLBIN_MAX_NUM_SECTION

EMBEDDED_METADATA = 2
IP_LAYOUT = 8
AIE_PARTITION = 32
IP_KERNEL = 1
IP_PS_KERNEL = 7

# enum axlf_section_kind, for messages and reports.
SECTION_KINDS = {
    0: "BITSTREAM", 1: "CLEARING_BITSTREAM", 2: "EMBEDDED_METADATA", 3: "FIRMWARE", 4: "DEBUG_DATA",
    5: "SCHED_FIRMWARE", 6: "MEM_TOPOLOGY", 7: "CONNECTIVITY", 8: "IP_LAYOUT", 9: "DEBUG_IP_LAYOUT",
    10: "DESIGN_CHECK_POINT", 11: "CLOCK_FREQ_TOPOLOGY", 12: "MCS", 13: "BMC", 14: "BUILD_METADATA",
    15: "KEYVALUE_METADATA", 16: "USER_METADATA", 17: "DNA_CERTIFICATE", 18: "PDI",
    19: "BITSTREAM_PARTIAL_PDI", 20: "PARTITION_METADATA", 21: "EMULATION_DATA",
    22: "SYSTEM_METADATA", 23: "SOFT_KERNEL", 24: "ASK_FLASH", 25: "AIE_METADATA",
    26: "ASK_GROUP_TOPOLOGY", 27: "ASK_GROUP_CONNECTIVITY", 28: "SMARTNIC", 29: "AIE_RESOURCES",
    30: "OVERLAY", 31: "VENDER_METADATA", 32: "AIE_PARTITION", 33: "IP_METADATA",
    34: "AIE_RESOURCES_BIN", 35: "AIE_TRACE_METADATA",
}


class XclbinError(FlmError, ValueError):
    """A file that is not a readable xclbin (bad magic, truncated, malformed metadata)."""


@dataclass(frozen=True)
class Section:
    """One ``axlf_section_header``: ``kind`` (enum axlf_section_kind), byte ``offset`` and ``size``."""

    kind: int
    name: str
    offset: int
    size: int

    @property
    def kind_name(self) -> str:
        return SECTION_KINDS.get(self.kind, f"kind {self.kind}")


@dataclass(frozen=True)
class KernelArg:
    """One kernel argument from ``EMBEDDED_METADATA``.

    Attributes:
        index: argument index (``id``), the position XRT sets it at; None when the XML has none.
        name: as the kernel build named it.
        address_qualifier: 0 scalar, 1 global (a buffer), 2 constant, 3 local, 4 stream.
        type: the C type, e.g. ``"uint64_t"``, ``"char *"``, ``"void*"``.
        size, offset: bytes in the kernel's argument block.
    """

    index: int | None
    name: str
    address_qualifier: int
    type: str
    size: int
    offset: int


@dataclass(frozen=True)
class XclbinKernel:
    """A kernel of ``EMBEDDED_METADATA``: ``args`` in argument order (sorted by index)."""

    name: str
    type: str
    args: tuple[KernelArg, ...]
    instances: tuple[str, ...]

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


@dataclass(frozen=True)
class IpEntry:
    """One ``struct ip_data`` of ``IP_LAYOUT``."""

    type: int
    properties: int
    base_address: int
    name: str


@dataclass(frozen=True)
class Xclbin:
    """What the reader extracts from one xclbin.

    Attributes:
        uuid: the xclbin's UUID (``m_header.uuid``), the one ``pyxrt.xclbin.get_uuid()`` returns.
        length: ``m_header.m_length``, the file size the header records (bytes).
        timestamp: ``m_timeStamp`` (seconds since the epoch).
        version: ``"major.minor.patch"`` of the tool that wrote it.
        platform_vbnv: ``m_platformVBNV`` (NUL-terminated text).
        sections: every section header, in file order.
        kernels: kernel name -> kernel, from ``EMBEDDED_METADATA`` (empty without that section).
        ip_layout: ``IP_LAYOUT`` entries (empty without that section).
    """

    path: str | None
    uuid: str
    length: int
    timestamp: int
    version: str
    platform_vbnv: str
    sections: tuple[Section, ...]
    kernels: dict[str, XclbinKernel]
    ip_layout: tuple[IpEntry, ...]

    def section(self, kind: int) -> Section | None:
        """The first section of ``kind``, or None."""
        return next((s for s in self.sections if s.kind == kind), None)

    def instances_of(self, kernel: str) -> list[IpEntry]:
        """Compute units of ``kernel`` in ``IP_LAYOUT`` (entries named ``kernel:<instance>``)."""
        return [ip for ip in self.ip_layout
                if ip.type in (IP_KERNEL, IP_PS_KERNEL) and ip.name.split(":", 1)[0] == kernel]


def read_xclbin(source: str | os.PathLike | bytes) -> Xclbin:
    """Read an xclbin file (or its bytes).

    Raises:
        XclbinError: wrong magic, a file shorter than its header, section table or sections,
            unreadable ``EMBEDDED_METADATA`` XML or ``IP_LAYOUT``. The message names the file.
        OSError: the file cannot be read.
    """
    path = None if isinstance(source, (bytes, bytearray)) else str(source)
    data = bytes(source) if path is None else Path(path).read_bytes()
    where = path or "<bytes>"
    if data[:8] != MAGIC:
        raise XclbinError(f"{where} is not an xclbin: magic {data[:8]!r}, expected {MAGIC!r}")
    if len(data) < HEADER_SIZE:
        raise XclbinError(f"{where} is truncated: {len(data)} bytes, shorter than the "
                          f"{HEADER_SIZE}-byte axlf header")
    length, timestamp = struct.unpack_from("<QQ", data, 304)
    patch, major, minor = struct.unpack_from("<HBB", data, 328)
    (n_sections,) = struct.unpack_from("<I", data, 448)
    if n_sections > MAX_SECTIONS:
        raise XclbinError(f"{where}: the header claims {n_sections} sections (at most {MAX_SECTIONS})")
    table_end = HEADER_SIZE + SECTION_HEADER_SIZE * n_sections
    if table_end > len(data):
        raise XclbinError(f"{where} is truncated: its section table ({n_sections} sections) ends at "
                          f"byte {table_end}, the file has {len(data)} bytes")
    if length > len(data):
        raise XclbinError(f"{where} is truncated: the header records {length} bytes, the file has "
                          f"{len(data)}")
    sections = tuple(_section(data, i, where) for i in range(n_sections))
    xml = next((s for s in sections if s.kind == EMBEDDED_METADATA), None)
    ips = next((s for s in sections if s.kind == IP_LAYOUT), None)
    return Xclbin(
        path=path,
        uuid=str(uuidlib.UUID(bytes=data[416:432])),
        length=length,
        timestamp=timestamp,
        version=f"{major}.{minor}.{patch}",
        platform_vbnv=_c_string(data[352:416]),
        sections=sections,
        kernels=_kernels(data[xml.offset : xml.offset + xml.size], where) if xml else {},
        ip_layout=_ip_layout(data[ips.offset : ips.offset + ips.size], where) if ips else (),
    )


def _section(data: bytes, i: int, where: str) -> Section:
    base = HEADER_SIZE + SECTION_HEADER_SIZE * i
    kind, name = struct.unpack_from("<I16s", data, base)
    offset, size = struct.unpack_from("<QQ", data, base + 24)
    section = Section(kind, _c_string(name), offset, size)
    if offset + size > len(data):
        raise XclbinError(f"{where} is truncated: section {i} ({section.kind_name}) spans bytes "
                          f"{offset}..{offset + size}, the file has {len(data)} bytes")
    return section


def _kernels(xml: bytes, where: str) -> dict[str, XclbinKernel]:
    """Kernels of the ``EMBEDDED_METADATA`` XML (``project/platform/device/core/kernel``)."""
    try:
        root = ET.fromstring(xml.rstrip(b"\0"))
    except ET.ParseError as e:
        raise XclbinError(f"{where}: EMBEDDED_METADATA is not valid XML ({e})") from e
    kernels = {}
    for k in root.iterfind("platform/device/core/kernel"):
        try:
            args = [KernelArg(index=_int(a.get("id", "")) if a.get("id", "") != "" else None,
                              name=a.attrib["name"],
                              address_qualifier=_int(a.get("addressQualifier", "0")),
                              type=a.get("type", ""),
                              size=_int(a.get("size", "0")),
                              offset=_int(a.get("offset", "0")))
                    for a in k.iterfind("arg")]
            name = k.attrib["name"]
        except (KeyError, ValueError) as e:
            raise XclbinError(f"{where}: a kernel or argument in EMBEDDED_METADATA lacks a name or "
                              f"has a non-numeric field ({e})") from e
        # XRT's order: by index, stable; arguments without an index go last.
        args.sort(key=lambda a: (a.index is None, a.index or 0))
        kernels[name] = XclbinKernel(name=name, type=k.get("type", "pl"), args=tuple(args),
                                     instances=tuple(i.get("name", "") for i in k.iterfind("instance")))
    return kernels


def _ip_layout(raw: bytes, where: str) -> tuple[IpEntry, ...]:
    if len(raw) < 8:
        raise XclbinError(f"{where}: IP_LAYOUT is {len(raw)} bytes, shorter than its count")
    (count,) = struct.unpack_from("<i", raw, 0)
    if count < 0 or 8 + IP_DATA_SIZE * count > len(raw):
        raise XclbinError(f"{where}: IP_LAYOUT claims {count} entries, its {len(raw)} bytes hold "
                          f"{max(0, (len(raw) - 8) // IP_DATA_SIZE)}")
    entries = []
    for i in range(count):
        kind, props, base, name = struct.unpack_from("<IIQ64s", raw, 8 + IP_DATA_SIZE * i)
        entries.append(IpEntry(kind, props, base, _c_string(name)))
    return tuple(entries)


def _c_string(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def _int(text: str) -> int:
    """XRT writes sizes and offsets in hex (``"0x08"``) and ids in decimal: accept both."""
    text = text.strip()
    return int(text, 16) if text[:2].lower() == "0x" else int(text, 10)
