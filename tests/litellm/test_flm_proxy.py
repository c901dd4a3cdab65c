"""The LiteLLM proxy serving examples/proxy_config.yaml, called with the OpenAI SDK.

Starts ``litellm --config examples/proxy_config.yaml`` as a subprocess on a free local port (the
proxy loads the model itself, in its own process), waits for ``/health/liveliness``, and always
terminates the proxy. Skipped when the proxy's own dependencies are not installed.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("flm_runtime.api", reason="flm_runtime.api (get_engine) is not there yet")
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "proxy_config.yaml"
STARTUP_S = 180  # importing the proxy takes tens of seconds on this machine
REQUEST_S = 300  # the first request also loads the model in the proxy process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = log.read_text(errors="replace")
            if "ModuleNotFoundError" in out:
                pytest.skip(f"the LiteLLM proxy's dependencies are not installed: {out.strip().splitlines()[-1]}")
            pytest.fail(f"the proxy exited with {proc.returncode}:\n{out[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"the proxy was not ready within {STARTUP_S} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def proxy_url(smollm2_gguf, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    key = f"sk-{secrets.token_hex(32)}"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-dummy-not-used", LITELLM_MASTER_KEY=key)
    litellm_cli = Path(sys.executable).with_name("litellm")
    cmd = [str(litellm_cli), "--config", str(CONFIG), "--host", "127.0.0.1", "--port", str(port), "--telemetry", "False"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}/health/liveliness", log)
        yield f"http://127.0.0.1:{port}/v1", key
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(proxy_url):
    url, key = proxy_url
    return openai.OpenAI(base_url=url, api_key=key, timeout=REQUEST_S, max_retries=0)


def test_chat_completion_through_the_proxy(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
        extra_body={"top_k": 1},  # arrives nested in optional_params["extra_body"]
    )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24


def test_stream_through_the_proxy(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_bad_param_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2, presence_penalty=1.0
        )
    assert "presence_penalty" in str(info.value)
