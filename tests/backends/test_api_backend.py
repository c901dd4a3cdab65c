"""``get_engine(tag, backend=...)``: the engine runs on the backend chosen, npu included (through
a fake pyxrt), and auto / npu behave as ``select`` says when the npu backend is absent or broken."""

from __future__ import annotations

import logging
import sys

import pytest

from flm_runtime import api, registry
from flm_runtime.backends import npu, select
from flm_runtime.backends.npu import NpuModel
from flm_runtime.errors import BackendUnavailableError, InvalidRequestError
from flm_runtime.models.causal_lm import CausalLM

from npu_fixtures import TAG, ByteTokenizer, fake_pyxrt_for, tiny_model, write_tiny_build


@pytest.fixture
def tiny_api(tmp_path, monkeypatch):
    """``tiny:1m`` in a user models file, loaded as the tiny random model; a runtime of its own."""
    models = tmp_path / "models.yaml"
    models.write_text(f"{TAG}: {tmp_path / 'tiny.gguf'}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    registry.reload()
    for name in ("FLM_BACKEND", "XILINX_XRT", "FLM_XCLBIN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(npu, "XRT_PYTHON_DIRS", ())
    monkeypatch.setattr(select, "_logged", set())
    runtime = api.Runtime()
    monkeypatch.setattr(api, "default_runtime", runtime)
    cpu = tiny_model()
    monkeypatch.setattr(api, "load_model", lambda tag, models: api.LoadedModel(tag, cpu, ByteTokenizer()))
    npu.close_device()
    yield cpu
    runtime.close()
    npu.close_device()


def greedy(engine, n: int = 16) -> list[int]:
    params = engine.sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(engine.submit([5, 17, 42, 3, 88, 61, 7, 7, 30, 2, 14], params).result().token_ids)


def test_the_same_tag_on_npu_and_cpu(tiny_api, tmp_path, monkeypatch):
    manifest = write_tiny_build(tmp_path / "xclbins", tiny_api)
    monkeypatch.setenv("FLM_XCLBIN_PATH", str(tmp_path / "xclbins"))
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt_for(manifest, tiny_api))
    on_npu = api.get_engine(TAG, backend="npu")
    on_cpu = api.get_engine(TAG, backend="cpu")
    assert isinstance(on_npu.model, NpuModel) and on_npu.name == f"{TAG}[npu]"
    assert on_cpu.model is tiny_api and on_cpu.name == TAG
    assert on_npu.model.embed is on_cpu.model.embed  # the npu target keeps the cpu model's host arrays
    assert api.get_engine(TAG) is on_npu  # auto: everything is there
    assert greedy(on_npu) == greedy(on_cpu)


def test_npu_requested_without_pyxrt(tiny_api, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    monkeypatch.setenv("FLM_BACKEND", "npu")
    with pytest.raises(BackendUnavailableError, match=f"the npu backend was requested for {TAG} but cannot "
                                                      "run: pyxrt is not importable"):
        api.get_engine(TAG)
    assert api.get_engine(TAG, backend="cpu").model is tiny_api  # a deployment's choice wins
    with pytest.raises(InvalidRequestError, match="backend must be one of auto, cpu, npu; got 'tpu'"):
        api.get_engine(TAG, backend="tpu")


def test_auto_without_pyxrt_is_cpu_with_one_log_line(tiny_api, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    caplog.set_level(logging.INFO, logger="flm_runtime.backends.select")
    engines = {api.get_engine(TAG) for _ in range(3)}
    assert len(engines) == 1 and isinstance(engines.pop().model, CausalLM)
    (record,) = caplog.records
    assert record.getMessage().startswith(f"backend auto chose cpu for {TAG}: pyxrt is not importable")


def test_auto_falls_back_when_the_npu_model_fails_to_start(tiny_api, tmp_path, monkeypatch, caplog):
    other = tiny_model(max_positions=256)  # a build for another geometry: validates, but does not fit
    manifest = write_tiny_build(tmp_path / "xclbins", other)
    monkeypatch.setenv("FLM_XCLBIN_PATH", str(tmp_path / "xclbins"))
    monkeypatch.setitem(sys.modules, "pyxrt", fake_pyxrt_for(manifest, other))
    caplog.set_level(logging.INFO, logger="flm_runtime.backends.select")
    assert isinstance(api.get_engine(TAG).model, CausalLM)
    (record,) = caplog.records
    assert "the npu backend failed to start: the NPU kernel build for tiny:1m does not fit this model: " \
           "max_positions: build 256, model 128" in record.getMessage()
    with pytest.raises(BackendUnavailableError, match="does not fit this model"):
        api.get_engine(TAG, backend="npu")
