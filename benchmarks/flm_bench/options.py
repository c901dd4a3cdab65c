"""Command-line options of ``litellm-flm bench`` (and ``bench --quick``, ``bench --workloads``) and
the argument types the benchmark commands and scripts share.

Kept apart from the commands themselves (and free of heavy imports) so that building the
``litellm-flm`` parser loads no model code; ``flm_runtime.cli`` registers the commands.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from flm_bench.llama_server import SPEC_CONFIGS
from flm_runtime.errors import InvalidRequestError

DEFAULT_TAG = "smollm2:135m"


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


OPENBLAS_WORKAROUNDS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # older-CPU settings that slow a current OpenBLAS


def thread_env(environ, threads: int, keep_openblas_env: bool) -> dict[str, str]:
    """A copy of ``environ`` in which our kernel team (``FLM_THREADS``), numba and OpenBLAS each run
    ``threads`` threads and, unless ``keep_openblas_env``, ``OPENBLAS_WORKAROUNDS`` are unset.

    For the scripts that compare us with llama.cpp on one thread count: they re-execute themselves
    with it, since numba and numpy read their counts when they load."""
    env = dict(environ) | {name: str(threads) for name in ("FLM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    if not keep_openblas_env:
        for name in OPENBLAS_WORKAROUNDS:
            env.pop(name, None)
    return env


def cost_curve(text: str) -> list[float]:
    """An ``argparse`` type: comma-separated verify costs in decode steps, each finite, at least 1 and
    none below the one before (``1.16,1.27,1.38``: passes of 2, 3, 4 rows)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not all(math.isfinite(v) and v >= 1.0 for v in values) or values != sorted(values):
        raise argparse.ArgumentTypeError(f"each cost must be a finite number of at least 1 and none below the one "
                                         f"before, got {text!r}")
    return values


MODES = ("greedy", "sampled")


def parse_modes(text: str) -> list[str]:
    """``--modes``: comma-separated ``greedy`` and/or ``sampled``.

    Raises:
        InvalidRequestError: another word, or none.
    """
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise InvalidRequestError(f"--modes takes greedy and/or sampled, got {text!r}", param="--modes")
    return modes


# Defaults that differ between the decode-speed table and ``--quick``.
SPEED_CONTEXTS, SPEED_MAX_TOKENS = "short,1k,4k,max", 512
QUICK_CONTEXTS, QUICK_MAX_TOKENS = "1k,2k,4k,8k", 32
WORKLOAD_MAX_TOKENS, WORKLOAD_REQUESTS = 192, 2


