"""The host CPU's features, read once (LLVM's own view of the CPU, which is what numba compiles
for): the kernels choose their instruction sets (``qgemm``) and their register blocking
(``attention``) from them."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import llvmlite.binding as llvm


@functools.cache
def host_features() -> frozenset[str]:
    """The names of the features the host CPU has (``avx2``, ``avx512f``, ``avxvnni``, ...)."""
    return frozenset(name for name, present in llvm.get_host_cpu_features().items() if present)


def has(*features: str) -> bool:
    """Whether the host has every one of ``features``."""
    return host_features().issuperset(features)


def vector_registers() -> int:
    """How many float vector registers the host's compiled code has: 32 of 16 lanes with
    AVX-512, else 16 (AVX2's, of 8 lanes). Kernels that keep accumulators in registers size
    their blocks by it; spilling them to the stack costs several times their arithmetic."""
    return 32 if has("avx512f") else 16


@functools.cache
def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere; "?" when
    neither says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
