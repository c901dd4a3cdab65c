"""Graceful drain of a real LiteLLM proxy serving flm (``litellm --config examples/proxy_config.yaml``)
on SIGTERM, with streams under way.

What is observable (``litellm_flm.compat.drain_on_sigterm``): within 0.1 s uvicorn closes the listening socket, so
a new connection is refused; a request the server had begun to read (its headers in, its body
still coming) reaches the handler and gets our 503, ``EngineDrainingError``'s message; the running
streams end with their whole output, the same as an undisturbed greedy run; the engine logs its
drain with its KV pool free; and the process ends by itself: uvicorn raises SIGTERM again under the
default handler once it has shut down, so its status is -SIGTERM, not 0.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import openai
import proxy_process
import pytest
from test_flm_proxy import CONFIG

DRAIN_S = 240  # FLM_DRAIN_TIMEOUT_S: ample for the streams on a busy machine
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?"]


def wait_for_line(log: Path, pattern: str, timeout: float = 60) -> re.Match:
    """The first match of ``pattern`` in the proxy's output, waiting up to ``timeout`` s for it."""
    deadline = time.monotonic() + timeout
    while (match := re.search(pattern, log.read_text(errors="replace"))) is None:
        assert time.monotonic() < deadline, f"no {pattern!r} in the proxy's output:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)
    return match


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_drains_the_running_streams_and_refuses_new_requests(smollm2_gguf, tmp_path):
    port, key, log = proxy_process.free_port(), f"sk-{secrets.token_hex(32)}", tmp_path / "proxy.log"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-dummy-not-used",
               LITELLM_MASTER_KEY=key, FLM_LOG_LEVEL="INFO", FLM_BACKEND="cpu", FLM_DRAIN_TIMEOUT_S=str(DRAIN_S),
               GRACEFUL_SHUTDOWN_TIMEOUT=str(DRAIN_S + 60))
    proc = proxy_process.start(CONFIG, port, env, log)
    try:
        proxy_process.wait_ready(proc, port, log)
        assert "SIGTERM drains the flm engines" in log.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=600, max_retries=0)

        def stream(question: str, started: threading.Event | None = None) -> tuple[str, str]:
            text, finish = [], None
            for chunk in client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": question}], temperature=0,
                    max_tokens=64, stream=True):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                    if started is not None and text[-1]:
                        started.set()
            return "".join(text), finish

        undisturbed = [stream(q) for q in QUESTIONS]  # one at a time (the first loads the model)

        # A request whose headers are in and whose body is still coming when SIGTERM arrives.
        body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        late = socket.create_connection(("127.0.0.1", port), timeout=600)
        late.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body[:10]}".encode())

        results, started = [None] * len(QUESTIONS), [threading.Event() for _ in QUESTIONS]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(QUESTIONS[i], started[i])))
                   for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        assert all(event.wait(timeout=300) for event in started)
        proc.send_signal(signal.SIGTERM)

        drain = wait_for_line(log, r"engine 'smollm2:135m' draining: (\d+) sequences running, (\d+) queued")
        assert drain.groups() == (str(len(QUESTIONS)), "0")
        late.sendall(body[10:].encode())
        response = late.makefile("rb").read().decode(errors="replace")
        late.close()
        assert response.startswith("HTTP/1.1 503"), response[:400]
        assert "shutting down and serves no new request" in response

        deadline = time.monotonic() + 60
        while not refused(port):  # uvicorn closes its socket at its next tick
            assert time.monotonic() < deadline, "the proxy still accepts connections"
            time.sleep(0.05)

        for t in threads:
            t.join(timeout=DRAIN_S)
        assert results == undisturbed
        assert all(finish in ("stop", "length") for _, finish in undisturbed)
        assert proc.wait(timeout=DRAIN_S + 120) == -signal.SIGTERM
        out = log.read_text(errors="replace")
        drained = re.search(r"engine 'smollm2:135m' drained: every request finished; engine stats (\{.*\})", out)
        assert drained is not None, out[-4000:]
        stats = json.loads(drained.group(1))
        assert (stats["finished"], stats["failed"], stats["kv_blocks_used"], stats["kv_cached_bytes"]) == (6, 0, 0, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
