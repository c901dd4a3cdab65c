"""Compiled functions cached on disk under a key of our own: the one-call stack's step
(``layers.stack``) is a closure, and numba's own cache key pickles a closure's free variables
(numba dispatchers, which pickle differently in every process), so it would compile at every load
(seconds); and numba's own cache is stale when a module it inlined from changes (it checks the
defining file's time alone). The key names what the free variables are instead, plus the compile
options and the sources they were compiled from. This relies on numba's private
``dispatcher._cache`` (numba is pinned).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numba
from numba.core.caching import FunctionCache


class _KeyedCache(FunctionCache):
    """numba's on-disk cache of a function, keyed by its bytecode and ``key`` (module docstring)."""

    def __init__(self, py_func, key: str):
        super().__init__(py_func)
        self._key = key

    def _index_key(self, sig, codegen):
        digest = hashlib.sha256(self._py_func.__code__.co_code + self._key.encode()).hexdigest()
        return sig, codegen.magic_tuple(), digest


def compiled(fn, key: str, **options):
    """``fn`` compiled by numba with ``options``, cached on disk under ``key`` and the options."""
    dispatcher = numba.njit(**options)(fn)
    dispatcher._cache = _KeyedCache(fn, f"{key} {sorted(options.items())}")  # what njit(cache=True) sets
    return dispatcher


@functools.cache
def sources_key(*folders: Path) -> str:
    """A digest of the kernels' sources and of the ``*.py`` files of ``folders`` (those of the
    code compiled with them), for a key: a function cached from other kernels, or from another
    version of its own module, is not loaded. Contents, not times: a checkout or a new worktree of
    the same code loads what is cached."""
    digest = hashlib.sha256()
    for folder in (Path(__file__).parent, *folders):
        for f in sorted(folder.glob("*.py")):
            digest.update(f"{f.parent.name}/{f.name}\0".encode() + f.read_bytes())
    return digest.hexdigest()