def _common(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--tag", default=DEFAULT_TAG, help="the plain model tag (the baseline); its DFlash tag is "
                                                       f"family-dflash:size (default {DEFAULT_TAG})")
    p.add_argument("--documents", metavar="DIR", help="*.txt documents for the long prompts "
                                                      "(default: the public-domain texts shipped in the package)")
    p.add_argument("--out", default=out, metavar="DIR", help=f"where the files go (default ./{out})")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def bench_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "flm-bench")
    p.add_argument("--quick", action="store_true",
                   help="the short table instead: TTFT, prefill and decode tokens/s per context length, "
                        "about 30 decoded tokens, mean ± std over --iterations")
    p.add_argument("--workloads", nargs="?", const="all", metavar="NAMES",
                   help="the workload table instead, through LiteLLM: all (the default) or some of chat, multi-turn, "
                        "code-edit, search-replace, rag, agent, extraction, comma-separated (with --llama-server or "
                        "--spec-off also prediction and fim)")
    p.add_argument("--llama-server", type=Path, metavar="PATH",
                   help="--workloads: the tag against llama-server (this binary) on the same GGUF, through LiteLLM, "
                        "once per --llama-configs entry; all (the default) is then chat, code-edit, search-replace, "
                        "prediction, fim, agent")
    p.add_argument("--llama-configs", default=",".join(SPEC_CONFIGS), metavar="NAMES",
                   help=f"--llama-server: its speculation settings to run, some of {', '.join(SPEC_CONFIGS)} "
                        "(default all; the best is compared)")
    p.add_argument("--spec-off", action="store_true",
                   help="--workloads: also run the tag with FLM_SPECULATION=0 (a process of its own), with or without "
                        "--llama-server, and count identical greedy answers")
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="--llama-server or --spec-off: threads of every engine (llama-server's -t/-tb, FLM_THREADS; "
                        "default: FLM_THREADS, else the CPUs this process may use)")
    p.add_argument("--requests", type=positive_int, default=WORKLOAD_REQUESTS,
                   help=f"--workloads: tasks (requests or conversations) per workload (default {WORKLOAD_REQUESTS})")
    p.add_argument("--ceiling-curve", type=cost_curve, metavar="R2,R3,...",
                   help="--workloads: price the copy ceiling on these verify costs (passes of 2, 3, ... rows, in "
                        "decode steps; another host's) instead of this host's measured curve")
    p.add_argument("--ceiling-min-run", type=positive_int, default=1, metavar="N",
                   help="--workloads: the copy ceiling copies runs of at least N tokens only (default 1)")
    p.add_argument("--draft", metavar="DIR", help="decode the DFlash side with this draft directory "
                                                  "(default: the DFlash tag's own draft)")
    p.add_argument("--baseline-only", action="store_true",
                   help="measure the plain tag alone (no draft needed; the DFlash columns stay empty)")
    p.add_argument("--no-ngram", action="store_true",
                   help="the DFlash side verifies the draft's proposals alone, without prompt lookup (the "
                        "n-gram proposer), to compare its AL with the default's")
    p.add_argument("--contexts", help=f"comma-separated prompt lengths: short (~30 tokens), N, Nk (N x 1024) "
                                      f"or max (default {SPEED_CONTEXTS}; --quick: {QUICK_CONTEXTS})")
    p.add_argument("--max-tokens", type=int,
                   help=f"generated tokens per request (default {SPEED_MAX_TOKENS}; --quick: {QUICK_MAX_TOKENS}; "
                        f"--workloads: {WORKLOAD_MAX_TOKENS}, at most)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the end-of-turn token (default: generate exactly --max-tokens, as the reference benchmark's runs)")
    p.add_argument("--prompts-per-context", type=int, default=3, help="prompts per context length (default 3)")
    p.add_argument("--modes", default="greedy,sampled",
                   help="greedy and/or sampled (the model's default sampler) (default greedy,sampled)")
    p.add_argument("--temperature", type=float, help="sampled mode's temperature (default: the model's)")
    p.add_argument("--top-k", type=int, help="sampled mode's top_k, 0 for none (default: the model's)")
    p.add_argument("--top-p", type=float, help="sampled mode's top_p (default: the model's)")
    p.add_argument("--thinking", choices=("both", "on", "off"), default="both",
                   help="thinking on/off, for models whose chat template has the switch (default both)")
    p.add_argument("--prompts", metavar="FILE",
                   help="short prompts (--workloads: the chat workload's): the first turns of an MT-Bench style "
                        "question.jsonl (default: our own)")
    p.add_argument("--iterations", type=int, default=3, help="--quick: requests per context and tag (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first sampled request (default 0)")
    p.add_argument("--no-plot", action="store_true", help="no PNG plot")


def agreement_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "flm-bench")
    p.add_argument("--contexts", default="1k,4k,max",
                   help="comma-separated context lengths: N, Nk or max (default 1k,4k,max)")
    p.add_argument("--positions", type=int, default=256,
                   help="teacher-forced positions per document and context, a multiple of --block (default 256)")
    p.add_argument("--block", type=int, default=8,
                   help="positions per verify pass: the draft's block, anchor + 7 drafted (default 8)")
    p.add_argument("--reference", choices=("f32", "same"), default="f32",
                   help="weights of the token-by-token reference: f32 (the float32 path of the same files; "
                        "default) or same (the served model itself)")
