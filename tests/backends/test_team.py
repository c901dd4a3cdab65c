"""The kernel thread team (``kernels/team.py``): every thread runs each step, barriers order the
threads' writes, a worker's failure reaches the caller without leaving anyone waiting, and steps
launched from any thread run alike; ``on_calling_thread`` gives the caller's numba thread count back
whatever happens inside, on any thread."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from flm_runtime.kernels.team import StepError, Team, barrier, on_calling_thread


@numba.njit(nogil=True)
def _rounds(tid, n_threads, sync, seen, rounds):
    """Each round every thread writes its slot, then (past a barrier) reads every slot: a thread
    that passed a barrier early would see a stale value."""
    for r in range(rounds):
        seen[0, tid] = r
        barrier(sync, n_threads)
        for other in range(n_threads):
            if seen[0, other] != r:
                seen[1, tid] += 1  # a stale read
        barrier(sync, n_threads)


@numba.njit(nogil=True)
def _fails_on_worker(tid, n_threads, sync, where):
    if tid == where[0]:
        raise ValueError("worker fails")
    barrier(sync, n_threads)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_barriers_order_every_threads_writes(threads):
    team = Team(threads)
    try:
        seen = np.zeros((2, threads), dtype=np.int64)
        team.run(_rounds, seen, 2000)
        assert seen[0].tolist() == [1999] * threads and seen[1].tolist() == [0] * threads
    finally:
        team.close()


def test_a_step_runs_the_same_from_any_thread():
    team = Team(2)
    try:
        results = []

        def step():
            seen = np.zeros((2, 2), dtype=np.int64)
            team.run(_rounds, seen, 100)
            results.append(seen.copy())

        callers = [threading.Thread(target=step) for _ in range(3)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
        assert len(results) == 3 and all(r[0].tolist() == [99, 99] and r[1].tolist() == [0, 0] for r in results)
    finally:
        team.close()


def test_a_worker_that_raises_fails_the_step_and_the_team_goes_on():
    team = Team(2)
    try:
        with pytest.raises(StepError) as failure:
            team.run(_fails_on_worker, np.array([1]))
        assert isinstance(failure.value.__cause__, ValueError)
        seen = np.zeros((2, 2), dtype=np.int64)
        team.run(_rounds, seen, 10)  # the next step runs whole
        assert seen[0].tolist() == [9, 9] and seen[1].tolist() == [0, 0]
    finally:
        team.close()


def test_close_stops_the_workers():
    team = Team(3)
    team.run(_rounds, np.zeros((2, 3), dtype=np.int64), 1)
    team.close()
    assert not any(w.is_alive() for w in team._workers)


def test_on_calling_thread_gives_the_count_back_after_a_raise_on_any_thread():
    """The count is numba's per thread: a thread that never set one has numba's default, and a
    draft pass that raises (inside) must not leave the engine's thread at one."""
    seen = {}

    def probe(name):
        before = numba.get_num_threads()
        with pytest.raises(ValueError), on_calling_thread():
            seen[name, "inside"] = numba.get_num_threads()
            raise ValueError("a pass fails")
        seen[name, "after"] = (before, numba.get_num_threads())

    main = numba.get_num_threads()  # numba's default, unless an earlier test set another
    probe("main")
    engine = threading.Thread(target=probe, args=("engine",))
    engine.start()
    engine.join()
    n = numba.config.NUMBA_NUM_THREADS
    assert seen == {("main", "inside"): 1, ("main", "after"): (main, main), ("engine", "inside"): 1,
                    ("engine", "after"): (n, n)}
