"""A pull in a process of its own, stopped at a chosen point until the test kills or frees it
(tests/test_pull_faults.py).

    python tests/pull_worker.py ENTRY_JSON LINKS SYNC STOP [--named] [--no-lock]

ENTRY_JSON: the ``ModelEntry`` to pull; LINKS: a folder of its wheels (real pip, ``--no-index
--find-links``); SYNC: a folder where the worker writes ``stopped`` when it reaches STOP and then
waits for a file ``go``; it writes ``downloads`` (the requirements it fetched, a line each) as it
goes. STOP: ``none``, ``download<i>`` (before the wheel of part ``i`` is fetched), ``extract``
(after the first chunk of the file is written) or ``publish`` (the file written, hashed and
fsynced, not yet renamed). ``--named``: write under a temporary name (as where ``O_TMPFILE`` is
missing); ``--no-lock``: no ``flock`` (as where ``fcntl`` is missing).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

from flm_runtime import files, pull as pull_mod
from flm_runtime.registry import ModelEntry


def main(entry_json: str, links: str, sync: str, stop: str, *flags: str) -> None:
    sync_dir = Path(sync)

    def wait_here() -> None:
        (sync_dir / "stopped").write_text(str(os.getpid()))
        while not (sync_dir / "go").exists():
            time.sleep(0.02)

    fetch = functools.partial(pull_mod.pip_download, extra_args=["--no-index", "--find-links", links])

    def download(requirement: str, dest: Path) -> Path:
        if stop == f"download{len(fetched())}":
            wait_here()
        with open(sync_dir / "downloads", "a") as f:
            f.write(requirement + "\n")
        return fetch(requirement, dest)

    def fetched() -> list[str]:
        path = sync_dir / "downloads"
        return path.read_text().splitlines() if path.exists() else []

    if stop == "extract":
        class Bar(pull_mod.tqdm):
            def update(self, n=1):
                super().update(n)
                wait_here()

        pull_mod.tqdm = Bar
    if stop == "publish":
        publish = files._publish

        def stopped_publish(*args):
            wait_here()
            publish(*args)

        files._publish = stopped_publish
    if "--named" in flags:
        files._O_TMPFILE = None
    if "--no-lock" in flags:
        pull_mod.fcntl = None
    path = pull_mod.pull(ModelEntry.model_validate_json(entry_json), progress=True, download=download)
    print(path)


if __name__ == "__main__":
    main(*sys.argv[1:])
