"""benchmarks/peers.py's pure parts: arguments, figures and ratios, the table, and the exit without
llama-cpp-python. Nothing here is timed and nothing loads a model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("peers", Path(__file__).parents[1] / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peers)

OURS = "ours auto (default)"


def test_arguments_default_to_two_threads_and_the_default_weights_then_q8():
    args = peers.parse_args([])
    assert (args.threads, args.weights, args.tag, args.json, args.keep_openblas_env) == (2, ["auto", "q8"], "smollm2:135m", None, False)
    args = peers.parse_args(["--threads", "4", "--weights", " Q8, f32 ,auto", "--json", "out.json", "--rounds", "3"])
    assert (args.threads, args.weights, args.json, args.rounds) == (4, ["q8", "f32", "auto"], Path("out.json"), 3)


@pytest.mark.parametrize("argv", [["--weights", "q5"], ["--weights", "q8,q8"], ["--weights", ","],
                                  ["--threads", "0"], ["--rounds", "-1"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.parse_args(argv)
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_the_environment_sets_every_thread_count_and_unsets_the_openblas_workarounds_unless_kept():
    environ = {"PATH": "/bin", "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    env = peers._wanted_env(peers.parse_args(["--threads", "3"]), environ)
    # FLM_THREADS: our steps run on the kernel team, not on numba's threads.
    assert env == {"PATH": "/bin", "FLM_THREADS": "3", "NUMBA_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    kept = peers._wanted_env(peers.parse_args(["--keep-openblas-env"]), environ)
    assert kept == environ | {"FLM_THREADS": "2", "NUMBA_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    assert environ["OPENBLAS_CORETYPE"] == "Haswell"  # the caller's mapping is not changed


def _times():
    # Three rounds of seconds: llama.cpp decodes in 20 ms at 256, ours in 10, 5 and 8 ms.
    return {
        peers.LLAMA: {"decode_256": [0.020, 0.020, 0.040], "decode_4096": [0.050, 0.050, 0.050],
                      "pass": [0.060, 0.060, 0.120], "prefill": [2.0, 2.0, 4.0]},
        OURS: {"decode_256": [0.010, 0.005, 0.008], "decode_4096": [0.025, 0.100, 0.050],
               "pass": [0.012, 0.006, 0.016], "prefill": [1.0, 0.5, 2.0]},
    }


# Per round the probe read 10, 20 and 10 GB/s; llama.cpp streams 100 MB a decode step, we 200 MB.
BANDWIDTH = [10e9, 20e9, 10e9]
NBYTES = {peers.LLAMA: 100e6, OURS: 200e6, "ours q8": 100e6}


def test_summary_takes_medians_over_rounds_and_ratios_within_each_round():
    summary = peers.summarize(_times(), BANDWIDTH, NBYTES)
    assert summary[peers.LLAMA] == pytest.approx(
        {"decode_256": 50.0, "decode_4096": 20.0, "pass_cost": 3.0, "prefill": 256.0, "bound": 0.25})  # 50, 50, 25 of 100, 200, 100 tokens/s
    ours = summary[OURS]
    assert ours["decode_256"] == 125.0  # median of 100, 200, 125 tokens/s
    assert ours["ratio_decode_256"] == 4.0  # per round 2, 4, 5: the median ratio, not 125 / 50
    assert ours["decode_4096"] == 20.0 and ours["ratio_decode_4096"] == 1.0
    assert ours["pass_cost"] == pytest.approx(1.2) and ours["ratio_pass_cost"] == pytest.approx(0.4)  # 1.2, 1.2, 2 decodes
    assert ours["prefill"] == 512.0 and ours["ratio_prefill"] == 2.0
    assert ours["bound"] == pytest.approx(2.0) and "ratio_bound" not in ours  # 100, 200, 125 of 50, 100, 50 tokens/s


def test_table_has_one_row_per_figure_and_a_ratio_column_per_weight_kind():
    times = _times() | {"ours q8": _times()[peers.LLAMA]}
    lines = peers.format_table(peers.summarize(times, BANDWIDTH, NBYTES)).splitlines()
    assert lines[0] == f"| figure | llama.cpp | {OURS} | ratio | ours q8 | ratio |"
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2:] == [
        "| decode tokens/s, context 256 | 50.0 | 125.0 | 4.00x | 50.0 | 1.00x |",
        "| decode tokens/s, context 4,096 | 20.0 | 20.0 | 1.00x | 20.0 | 1.00x |",
        "| 8-token pass at context 256, in decodes | 3.00 | 1.20 | 0.40x | 3.00 | 1.00x |",
        "| prefill tokens/s, 512 tokens | 256.0 | 512.0 | 2.00x | 256.0 | 1.00x |",
        "| decode at context 256 / bandwidth bound | 0.25 | 2.00 | - | 0.25 | - |",
    ]


def test_without_llama_cpp_it_says_how_to_install_it_and_exits_0(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec then finds nothing
    monkeypatch.setattr(peers, "run", lambda args: pytest.fail("measured without llama.cpp"))
    assert peers.main(["--weights", "q8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-cpp-python is not installed")
    assert "pip install -e '.[peers]' --no-binary llama-cpp-python" in out and "-mno-amx-tile" in out
