"""The pipeline's generation stage runs its workers niced and ends with them: a killed run leaves
none behind to write the shards a resumed run writes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def _workers(parent: int) -> list[int]:
    """PIDs of the multiprocessing-spawned children of ``parent``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if ppid == parent and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


def _nice(pid: int) -> int:
    """The niceness of ``pid`` (field 19 of ``/proc/<pid>/stat``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_the_pipeline_stops_its_generation_workers(tmp_path):
    cmd = [sys.executable, "-m", "flm_train.pipeline", "--target", "smollm2:135m", "--out", str(tmp_path),
           "--prompts", "templates:256", "--stages", "prompts,generate", "--workers", "2"]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(workers := _workers(run.pid)) < 2 and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.1)
        assert len(workers) == 2, run.stderr.read().decode() if run.poll() is not None else "workers never started"
        niced = {min(19, _nice(run.pid) + 10)}  # --nice 10 by default; 19 is the most there is
        while {_nice(w) for w in workers} != niced and time.monotonic() < deadline:
            time.sleep(0.1)  # each worker renices itself first thing
        assert {_nice(w) for w in workers} == niced
        time.sleep(2)  # into loading the model or generating
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) != 0
        assert not [w for w in workers if _running(w)]
    finally:
        if run.poll() is None:
            run.kill()
        run.stderr.close()
