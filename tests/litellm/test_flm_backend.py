"""``backend`` (auto / cpu / npu) per deployment (litellm_params) or per request (extra_body), and
the npu backend's unavailability as a 503 that the Router retries elsewhere."""

from __future__ import annotations

import sys

import litellm
import pytest

from flm_runtime.backends import npu, select
from flm_runtime.errors import BackendUnavailableError

MSG = [{"role": "user", "content": "hi"}]


def test_backend_from_kwargs_extra_body_and_router(fake_engine):
    litellm.completion(model="flm/smollm2:135m", messages=MSG)
    litellm.completion(model="flm/smollm2:135m", messages=MSG, backend="npu")
    litellm.completion(model="flm/smollm2:135m", messages=MSG, extra_body={"backend": "CPU"})
    router = litellm.Router(model_list=[{"model_name": "local",
                                         "litellm_params": {"model": "flm/smollm2:135m", "backend": "auto"}}])
    router.completion(model="local", messages=MSG)
    assert fake_engine.requested_backends == [None, "npu", "cpu", "auto"]


def test_a_bad_backend_is_a_bad_request_naming_it(fake_engine):
    with pytest.raises(litellm.BadRequestError, match="backend must be one of auto, cpu, npu; got 'gpu'") as e:
        litellm.completion(model="flm/smollm2:135m", messages=MSG, extra_body={"backend": "gpu"})
    assert e.value.param == "backend"
    assert fake_engine.requested_backends == []  # refused before any engine is asked for


def test_npu_unavailable_is_service_unavailable(monkeypatch):
    """Through the real get_engine: no pyxrt here, so backend='npu' fails with what is missing."""
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    monkeypatch.setattr(npu, "XRT_PYTHON_DIRS", ())
    monkeypatch.setattr(select, "_logged", set())
    with pytest.raises(litellm.ServiceUnavailableError) as e:
        litellm.completion(model="flm/smollm2:135m", messages=MSG, backend="npu")
    assert isinstance(e.value.__cause__, BackendUnavailableError)
    assert "the npu backend was requested for smollm2:135m but cannot run: pyxrt is not importable" in str(e.value)
    assert e.value.status_code == 503 and e.value.llm_provider == "flm"
