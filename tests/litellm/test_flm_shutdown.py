"""``litellm_flm.compat.drain_on_sigterm``: SIGTERM drains the engines, chained before the server's own handler,
and only in a proxy's process; a drained engine's refusal is a 503 through LiteLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import types

import litellm
import pytest

from flm_runtime.errors import EngineDrainingError
from litellm_flm import compat


@pytest.fixture
def sigterm():
    """The SIGTERM handler as it was, put back after the test."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_an_sdk_process_keeps_its_sigterm_handler():
    code = "import signal, litellm_flm; print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True"))
    assert out.stdout.strip() == "True"


def test_in_a_proxy_sigterm_starts_the_drain_then_calls_the_servers_handler(monkeypatch, sigterm):
    monkeypatch.setitem(sys.modules, compat.PROXY_SERVER, types.ModuleType(compat.PROXY_SERVER))
    order, drained = [], threading.Event()

    def server_handler(signum, frame):
        order.append(("server", signum))

    def drain():
        order.append(("drain", None))
        drained.set()
        return True

    signal.signal(signal.SIGTERM, server_handler)
    assert compat.drain_on_sigterm(drain) is True
    wrapper = signal.getsignal(signal.SIGTERM)
    assert compat.drain_on_sigterm(drain) is True and signal.getsignal(signal.SIGTERM) is wrapper  # idempotent
    os.kill(os.getpid(), signal.SIGTERM)
    assert drained.wait(timeout=10)
    assert sorted(order) == [("drain", None), ("server", signal.SIGTERM)]


def test_no_wrapper_outside_a_proxy_or_without_a_handler_to_chain_to(monkeypatch, sigterm):
    monkeypatch.delitem(sys.modules, compat.PROXY_SERVER, raising=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    handler = signal.getsignal(signal.SIGTERM)
    assert compat.drain_on_sigterm() is False and signal.getsignal(signal.SIGTERM) is handler
    monkeypatch.setitem(sys.modules, compat.PROXY_SERVER, types.ModuleType(compat.PROXY_SERVER))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert compat.drain_on_sigterm() is False and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_draining_engine_is_a_503_through_litellm(monkeypatch):
    from litellm_flm import llm

    def draining(tag, backend=None):
        raise EngineDrainingError(f"this process is shutting down and serves no new request for {tag!r}; "
                                  "retry on another deployment")

    monkeypatch.setattr(llm, "_get_engine", draining)
    with pytest.raises(litellm.ServiceUnavailableError, match="shutting down and serves no new request") as info:
        litellm.completion(model="flm/smollm2:135m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 503 and isinstance(info.value.__cause__, EngineDrainingError)
