"""The kernel thread team (``kernels/team.py``): every thread runs each step, barriers order the
threads' writes, a worker's failure reaches the caller without leaving anyone waiting, and steps
launched from any thread run alike."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from flm_runtime.kernels.team import StepError, Team, barrier


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
