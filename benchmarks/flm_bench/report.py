"""What every benchmark report carries: the machine it ran on, the exact command, tables in
Markdown and CSV, and ``mean ± std`` formatting.

Speed depends on the machine: reports quote ratios measured in the same run (docs/design.md,
"Measuring speed"), and say what the machine was (CPU, cores, memory, BLAS and the OpenBLAS
kernel it chose, the ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` settings that slow a current
numpy, the load average).
"""

from __future__ import annotations

import csv
import ctypes
import datetime
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from flm_runtime.kernels.cpu_features import cpu_model

PROG = "litellm-flm"
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")


def machine_info() -> dict[str, str]:
    """A description of this machine and process, for reports (best effort: unknown -> "?")."""
    blas = (np.show_config(mode="dicts") or {}).get("Build Dependencies", {}).get("blas", {})
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu": cpu_model(),
        "logical CPUs": str(os.cpu_count()),
        "memory": _memory(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": f"{blas.get('name', '?')} {blas.get('version', '')}".strip(),
        "openblas kernel": _openblas_corename(),
        **{v: os.environ.get(v, "unset") for v in OPENBLAS_VARS},
        "load average (1, 5, 15 min) at start": ", ".join(f"{x:.2f}" for x in load),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def run_conditions() -> str:
    """One line for the end of a benchmark script's output: which of ``OPENBLAS_CORETYPE`` /
    ``OPENBLAS_L2_SIZE`` (older-CPU workarounds that slow a current numpy on this machine) the run
    had unset, and the load average at the end."""
    unset = [v for v in OPENBLAS_VARS[:2] if v not in os.environ]
    return (f"OPENBLAS_CORETYPE/L2_SIZE unset in this run: {', '.join(unset) or 'neither'}; "
            f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError):
        pass
    return "?"


def _openblas_corename() -> str:
    """The CPU kernel OpenBLAS picked (what ``OPENBLAS_CORETYPE`` forces), read from the library
    numpy loaded; "?" when that is not an OpenBLAS we can ask."""
    try:
        libs = {ln.split()[-1] for ln in Path("/proc/self/maps").read_text().splitlines() if "openblas" in ln}
        for path in sorted(libs):
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    return fn().decode()
    except OSError:
        pass
    return "?"


def machine_markdown(info: dict[str, str]) -> str:
    """The machine as a two-column Markdown table."""
    return markdown_table(["machine", ""], [[k, v] for k, v in info.items()])


def command_text(command: str, options: Iterable[tuple[str, object]]) -> str:
    """The command line that reproduces a run: every option spelled out with the value it had.

    Args:
        command: the subcommand and its fixed words (``"bench --quick"``).
        options: (``--flag``, value) pairs; True adds the bare flag, None and False are left out.
    """
    words = [PROG, *command.split()]
    for flag, value in options:
        if value is None or value is False:
            continue
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table (cells converted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, columns: Sequence[str], rows: Iterable[dict]) -> Path:
    """Write ``rows`` (dicts with exactly ``columns``) as CSV with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            assert set(row) == set(columns), f"row keys {sorted(row)} != columns {sorted(columns)}"
            writer.writerow(row)
    return path


def mean_std(values: Sequence[float], digits: int = 1) -> str:
    """``mean ± std`` (sample standard deviation; ± 0 for a single value)."""
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def output_dir(path: str | Path) -> Path:
    """``path`` created if needed."""
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_report(path: Path, title: str, command: str, sections: Iterable[str], info: dict[str, str]) -> Path:
    """A Markdown report: title, the command, the sections, then the machine."""
    parts = [f"# {title}", f"```\n{command}\n```", *sections, machine_markdown(info)]
    path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return path


def pyplot(prog: str):
    """``matplotlib.pyplot`` on the Agg backend (files, no screen), or None after telling ``prog``'s
    user on stderr that the plot is skipped: matplotlib is the optional ``bench`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{prog}: matplotlib is not installed, so no plot (pip install 'litellm-flm[bench]' adds it)",
              file=sys.stderr)
        return None
    return plt
