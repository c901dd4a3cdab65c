"""``litellm-flm validate [--json]`` here (no NPU, no pyxrt, nothing shipped) and on a faked
machine that has all three (sysfs tree, fake pyxrt, synthetic build)."""

from __future__ import annotations

import json
import sys

import pytest

from flm_runtime import cli
from flm_runtime.backends.npu import manifest as mf
from flm_runtime.backends import npu, select
from flm_runtime.backends.npu import device as npu_device

from npu_fixtures import fake_pyxrt_for, tiny_model
from test_npu_device import fake_sysfs
from xclbin_files import LAYER_ARGS, write_build


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("FLM_BACKEND", "XILINX_XRT", "FLM_XCLBIN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(npu, "XRT_PYTHON_DIRS", ())
    monkeypatch.setattr(select, "_logged", set())
    npu.close_device()
    yield
    npu.close_device()


def run(capsys, *argv) -> tuple[int, str]:
    status = cli.main(["validate", *argv])
    return status, capsys.readouterr().out


def test_this_machine_without_npu(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    monkeypatch.setattr(npu_device, "detect_npu", lambda: npu_device.NpuDetection((), (), False, None))
    status, out = run(capsys)
    assert status == 0
    assert "  none on the PCI bus" in out and "driver: amdxdna not loaded" in out
    assert "pyxrt: pyxrt is not importable" in out and "No xclbin is shipped" in out
    assert "auto would choose cpu, because:" in out and "FLM_BACKEND unset (auto): runs on cpu" in out

    status, out = run(capsys, "smollm2-dflash:135m")  # a DFlash tag: the tag asked, and its base's kernels
    assert "backend for smollm2-dflash:135m (runs its target smollm2:135m)\n" in out
    status, out = run(capsys, "--json", "smollm2-dflash:135m")
    report = json.loads(out)
    assert (report["tag"], report["target"]) == ("smollm2-dflash:135m", "smollm2:135m")
    assert report["npu"]["present"] is False and report["pyxrt"]["importable"] is False
    assert report["device"] == {"opened": False, "name": None, "error": None}
    assert report["manifest"]["shipped"] is False and report["manifest"]["builds"] == []
    assert report["backend"]["auto"] == "cpu" and report["backend"]["would_run"] == "cpu"
    missing = report["backend"]["missing"]
    assert [m.split(" ")[0] for m in missing] == ["pyxrt", "NPU:", "xclbins:"]

    monkeypatch.setenv("FLM_BACKEND", "npu")
    assert "FLM_BACKEND=npu: runs on nothing: the npu backend cannot run" in run(capsys)[1]


def test_a_machine_with_everything(capsys, monkeypatch, tmp_path):
    sys_root, dev_root = fake_sysfs(tmp_path / "root")
    real = npu_device.detect_npu
    monkeypatch.setattr(npu_device, "detect_npu", lambda: real(sys_root, dev_root))
    cpu = tiny_model()
    folder = tmp_path / "xclbins"
    kernels = write_build(folder)
    broken = write_build(folder / "old", layer_args=list(reversed(LAYER_ARGS)))
    raw = json.loads((mf.xclbin_dir() / "manifest.json").read_text())
    raw["builds"] = [{"model": "smollm2:135m", "geometry": mf.geometry_of(cpu.config), "kernels": kernels},
                     {"model": "old:1m", "geometry": mf.geometry_of(cpu.config),
                      "kernels": {r: {**k, "xclbin": "old/" + k["xclbin"], "instructions": "old/" + k["instructions"]}
                                  for r, k in broken.items()}}]
    (folder / "manifest.json").write_text(json.dumps(raw))
    monkeypatch.setenv("FLM_XCLBIN_PATH", str(folder))
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt_for(mf.load_manifest(folder / "manifest.json"), cpu))

    status, out = run(capsys)
    assert status == 0
    assert "1022:17f0 at 0000:c5:00.1: XDNA2" in out and "firmware 1.5.2.380" in out
    assert "driver: amdxdna loaded (version 2.19.0)" in out
    assert "device 0: opened (RyzenAI-npu4 (fake))" in out
    assert "  smollm2:135m: validates" in out and "  old:1m: does not validate" in out
    assert "    decode_layer: FAILS (decode_layer.xclbin: flm_decode_layer" in out
    assert "auto would choose npu: pyxrt imports, the NPU opens and the xclbins of smollm2:135m validate" in out
    report = json.loads(run(capsys, "--json")[1])
    assert report["npu"]["usable"] is True and report["device"]["opened"] is True
    assert [b["ok"] for b in report["manifest"]["builds"]] == [True, False]
    assert report["backend"]["auto"] == "npu" and report["backend"]["would_run"] == "npu"

