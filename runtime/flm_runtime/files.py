"""Files written whole or not at all, and the scratch space of a download.

``written_whole(target, size)`` gives a file to write ``target``'s bytes into; only when the block
ends without an error is it fsynced and renamed to ``target`` (atomic on one file system), so a
reader finds the old file or the whole new one, never part of one. On Linux the file being
written has no name at all (``O_TMPFILE``): a process killed while writing it, SIGKILL included,
leaves nothing behind, and the kernel frees its blocks. Elsewhere (another system, or a file
system without ``O_TMPFILE``) it is written under a temporary name,
``.<target>.<pid>.<random>.part``, never equal to a final name, which ``remove_stale`` deletes
once its process is gone.

The file's size is reserved before anything is written (``posix_fallocate``), so a disk without
that much room fails at once with ``DiskSpaceError`` (the file, the bytes needed, the bytes free)
rather than after minutes of work; a disk that fills while writing (a file system that cannot
reserve) fails with the same error. Either way nothing is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from flm_runtime.errors import DiskSpaceError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_O_TMPFILE = getattr(os, "O_TMPFILE", None)  # Linux only
_STALE_AFTER_S = 24 * 3600  # a temp whose owner cannot be checked (not POSIX) is stale after this
_TEMP_FILE_RE = re.compile(r"^\..+\.(\d+)\.[^.]+\.part$")  # ".<target>.<pid>.<random>.part"
_SCRATCH_RE = re.compile(r"^\.pull-(\d+)-")  # scratch_dir's TemporaryDirectory(prefix=".pull-<pid>-")


@contextlib.contextmanager
def written_whole(target: Path, size: int) -> Iterator[BinaryIO]:
    """A binary file, open for reading and writing, that becomes ``target`` when the block ends
    without an error: flushed, fsynced, made ``0o644`` and renamed over ``target`` (its folder then
    fsynced). When the block raises, nothing of it remains and ``target`` is as it was.

    Args:
        target: the final path; its folder must exist.
        size: the file's size in bytes, reserved before the block runs where the system can
            (``posix_fallocate``; the file is then that long from the start, zeros until written).

    Raises:
        DiskSpaceError: the folder's disk has no room for ``size`` bytes, or filled while the
            block wrote (``ENOSPC``, ``EDQUOT``).
        OSError: anything else the file system refused.
    """
    directory = target.parent
    named = None
    try:
        fd, named = _unnamed_file(directory, target.name)
        with os.fdopen(fd, "w+b") as f:
            if size and hasattr(os, "posix_fallocate"):  # macOS and Windows have none
                os.posix_fallocate(f.fileno(), 0, size)
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before a name makes it visible
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600; the file is no secret
            _publish(f.fileno(), named, target)
    except OSError as e:
        if e.errno not in _FULL:
            raise
        raise DiskSpaceError(target, need_bytes=size, free_bytes=shutil.disk_usage(directory).free) from e
    finally:
        if named is not None:  # gone once renamed; else never left behind
            with contextlib.suppress(OSError):
                named.unlink()


def _unnamed_file(directory: Path, name: str) -> tuple[int, Path | None]:
    """A new file in ``directory``, open for reading and writing: unnamed (``O_TMPFILE``) where the
    system and the file system can, else named ``_temp_name``; (its descriptor, its name or None)."""
    if _O_TMPFILE is not None:
        try:
            return os.open(directory, _O_TMPFILE | os.O_RDWR, 0o600), None
        except OSError as e:  # EOPNOTSUPP, EISDIR, EINVAL: this file system cannot
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, path = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".part", dir=directory)
    return fd, Path(path)


def _publish(fd: int, named: Path | None, target: Path) -> None:
    """Rename the file of ``fd`` over ``target``; an unnamed one is first linked under a temporary
    name beside it (``linkat`` through ``/proc/self/fd``, which needs no privilege)."""
    directory = target.parent
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        if named is None:
            named = directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.part"
            # dst_dir_fd makes os.link call linkat with AT_SYMLINK_FOLLOW, which links the file itself
            os.link(f"/proc/self/fd/{fd}", named.name, dst_dir_fd=dir_fd)
        os.replace(named, target)
        os.fsync(dir_fd)  # the rename is on disk too
    finally:
        os.close(dir_fd)


def scratch_dir(directory: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder in ``directory`` (same file system, no tmpfs limit) for a download's
    pieces, removed when its ``with`` block ends; one left by a killed process goes at the next
    ``remove_stale``."""
    return tempfile.TemporaryDirectory(prefix=f".pull-{os.getpid()}-", dir=directory)


def _owner_gone(pid: int, age_s: float) -> bool:
    """True when process ``pid``, which made a temp ``age_s`` seconds old, is gone."""
    if pid == os.getpid():
        return False
    if os.name != "posix":  # os.kill(pid, 0) is no probe on Windows
        return age_s > _STALE_AFTER_S
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary files (``written_whole``'s named ones) and scratch folders
    (``scratch_dir``) that processes now gone left in ``directory``; return what was removed.

    They are never mistaken for a final file (their names never equal one): this only frees the
    space. A folder that cannot be listed removes nothing.
    """
    removed = []
    now = time.time()
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = (_SCRATCH_RE if p.is_dir() else _TEMP_FILE_RE).match(p.name)
        try:
            if m is None or not _owner_gone(int(m.group(1)), now - p.stat().st_mtime):
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed
