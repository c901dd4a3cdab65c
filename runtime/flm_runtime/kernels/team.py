"""The kernel thread team: the threads that run a compiled step, one fork and one join per step.

A step (``layers.stack``: a target's or a DFlash draft's layers) is one compiled function ``fn(tid,
n_threads, sync, *args)`` that every thread of the team runs at once, each doing its share of
every layer (its tiles of each matrix product, its rows of each norm, its heads of attention) and
meeting the others at a ``barrier`` wherever one op needs another's whole output; a quantized
product outside a step (``qgemm.qlinear``) is a step of its own. This is how llama.cpp's ggml
threads work, and why: numba's ``parallel=True`` regions fork and join once per region (dozens
per token), and launched from any thread but the process's first one (the engine's, a server's)
the OpenMP layer paid ~75 us per region on our 2-core hosts, against ~2 us from the main thread,
so served decoding ran at a third of the kernels' speed. One team for all the compiled quantized
work also keeps a second pool of threads from spinning on the team's cores (numba's OpenMP
workers spin after each region): only the float32 reference runs numba's parallel kernels.

``Team(n)`` starts ``n - 1`` worker threads; the thread that calls ``run`` is thread 0, so a step
launched from any thread costs the same. Between steps the workers spin on the step counter for
``SPIN_CYCLES`` (a served decode's next step comes within a millisecond), then sleep on a
condition until the next ``run`` wakes them.

Synchronization is on one int64 array, ``sync`` (its slots below, each on a cache line of its
own): ``atomic_add``, ``atomic_load`` and ``atomic_store`` are sequentially consistent LLVM
atomics (``lock xadd`` and plain moves on x86), so a thread past a ``barrier`` sees every write
the others made before it. A worker whose step raised sets ``ABORT``; every ``barrier`` then
returns at once and ``run`` raises, so a failed step never leaves the caller spinning.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from flm_runtime.kernels.irgen import I8, I32, I64, data_ptr, declare
from flm_runtime.kernels.lock import KERNEL_LOCK
from flm_runtime.settings import Settings

log = logging.getLogger(__name__)

_LINE = 8  # int64 slots per cache line: each sync slot on its own line, so spinning threads share none
STEP, ARRIVED, BARRIER, SLEEPERS, ABORT = (i * _LINE for i in range(5))  # slots of ``sync``
SPIN_PAUSES = 4_000  # pauses a barrier spins before it sleeps: ~0.2-0.5 ms, far past a step's imbalance
SPIN_CYCLES = 4_000_000  # a worker's spin between steps before it sleeps: ~1-2 ms of the time-stamp counter


def _int64_array(t) -> None:
    if not (isinstance(t, types.Array) and t.dtype == types.int64 and t.ndim == 1 and t.layout == "C"):
        raise numba.core.errors.TypingError(f"sync must be a 1-D C-contiguous int64 array, got {t}")


def _slot(context, builder, array_type, array, index):
    return builder.gep(data_ptr(context, builder, array_type, array, I64), [index])


@intrinsic
def atomic_add(typingctx, array, index, value):  # pragma: no cover - compiled
    """``array[index] += value`` atomically; returns the value before."""
    _int64_array(array)
    sig = types.int64(array, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _slot(context, builder, signature.args[0], args[0], args[1]), args[2],
                                  "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, array, index):  # pragma: no cover - compiled
    """``array[index]``, read atomically (never hoisted out of a loop)."""
    _int64_array(array)
    sig = types.int64(array, types.intp)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, array, index, value):  # pragma: no cover - compiled
    """``array[index] = value``, written atomically."""
    _int64_array(array)
    sig = types.void(array, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _slot(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


_MACHINE = platform.machine().lower()
_X86 = _MACHINE in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def spin_pause(typingctx):  # pragma: no cover - compiled
    """A spin-wait hint (x86 ``pause``: the spinning core yields to its sibling and leaves the
    loop without a memory-order flush); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            builder.call(declare(builder, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cycles(typingctx):  # pragma: no cover - compiled
    """The CPU's cycle counter (``llvm.readcyclecounter``: the time-stamp counter on x86)."""

    def codegen(context, builder, signature, args):
        return builder.call(declare(builder, "llvm.readcyclecounter", I64, []), [])

    return types.int64(), codegen


# Linux futexes (futex(2)) on the low 32 bits of a sync slot: a barrier that has spun long
# enough sleeps in the kernel until the last thread arrives, so that on a busy machine it gives
# its CPU to the thread it waits for. Elsewhere the wait yields the CPU instead.
_FUTEX = platform.system() == "Linux" and _MACHINE in ("x86_64", "amd64", "aarch64", "arm64")
_SYS_FUTEX = 98 if _MACHINE in ("aarch64", "arm64") else 202
_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 128, 129


@intrinsic
def _futex(typingctx, array, index, op, value):  # pragma: no cover - compiled
    """``futex(&array[index], op, value, NULL)`` (the slot's low 32 bits, little-endian), or
    ``sched_yield()`` where there are no futexes."""
    _int64_array(array)
    sig = types.void(array, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        if _FUTEX:
            syscall = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64], var_arg=True),
                                                     "syscall")
            word = builder.bitcast(_slot(context, builder, signature.args[0], args[0], args[1]), I32.as_pointer())
            builder.call(syscall, [ir.Constant(I64, _SYS_FUTEX), word, builder.trunc(args[2], I32),
                                   builder.trunc(args[3], I32), ir.Constant(I8.as_pointer(), None)])
        else:
            builder.call(declare(builder, "sched_yield", I32, []), [])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def barrier(sync, n_threads):  # pragma: no cover - compiled
    """Wait until all ``n_threads`` threads have arrived (a counter and a generation: the last to
    arrive resets the counter, then moves the generation on, which releases the others); returns
    at once once ``ABORT`` is set. A wait past ``SPIN_PAUSES`` sleeps on the generation's futex
    (the last to arrive wakes the sleepers): on a busy machine the thread it waits for may be
    waiting for this CPU."""
    if n_threads == 1:
        return
    generation = atomic_load(sync, BARRIER)
    if atomic_add(sync, ARRIVED, 1) == n_threads - 1:
        atomic_store(sync, ARRIVED, 0)
        atomic_add(sync, BARRIER, 1)
        if atomic_load(sync, SLEEPERS) > 0:
            _futex(sync, BARRIER, _FUTEX_WAKE_PRIVATE, n_threads)
        return
    spins = 0
    while atomic_load(sync, BARRIER) == generation and atomic_load(sync, ABORT) == 0:
        if spins < SPIN_PAUSES:
            spin_pause()
            spins += 1
        else:
            atomic_add(sync, SLEEPERS, 1)  # before the check inside futex: a release after it wakes us
            _futex(sync, BARRIER, _FUTEX_WAIT_PRIVATE, generation)
            atomic_add(sync, SLEEPERS, -1)


@numba.njit(nogil=True, cache=True)
def _wake_all(sync):  # pragma: no cover - compiled
    """Wake every thread asleep in a ``barrier`` (after ``ABORT`` is set)."""
    atomic_add(sync, BARRIER, 1)
    _futex(sync, BARRIER, _FUTEX_WAKE_PRIVATE, 1 << 30)


@numba.njit(nogil=True, cache=True)
def _await_step(sync, seen, budget):  # pragma: no cover - compiled
    """Spin until ``sync[STEP]`` differs from ``seen`` or ``budget`` cycles have passed; True
    when it changed."""
    start = cycles()
    while atomic_load(sync, STEP) == seen:
        if cycles() - start > budget:
            return False
        for _ in range(16):
            spin_pause()
    return True


def default_threads() -> int:
    """The team's size when ``FLM_THREADS`` is unset: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.cache
def default_team() -> Team:
    """The process's one team, of ``FLM_THREADS`` threads (default and most ``default_threads``): every
    model's steps share it, one step at a time, so that two engines never oversubscribe the
    CPUs. A forked child makes its own (the parent's threads do not exist there).

    Raises:
        InvalidRequestError: ``FLM_THREADS`` is not a positive integer.
    """
    wanted, cpus = Settings.from_env().positive("threads"), default_threads()
    if wanted is not None and wanted > cpus:
        # More threads than CPUs wait at every barrier for a thread that has no CPU: 5-13x slower.
        log.warning("FLM_THREADS=%d is more than the %d CPUs this process may use; using %d", wanted, cpus, cpus)
    return Team(min(wanted or cpus, cpus))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=default_team.cache_clear)


class StepError(RuntimeError):
    """A worker thread's share of a step raised; the step's outputs are not valid."""


class Team:
    """``n_threads`` threads that run compiled steps together (module docstring).

    Args:
        n_threads: threads in the team, the caller of ``run`` included (>= 1).
    """

    def __init__(self, n_threads: int):
        assert n_threads >= 1, f"a team needs a thread, got {n_threads}"
        self.n_threads = n_threads
        self.sync = np.zeros(5 * _LINE, dtype=np.int64)
        self._job = None
        self._error: BaseException | None = None
        self._finished = [0] * (n_threads - 1)  # per worker, the last step it has left
        self._wake = threading.Condition()
        self._stopping = False
        self._lock = KERNEL_LOCK  # one step at a time, and never beside another parallel kernel
        self._workers = [threading.Thread(target=self._serve, args=(tid,), name=f"flm-kernel-{tid}", daemon=True)
                         for tid in range(1, n_threads)]
        for w in self._workers:
            w.start()

    def run(self, fn, *args) -> None:
        """``fn(tid, n_threads, sync, *args)`` on every thread of the team, this one as thread 0;
        returns when all have finished. ``fn`` is a compiled function (nogil) whose last act is
        a ``barrier``. Steps of concurrent callers run one after the other.

        Raises:
            StepError: a worker's share raised (the original exception is its cause).
        """
        with self._lock:
            self._job, self._error = (fn, args), None
            with self._wake:
                self.sync[STEP] += 1
                step = int(self.sync[STEP])
                self._wake.notify_all()
            try:
                fn(0, self.n_threads, self.sync, *args)
            except BaseException:
                self._abort()
                self._settle(step)
                raise
            if self._error is not None:
                self._settle(step)
                raise StepError("a kernel thread failed during the step") from self._error

    def close(self) -> None:
        """Stop the workers (they exit after the step in progress)."""
        with self._wake:
            self._stopping = True
            self.sync[STEP] += 1
            self._wake.notify_all()
        for w in self._workers:
            w.join()

    def _serve(self, tid: int) -> None:
        seen = 0
        while True:
            if not _await_step(self.sync, seen, SPIN_CYCLES):
                with self._wake:
                    self._wake.wait_for(lambda: self.sync[STEP] != seen)
            seen = int(self.sync[STEP])
            if self._stopping:
                return
            fn, args = self._job
            try:
                fn(tid, self.n_threads, self.sync, *args)
            except BaseException as e:  # noqa: BLE001 - reported to the caller of run
                self._error = e
                self._abort()
            self._finished[tid - 1] = seen
            if self.sync[ABORT]:
                with self._wake:
                    self._wake.notify_all()

    def _abort(self) -> None:
        """Release every thread waiting in a barrier of the step in progress (the barriers of an
        aborted step return at once)."""
        self.sync[ABORT] = 1
        _wake_all(self.sync)

    def _settle(self, step: int) -> None:
        """After an aborted step: wait until every worker has left it, then clear the barrier's
        count (threads left barriers half counted) and the abort."""
        with self._wake:
            self._wake.wait_for(lambda: min(self._finished, default=step) >= step)
        self.sync[ARRIVED] = 0
        self.sync[ABORT] = 0
