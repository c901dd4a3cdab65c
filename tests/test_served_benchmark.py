"""benchmarks/served.py's pure parts: arguments, the environment, medians and ratios, the table,
and the reuse of a built llama-server. Nothing here is timed, starts a server or loads a model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("served", Path(__file__).parents[1] / "benchmarks" / "served.py")
served = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("served", served)  # its dataclass looks its module up there
_SPEC.loader.exec_module(served)


def test_arguments_default_to_two_threads_three_rounds_and_8_and_32_streams():
    args = served.parse_args(["--llama-server", "/opt/llama-server"])
    assert (args.llama_server, args.build_llama_server, args.tag, args.threads, args.rounds) == (
        Path("/opt/llama-server"), None, "smollm2:135m", 2, 3)
    assert (args.max_tokens, args.streams, args.turns, args.document_tokens, args.turn_tokens) == (128, [8, 32], 4, 2000, 64)
    args = served.parse_args(["--build-llama-server", "/work/llama-build", "--streams", "4, 16", "--threads", "3"])
    assert (args.build_llama_server, args.streams, args.threads) == (Path("/work/llama-build"), [4, 16], 3)


def test_quick_replaces_the_sizes():
    args = served.parse_args(["--llama-server", "x", "--quick", "--rounds", "5"])
    assert {k: getattr(args, k) for k in served.QUICK} == served.QUICK


@pytest.mark.parametrize("argv", [[], ["--llama-server", "x", "--build-llama-server", "y"],
                                  ["--llama-server", "x", "--streams", "8,0"], ["--llama-server", "x", "--streams", ","],
                                  ["--llama-server", "x", "--threads", "0"], ["--llama-server", "x", "--turns", "7"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        served.parse_args(argv)
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_the_worker_needs_no_llama_server():
    assert served.parse_args(["--worker-chat", "--tag", "smollm2:135m"]).worker_chat


def test_the_environment_sets_both_thread_counts_and_unsets_the_openblas_workarounds_unless_kept():
    environ = {"PATH": "/bin", "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    env = served.wanted_env(served.parse_args(["--llama-server", "x", "--threads", "3"]), environ)
    assert env == {"PATH": "/bin", "FLM_THREADS": "3", "NUMBA_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3"}
    kept = served.wanted_env(served.parse_args(["--llama-server", "x", "--keep-openblas-env"]), environ)
    assert kept == environ | {"FLM_THREADS": "2", "NUMBA_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    assert environ["OPENBLAS_CORETYPE"] == "Haswell"  # the caller's mapping is not changed


def _values():
    # Three rounds, one stream count (8), two chat turns.
    return {
        served.FLM: {"decode": [40.0, 50.0, 45.0], "bound": [0.4, 0.5, 0.45], "ttft": [0.2, 0.1, 0.3],
                     "streams_8": [150.0, 140.0, 160.0], "prefill": [1000.0, 900.0, 800.0],
                     "chat_1": [2.0, 2.2, 2.4], "chat_1_prompt": [2050, 2050, 2050],
                     "chat_2": [0.5, 0.6, 0.4], "chat_2_prompt": [2130, 2130, 2130]},
        served.NOCACHE: {"chat_1": [2.0, 2.2, 2.4], "chat_1_prompt": [2050, 2050, 2050],
                         "chat_2": [2.5, 2.0, 4.0], "chat_2_prompt": [2130, 2130, 2130]},
        served.LLAMA: {"decode": [80.0, 100.0, 90.0], "bound": [0.8, 0.9, 1.0], "ttft": [0.1, 0.1, 0.1],
                       "streams_8": [100.0, 200.0, 160.0], "prefill": [2000.0, 1800.0, 1600.0],
                       "chat_1": [1.0, 1.1, 1.2], "chat_1_prompt": [2049, 2049, 2049],
                       "chat_2": [0.25, 0.3, 0.2], "chat_2_prompt": [2125, 2125, 2125]},
        served.PROBE: {"bandwidth": [30e9, 34e9, 35e9]},
    }


def test_summary_takes_medians_over_rounds_and_ratios_within_each_round():
    keys = [key for key, _, _ in served.figures([8], 2)]
    assert keys == ["decode", "bound", "ttft", "streams_8", "chat_1", "chat_2", "prefill"]
    summary = served.summarize(_values(), keys)
    flm, off = summary[served.FLM], summary[served.NOCACHE]
    assert flm["decode"] == 45.0 and flm["ratio_decode"] == 0.5
    assert flm["ttft"] == 0.2 and flm["ratio_ttft"] == 2.0  # per round 2, 1, 3
    assert flm["streams_8"] == 150.0 and flm["ratio_streams_8"] == 1.0  # per round 1.5, 0.7, 1: not 150 / 160
    assert flm["chat_2_prompt"] == 2130 and summary[served.LLAMA]["chat_2_prompt"] == 2125
    assert off["ratio_chat_2"] == 10.0 and off["on_off_chat_2"] == 0.2  # per round 0.2, 0.3, 0.1
    assert "ratio_decode" not in off and "on_off_chat_1" in off
    assert flm["ratio_bound"] == 0.5 and flm["ratio_prefill"] == 0.5 and summary[served.PROBE] == {"bandwidth": 34e9}


def test_table_has_a_row_per_figure_the_cache_off_turns_their_on_off_ratios_and_the_cold_start():
    summary = served.summarize(_values(), [key for key, _, _ in served.figures([8], 2)])
    lines = served.format_table(summary, [8], 2, 2.345, {served.FLM: 1_350_000_000, served.LLAMA: 1_000_000_000}).splitlines()
    assert lines[:2] == ["| figure | flm | llama-server | ratio flm / llama-server |", "|---|---|---|---|"]
    assert lines[2:] == [
        "| 1 stream: decode tokens/s after the first token | 45.0 | 90.0 | 0.50x |",
        "| 1 stream: decode / the read-bandwidth bound | 0.45 | 0.90 | 0.50x |",
        "| 1 stream: TTFT s, short prompt | 0.200 | 0.100 | 2.00x |",
        "| 8 concurrent streams: aggregate tokens/s | 150.0 | 160.0 | 1.00x |",
        "| chat turn 1: TTFT s (prompt 2,050 / 2,049 tokens) | 2.200 | 1.100 | 2.00x |",
        "| chat turn 2: TTFT s (prompt 2,130 / 2,125 tokens) | 0.500 | 0.250 | 2.00x |",
        "| chat turn 1: prefill tokens/s (prompt tokens / TTFT) | 900 | 1,800 | 0.50x |",
        "| bytes per decode token, MB (flm: its weights as held; llama-server: the GGUF's tensors) | 1,350.0 | "
        "1,000.0 | 1.35x |",
        "| read bandwidth of this process, GB/s (the probe; bound = bandwidth / bytes per token) | 34.0 | – | – |",
        "| chat, FLM_PREFIX_CACHE=0, turn 1: TTFT s | 2.200 | 1.100 | 2.00x |",
        "| chat, FLM_PREFIX_CACHE=0, turn 2: TTFT s | 2.500 | 0.250 | 10.00x |",
        "| chat turn 1: TTFT, flm prefix cache on / off | 1.00x | – | – |",
        "| chat turn 2: TTFT, flm prefix cache on / off | 0.20x | – | – |",
        '| cold start s: a new `litellm-flm run ... "Hi"`, the second run | 2.35 | – | – |',
    ]


def test_an_existing_llama_server_build_is_reused_without_running_anything(tmp_path, monkeypatch):
    binary = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert served.build_llama_server(tmp_path) == binary


def test_llama_servers_bytes_per_token_leave_out_a_gathered_embedding_only():
    """smollm2's GGUF ties its embedding to the LM head (no ``output`` tensor): every tensor is read."""
    from gguf import GGUFReader

    from flm_runtime import pull

    gguf = pull.locate("smollm2:135m")
    assert served.gguf_bytes_per_token(gguf) == sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors) == 96_576_768


def test_cpu_seconds_counts_the_machine_and_the_processes_given():
    import os

    total, ours = served.cpu_seconds([os.getpid()])
    assert 0 < ours <= total
    assert served.cpu_seconds([])[1] == 0
