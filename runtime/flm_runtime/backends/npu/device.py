"""Finding an AMD NPU from Linux sysfs, without XRT: PCI ids, the ``amdxdna`` driver, accel nodes.

What is read, all optional (a missing file means "not known", never an error):

- ``/sys/bus/pci/devices/*/{vendor,device,revision}``: AMD (``0x1022``) NPUs are ``1502``
  (XDNA1: NPU1, Phoenix / Hawk Point) and ``17f0`` (XDNA2: NPU4/5/6, Strix / Krackan / Strix Halo,
  told apart by the revision); the amdxdna driver binds both. Our kernels target XDNA2.
- the ``driver`` symlink of that PCI device: ``amdxdna`` when the driver is bound;
- ``fw_version``, ``vbnv`` and ``device_type`` of that PCI device: attributes the amdxdna driver
  (github.com/amd/xdna-driver, ``amdxdna_sysfs.c``) creates; absent with drivers that lack them;
- ``/sys/module/amdxdna`` (loaded) and its ``version`` (out-of-tree builds set one);
- ``/dev/accel/accel*``: the DRM accel nodes XRT opens; ``/sys/class/accel/accelN/device`` links a
  node to its PCI device.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

AMD_VENDOR = 0x1022
DRIVER = "amdxdna"
# (device id) -> generation; the amdxdna driver's PCI table binds these.
NPU_DEVICE_IDS = {0x1502: "XDNA1 (NPU1: Phoenix, Hawk Point)",
                  0x17F0: "XDNA2 (NPU4/5/6: Strix, Krackan, Strix Halo)"}
SUPPORTED_DEVICE_IDS = frozenset({0x17F0})  # what the manifest's kernels target


@dataclass(frozen=True)
class NpuPciDevice:
    """One AMD NPU on the PCI bus.

    Attributes:
        bdf: PCI address, e.g. ``"0000:c5:00.1"``.
        pci_id: ``"1022:17f0"``.
        revision: the PCI revision (``0x10`` NPU4, ``0x11`` NPU5, ``0x20`` NPU6 on 17f0), or None.
        generation: XDNA1 / XDNA2 in words.
        supported: the manifest's kernels target this device.
        driver: the bound driver's name, or None when no driver is bound.
        accel_nodes: ``/dev/accel/accelN`` nodes that belong to this device.
        fw_version, vbnv, device_type: the amdxdna driver's sysfs attributes, when readable.
    """

    bdf: str
    pci_id: str
    revision: int | None
    generation: str
    supported: bool
    driver: str | None
    accel_nodes: tuple[str, ...] = ()
    fw_version: str | None = None
    vbnv: str | None = None
    device_type: str | None = None


@dataclass(frozen=True)
class NpuDetection:
    """What sysfs says about NPUs on this machine."""

    devices: tuple[NpuPciDevice, ...]
    accel_nodes: tuple[str, ...]
    driver_loaded: bool
    driver_version: str | None

    @property
    def present(self) -> bool:
        return bool(self.devices)

    @property
    def usable(self) -> bool:
        """A supported NPU, bound to amdxdna, with an accel node: what XRT needs to open it."""
        return any(d.supported and d.driver == DRIVER and d.accel_nodes for d in self.devices)

    def summary(self) -> str:
        """One line for logs and error messages."""
        if not self.devices:
            nodes = f"; accel nodes: {', '.join(self.accel_nodes)}" if self.accel_nodes else ""
            return (f"no AMD NPU on the PCI bus (looked for {AMD_VENDOR:04x}:17f0 and "
                    f"{AMD_VENDOR:04x}:1502){nodes}")
        parts = []
        for d in self.devices:
            state = [d.generation, f"driver {d.driver or 'none bound'}"]
            if d.fw_version:
                state.append(f"firmware {d.fw_version}")
            state.append(", ".join(d.accel_nodes) if d.accel_nodes else "no /dev/accel node")
            if not d.supported:
                state.append("not supported by our kernels (they target XDNA2, 1022:17f0)")
            parts.append(f"{d.pci_id} at {d.bdf} ({'; '.join(state)})")
        if not self.driver_loaded:
            parts.append(f"the {DRIVER} kernel module is not loaded")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "present": self.present, "usable": self.usable}


def detect_npu(sys_root: str | os.PathLike = "/sys", dev_root: str | os.PathLike = "/dev") -> NpuDetection:
    """Scan sysfs (``sys_root``) and ``dev_root`` for AMD NPUs; never raises for missing files."""
    sys_root, dev_root = Path(sys_root), Path(dev_root)
    node_of = _accel_nodes_by_pci(sys_root, dev_root)
    devices = []
    for dev in sorted(_glob(sys_root / "bus" / "pci" / "devices")):
        vendor, device = _hex(dev / "vendor"), _hex(dev / "device")
        if vendor != AMD_VENDOR or device not in NPU_DEVICE_IDS:
            continue
        driver = dev / "driver"
        devices.append(NpuPciDevice(
            bdf=dev.name,
            pci_id=f"{vendor:04x}:{device:04x}",
            revision=_hex(dev / "revision"),
            generation=NPU_DEVICE_IDS[device],
            supported=device in SUPPORTED_DEVICE_IDS,
            driver=os.path.basename(os.readlink(driver)) if driver.is_symlink() else None,
            accel_nodes=tuple(sorted(node_of.get(dev.name, ()))),
            fw_version=_text(dev / "fw_version"),
            vbnv=_text(dev / "vbnv"),
            device_type=_text(dev / "device_type"),
        ))
    module = sys_root / "module" / DRIVER
    return NpuDetection(
        devices=tuple(devices),
        accel_nodes=tuple(sorted(str(p) for p in _glob(dev_root / "accel") if p.name.startswith("accel"))),
        driver_loaded=module.is_dir(),
        driver_version=_text(module / "version"),
    )


def _accel_nodes_by_pci(sys_root: Path, dev_root: Path) -> dict[str, list[str]]:
    """PCI address -> ``/dev/accel/accelN`` nodes, from ``/sys/class/accel/accelN/device``."""
    nodes: dict[str, list[str]] = {}
    for cls in _glob(sys_root / "class" / "accel"):
        link = cls / "device"
        try:
            bdf = os.path.basename(os.path.realpath(link)) if link.exists() else None
        except OSError:
            bdf = None
        if bdf:
            nodes.setdefault(bdf, []).append(str(dev_root / "accel" / cls.name))
    return nodes


def _glob(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _hex(path: Path) -> int | None:
    text = _text(path)
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None
