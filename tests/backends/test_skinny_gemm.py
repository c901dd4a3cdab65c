"""The skinny product kernel and how the cpu backend routes products and BLAS threads to it."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import threadpoolctl

from flm_runtime.kernels import cpu
from flm_runtime.kernels import skinny_gemm


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


@pytest.mark.parametrize("rows", range(1, skinny_gemm.MAX_ROWS + 1))
def test_skinny_linear_equals_the_product_for_every_row_count(rows):
    # Shapes that leave remainders everywhere: rows not a multiple of 4 or 8, odd K and N.
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 577)).astype(np.float32)
    w = rng.standard_normal((331, 577)).astype(np.float32)
    got = skinny_gemm.skinny_linear(x, w)
    assert got.shape == (rows, 331) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, _reference(x, w), rtol=0, atol=2e-4)  # |entries| ~ 24


def test_skinny_linear_reads_a_strided_activation_and_propagates_nan():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64, 2)).astype(np.float32)[:, :, 1]  # not C-contiguous
    w = rng.standard_normal((10, 64)).astype(np.float32)
    np.testing.assert_allclose(skinny_gemm.skinny_linear(x, w), _reference(x, w), atol=1e-4)
    x[1, 5] = np.nan
    out = skinny_gemm.skinny_linear(x, w)
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("rows", [0, 1, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1, 40])
def test_linear_gives_the_product_on_both_sides_of_the_threshold(rows):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = rng.standard_normal((50, 96)).astype(np.float32)
    with cpu.forward_pass(1):
        got = cpu.linear(x, w)
    assert got.shape == (rows, 50)
    np.testing.assert_allclose(got, _reference(x, w), atol=1e-4)


def test_linear_runs_the_kernel_exactly_for_one_to_max_rows_of_a_skinny_pass(monkeypatch):
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    w = np.ones((4, 8), dtype=np.float32)

    def products(pass_rows: int) -> list[int]:
        calls.clear()
        with cpu.forward_pass(pass_rows):
            for rows in (0, 1, 5, skinny_gemm.MAX_ROWS, skinny_gemm.MAX_ROWS + 1):
                cpu.linear(np.ones((rows, 8), dtype=np.float32), w)
        return list(calls)

    assert products(2) == [1, 5, skinny_gemm.MAX_ROWS]
    assert products(1) == [1, 5, skinny_gemm.MAX_ROWS]
    # A prefill chunk's pass (its LM head on 1 row too), no pass at all: BLAS.
    assert products(skinny_gemm.MAX_ROWS + 1) == []
    calls.clear()
    cpu.linear(np.ones((1, 8), dtype=np.float32), w)
    assert calls == []
    monkeypatch.setattr(cpu, "SKINNY_ROWS", 0)  # what benchmarks use to time BLAS alone
    assert products(1) == []


def test_concurrent_callers_get_their_own_products():
    # numba's default thread pool aborts the process if two threads enter a parallel kernel at
    # once; the module lock must make this safe.
    rng = np.random.default_rng(7)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    xs = [rng.standard_normal((1 + t % skinny_gemm.MAX_ROWS, 256)).astype(np.float32) for t in range(4)]
    wrong = []

    def work(x):
        want = _reference(x, w)
        for _ in range(30):
            if not np.allclose(skinny_gemm.skinny_linear(x, w), want, atol=1e-3):
                wrong.append(x.shape)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def _blas_threads() -> int:
    (blas,) = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    return blas["num_threads"]


def test_forward_pass_limits_blas_only_for_skinny_passes_and_restores_it():
    before = _blas_threads()
    seen = []
    with cpu.forward_pass(skinny_gemm.MAX_ROWS):
        seen.append(_blas_threads())
    with cpu.forward_pass(skinny_gemm.MAX_ROWS + 1):
        seen.append(_blas_threads())
    with pytest.raises(ValueError), cpu.forward_pass(1):
        seen.append(_blas_threads())
        raise ValueError("a pass that fails")
    assert seen == [1, before, 1]
    assert _blas_threads() == before


def test_concurrent_skinny_passes_leave_blas_threads_as_they_were():
    before = _blas_threads()
    inside = []

    def work():
        for _ in range(50):
            with cpu.forward_pass(2):
                inside.append(_blas_threads())

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert inside == [1] * 150
    assert _blas_threads() == before


def test_another_librarys_brief_blas_limit_does_not_stick():
    # Another thread limits BLAS to 1 thread (as scikit-learn does) and a skinny pass enters while
    # that limit holds; the other thread restores its value first. The pass must not then restore
    # the 1 it found on entry.
    before = _blas_threads()
    if before == 1:
        pytest.skip("BLAS runs one thread here (OPENBLAS_NUM_THREADS=1 or one core)")
    other = threadpoolctl.threadpool_limits(limits=1, user_api="blas")
    skinny = cpu.forward_pass(1)
    skinny.__enter__()
    other.restore_original_limits()
    skinny.__exit__(None, None, None)
    assert _blas_threads() == before


def test_loading_a_model_compiles_the_kernel_before_any_request(smollm2_gguf):
    """A fresh process: the kernel has no compiled signature until ``load_model``, then it has one,
    so that a first request's decode time does not include numba's compilation."""
    script = ("from flm_runtime import api\n"
              "from flm_runtime.kernels import skinny_gemm\n"
              "before = len(skinny_gemm._skinny_matmul.signatures)\n"
              "api.load_model('smollm2:135m')\n"
              "print(before, len(skinny_gemm._skinny_matmul.signatures))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
