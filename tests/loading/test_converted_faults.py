"""A load killed (SIGKILL) while it writes the kept conversion of a GGUF, and a disk that cannot
hold that file: no part of it is ever under its name, the next load converts again and keeps it
(saying why where a temporary file was left), and a full disk is ``DiskSpaceError`` naming the
file, the bytes it needs and the bytes free, with nothing left (loading/converted.py's docstring)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from test_loading_gguf import _same_bytes
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf

from flm_runtime.errors import DiskSpaceError
from flm_runtime.loading import converted
from flm_runtime.loading import gguf as gguf_loader
from flm_runtime.loading.gguf import load_gguf

# Loads the GGUF argv[1] keeping its conversion in argv[2]; argv[3]: "stop" writes argv[2]/../stopped
# after the first part and waits to be killed, "named" also writes under a temporary name (as where
# O_TMPFILE is missing), "full" prints the DiskSpaceError it gets and what the folder holds then.
WORKER = """
import os, sys, time
from pathlib import Path
from flm_runtime import files
from flm_runtime.errors import DiskSpaceError
from flm_runtime.loading import converted
from flm_runtime.loading.gguf import load_gguf
source, keep, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if mode in ("stop", "named"):
    write_part = converted._write_part
    def stopping(*args):
        rows = write_part(*args)
        (keep.parent / "stopped").write_text(str(os.getpid()))
        time.sleep(600)
    converted._write_part = stopping
if mode == "named":
    files._O_TMPFILE = None
try:
    load_gguf(source, weights="auto", keep=keep)
except DiskSpaceError as e:
    print(type(e).__name__, e.need_bytes, e.free_bytes, sorted(os.listdir(keep)), str(e), sep="\\n")
"""


@pytest.fixture
def tiny_q4(tmp_path):
    config = tiny_config()
    return write_tiny_gguf(tmp_path / "q.gguf", config, random_hf_weights(config), qtype=gguf.GGMLQuantizationType.Q4_1)


def counting_conversions(monkeypatch) -> list:
    conversions = []
    convert = gguf_loader.load_gguf_weights
    monkeypatch.setattr(gguf_loader, "load_gguf_weights", lambda *a, **k: conversions.append(1) or convert(*a, **k))
    return conversions


@pytest.mark.parametrize("mode", ["stop", "named"], ids=["unnamed", "named"])
def test_a_load_killed_while_keeping_its_conversion_leaves_nothing_used(tmp_path, tiny_q4, monkeypatch, caplog,
                                                                       mode):
    keep = tmp_path / "kept"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_q4), str(keep), mode])
    deadline = time.monotonic() + 120
    while not (tmp_path / "stopped").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the worker did not reach its first part"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = sorted(p.name for p in keep.iterdir())
    kept = converted.cache_file(keep, tiny_q4, "auto")
    if mode == "named":  # the killed write's temporary name, never the kept file's
        assert len(left) == 1 and left[0].startswith(f".{kept.name}.{proc.pid}.") and left[0].endswith(".part")
    else:  # unnamed: the kernel freed it with the process
        assert left == []

    fresh = load_gguf(tiny_q4, weights="auto").weights
    conversions = counting_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="flm_runtime"):
        _same_bytes(load_gguf(tiny_q4, weights="auto", keep=keep).weights, fresh)  # converted again, kept
    assert len(conversions) == 1 and sorted(p.name for p in keep.iterdir()) == [kept.name]
    said = [r.getMessage() for r in caplog.records]
    assert said == ([f"removed {keep / left[0]}, a conversion left unfinished by a process that ended while "
                     "writing it"] if mode == "named" else [])
    _same_bytes(load_gguf(tiny_q4, weights="auto", keep=keep).weights, fresh)  # mapped, not converted
    assert len(conversions) == 1


def test_a_kept_file_cut_short_is_not_used_and_says_why(tmp_path, tiny_q4, monkeypatch, caplog):
    keep = tmp_path / "kept"
    fresh = load_gguf(tiny_q4, weights="auto").weights
    load_gguf(tiny_q4, weights="auto", keep=keep)
    kept = converted.cache_file(keep, tiny_q4, "auto")
    data = kept.read_bytes()
    cut = tmp_path / "cut"
    cut.write_bytes(data[:len(data) // 2])
    os.replace(cut, kept)  # a copy cut short (a new file: the load above still maps the old one)
    conversions = counting_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="flm_runtime"):
        _same_bytes(load_gguf(tiny_q4, weights="auto", keep=keep).weights, fresh)
    assert len(conversions) == 1 and kept.read_bytes() == data
    assert [r.getMessage() for r in caplog.records] == [
        f"not using the kept conversion {kept} ({len(data) // 2:,} bytes where its header says {len(data):,}: "
        "cut short or damaged); converting again"]


def kept_size(tmp_path: Path, source: Path) -> int:
    load_gguf(source, weights="auto", keep=tmp_path / "sized")
    return converted.cache_file(tmp_path / "sized", source, "auto").stat().st_size


def test_no_room_to_reserve_the_file_is_a_disk_space_error(tmp_path, tiny_q4, monkeypatch):
    need = kept_size(tmp_path, tiny_q4)
    keep = tmp_path / "kept"

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    conversions = counting_conversions(monkeypatch)
    with pytest.raises(DiskSpaceError) as info:
        load_gguf(tiny_q4, weights="auto", keep=keep)
    kept = converted.cache_file(keep, tiny_q4, "auto")
    free = shutil.disk_usage(keep).free
    assert info.value.path == kept and info.value.need_bytes == need
    assert abs(info.value.free_bytes - free) < 1 << 30  # the same disk, a moment apart
    assert str(info.value).startswith(f"not enough disk space for {kept}: it needs {need:,} bytes and {keep} has ")
    assert conversions == [1] and list(keep.iterdir()) == []


def test_a_disk_that_fills_while_writing_is_a_disk_space_error(tmp_path, tiny_q4, monkeypatch):
    """A file system that cannot reserve (so the writes find the disk full) fails the same way."""
    need = kept_size(tmp_path, tiny_q4)
    keep = tmp_path / "kept"
    pwrite = os.pwrite
    calls = []

    def filling(fd, data, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, length: None)
    monkeypatch.setattr(os, "pwrite", filling)
    with pytest.raises(DiskSpaceError) as info:
        load_gguf(tiny_q4, weights="auto", keep=keep)
    assert info.value.need_bytes == need and len(calls) == 4 and list(keep.iterdir()) == []


def _user_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _user_namespaces(), reason="needs unprivileged user namespaces to mount a small tmpfs")
def test_a_real_small_disk(tmp_path, tiny_q4):
    """The kept folder on a tmpfs with half the file's room, mounted in a user namespace."""
    need = kept_size(tmp_path, tiny_q4)
    keep = tmp_path / "kept"
    keep.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    script = f"mount -t tmpfs -o size={need // 2} tmpfs {keep} && {sys.executable} {worker} {tiny_q4} {keep} full"
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    name, need_bytes, free_bytes, listing, message = out.stdout.splitlines()
    kept = converted.cache_file(keep, tiny_q4, "auto")
    assert (name, int(need_bytes), listing) == ("DiskSpaceError", need, "[]")
    assert 0 < int(free_bytes) < need
    assert message == (f"not enough disk space for {kept}: it needs {need:,} bytes and {keep} has "
                       f"{int(free_bytes):,} free; free some space there, or set FLM_MODEL_PATH to a folder "
                       "on a larger disk")
    assert list(keep.iterdir()) == []  # and nothing on the real disk under the mount point
