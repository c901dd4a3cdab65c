"""FLM_BACKEND=auto|cpu|npu: auto falls back to cpu with one log line; npu says what is missing."""

from __future__ import annotations

import logging
import sys

import pytest

from flm_runtime.backends import npu, select
from flm_runtime.backends.select import select_backend
from flm_runtime.errors import BackendUnavailableError, InvalidRequestError

from npu_fixtures import TAG, fake_pyxrt_for, tiny_model, write_tiny_build


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("FLM_BACKEND", raising=False)
    monkeypatch.delenv("XILINX_XRT", raising=False)
    monkeypatch.setattr(npu, "XRT_PYTHON_DIRS", ())
    monkeypatch.setattr(select, "_logged", set())
    npu.close_device()
    yield
    npu.close_device()


@pytest.fixture
def no_pyxrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyxrt", None)  # `import pyxrt` raises ImportError


@pytest.fixture
def tiny_build(tmp_path, monkeypatch):
    """A valid synthetic build for TAG in $FLM_XCLBIN_PATH; returns (manifest, cpu model)."""
    cpu = tiny_model()
    manifest = write_tiny_build(tmp_path, cpu)
    monkeypatch.setenv("FLM_XCLBIN_PATH", str(tmp_path))
    return manifest, cpu


def test_auto_falls_back_to_cpu_with_one_log_line(no_pyxrt, caplog):
    caplog.set_level(logging.INFO, logger="flm_runtime.backends.select")
    for _ in range(3):
        choice = select_backend(None, "smollm2:135m")
        assert (choice.name, choice.requested) == ("cpu", "auto")
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert line.startswith("backend auto chose cpu for smollm2:135m: pyxrt is not importable")
    assert "has no kernel build for smollm2:135m; no xclbin is shipped" in line


def test_npu_requested_without_pyxrt_says_what_is_missing(no_pyxrt, monkeypatch):
    monkeypatch.setenv("FLM_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(None, "smollm2:135m")
    msg = str(e.value)
    assert msg.startswith("the npu backend was requested for smollm2:135m but cannot run: pyxrt is not importable")
    assert "/opt/xilinx/xrt/python" in msg and "NPU: no AMD NPU on the PCI bus" in msg
    assert "xclbins: " in msg and "no xclbin is shipped" in msg


def test_npu_requested_without_a_device(tiny_build, monkeypatch):
    manifest, cpu = tiny_build
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt_for(manifest, cpu, devices=0))
    with pytest.raises(BackendUnavailableError, match=r"cannot run: no NPU device: pyxrt.device\(0\) failed: "
                                                      r"No such device with index '0'"):
        select_backend("npu", TAG)
    assert select_backend("auto", TAG).name == "cpu"


def test_auto_chooses_npu_when_everything_is_there(tiny_build, monkeypatch):
    manifest, cpu = tiny_build
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt_for(manifest, cpu))
    choice = select_backend(None, TAG)
    assert choice.name == "npu"
    assert choice.reason == f"pyxrt imports, the NPU opens (RyzenAI-npu4 (fake)) and the xclbins of {TAG} validate"
    assert select_backend("npu", TAG).name == "npu"
    assert select_backend("cpu", TAG).name == "cpu"
    # The same machine, a model without a build: auto says so and runs on cpu.
    other = select_backend("auto", "smollm2:135m")
    assert other.name == "cpu" and "has no kernel build for smollm2:135m" in other.reason


def test_requested_values(monkeypatch):
    monkeypatch.setenv("FLM_BACKEND", "CPU")
    assert select.requested_backend() == "cpu"
    assert select.requested_backend("npu") == "npu"  # a deployment's value beats the environment
    monkeypatch.setenv("FLM_BACKEND", "gpu")
    with pytest.raises(InvalidRequestError, match="FLM_BACKEND must be one of auto, cpu, npu; got 'gpu'") as e:
        select_backend(None, "smollm2:135m")
    assert e.value.param == "backend"
    with pytest.raises(InvalidRequestError, match="backend must be one of auto, cpu, npu; got 7"):
        select.requested_backend(7)
