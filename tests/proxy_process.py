"""``litellm --config`` proxies as subprocesses of the tests, on free ports of 127.0.0.1.

``start`` returns at once, so a test may start several and wait for them together; ``wait_ready``
polls ``/health/liveliness`` (the proxy's import takes tens of seconds on this machine) and fails
the test when the proxy exits; ``stop`` always ends the process.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 180


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: Path, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``litellm --config CONFIG`` on ``127.0.0.1:PORT`` with environment ``env``, its output
    (stdout and stderr) appended to ``log``; run from the repository root."""
    cmd = [str(Path(sys.executable).with_name("litellm")), "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port), "--telemetry", "False"]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = STARTUP_S) -> None:
    """Return once the proxy on ``port`` answers ``/health/liveliness``.

    Fails the test when the proxy exited (a missing module included: the ``test`` extra holds the
    ``proxy`` one, and our provider's own import errors look the same) or was not ready within
    ``timeout`` s.
    """
    url = f"http://127.0.0.1:{port}/health/liveliness"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = log.read_text(errors="replace")
            pytest.fail(f"the proxy exited with {proc.returncode}:\n{out[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the proxy was not ready within {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Terminate the proxy (SIGTERM), killing it after 30 s; a no-op for an ended one."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
