"""NPU detection from a fake sysfs tree laid out as Linux and the amdxdna driver lay it out."""

from __future__ import annotations

import os

from flm_runtime.backends.npu.device import detect_npu


def fake_sysfs(root, *, device="0x17f0", revision="0x10", driver="amdxdna", fw="1.5.2.380",
               accel=True, module=True):
    sys_root, dev_root = root / "sys", root / "dev"
    devices = sys_root / "devices" / "pci0000:00" / "0000:00:08.2"
    npu = devices / "0000:c5:00.1"
    npu.mkdir(parents=True)
    for name, value in (("vendor", "0x1022"), ("device", device), ("revision", revision)):
        (npu / name).write_text(value + "\n")
    if fw:
        (npu / "fw_version").write_text(fw + "\n")
        (npu / "vbnv").write_text("RyzenAI-npu4\n")
    if driver:
        drv = sys_root / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True)
        os.symlink(drv, npu / "driver")
    other = devices / "0000:00:01.0"  # a non-NPU device on the same bus
    other.mkdir()
    (other / "vendor").write_text("0x1022\n")
    (other / "device").write_text("0x14ea\n")
    bus = sys_root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for dev in (npu, other):
        os.symlink(dev, bus / dev.name)
    if accel:
        cls = sys_root / "class" / "accel" / "accel0"
        cls.mkdir(parents=True)
        os.symlink(npu, cls / "device")
        (dev_root / "accel").mkdir(parents=True)
        (dev_root / "accel" / "accel0").write_text("")
    if module:
        (sys_root / "module" / "amdxdna").mkdir(parents=True)
        (sys_root / "module" / "amdxdna" / "version").write_text("2.19.0\n")
    return sys_root, dev_root


def test_an_xdna2_npu_with_driver_and_node(tmp_path):
    d = detect_npu(*fake_sysfs(tmp_path))
    assert d.present and d.usable and d.driver_loaded and d.driver_version == "2.19.0"
    (npu,) = d.devices
    assert (npu.bdf, npu.pci_id, npu.revision, npu.driver) == ("0000:c5:00.1", "1022:17f0", 0x10, "amdxdna")
    assert npu.accel_nodes == (str(tmp_path / "dev" / "accel" / "accel0"),)
    assert (npu.fw_version, npu.vbnv, npu.supported) == ("1.5.2.380", "RyzenAI-npu4", True)
    assert "1022:17f0 at 0000:c5:00.1 (XDNA2" in d.summary() and "firmware 1.5.2.380" in d.summary()
    assert d.as_dict()["usable"] is True


def test_no_driver_bound_no_node(tmp_path):
    d = detect_npu(*fake_sysfs(tmp_path, driver=None, accel=False, module=False, fw=None))
    assert d.present and not d.usable
    assert d.devices[0].fw_version is None
    assert "driver none bound" in d.summary() and "no /dev/accel node" in d.summary()
    assert "the amdxdna kernel module is not loaded" in d.summary()


def test_xdna1_is_detected_but_not_supported(tmp_path):
    d = detect_npu(*fake_sysfs(tmp_path, device="0x1502", revision="0x00"))
    assert d.present and not d.usable
    assert "not supported by our kernels" in d.summary()


def test_nothing_there(tmp_path):
    d = detect_npu(tmp_path / "sys", tmp_path / "dev")
    assert not d.present and not d.usable and d.devices == ()
    assert d.summary().startswith("no AMD NPU on the PCI bus")
    assert detect_npu().present in (True, False)  # the real /sys: never raises
