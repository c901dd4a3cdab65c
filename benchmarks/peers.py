"""Us against llama.cpp on the same GGUF and thread count, interleaved in one run.

Four figures per engine, each a forward pass timed alone (no sampling, no tokenization):

- decode tokens/s at context 256 and at context 4,096: one position appended to a KV cache that
  holds that many positions (logits of the new position), the cache rolled back after each step
  (llama.cpp's caches are prefilled; ours repeat 256 prefilled positions, see ``Ours.prepare``);
- the cost of an 8-token pass (a DFlash verify: 8 positions appended at context 256, logits for
  all 8) in decode units: pass time / 1-token decode time at context 256, in the same round;
- prefill tokens/s over 512 tokens into an empty cache (logits of the last position).

Rounds alternate the order of the engines (llama.cpp first, then ours; then ours first, ...), so
that machine noise hits all of them; each figure is the median over rounds, and each ratio
(ours / llama.cpp) is the median of the per-round ratios. Token ids are drawn at random from the
vocabulary (speed does not depend on them), the same ids for every engine.

Ours: ``flm_runtime.backends.forward`` / ``prefill`` on the cpu backend, loaded once per weight kind asked
(``--weights``, default ``auto,q8``: ``auto`` is what a user gets by default, the GGUF's own
precision class). llama.cpp: llama-cpp-python's C bindings (``llama_decode`` of one batch,
``llama_memory_seq_rm`` to roll back), contexts with the default flash-attention and f16 KV cache
settings.

Threads: ``--threads N`` (default 2) sets llama.cpp's ``n_threads`` and ``n_threads_batch`` and,
for us, ``FLM_THREADS`` (the kernel team that runs our steps), ``NUMBA_NUM_THREADS`` and
``OPENBLAS_NUM_THREADS``. Those are read when the runtime, numba and numpy load, so the script
re-executes itself with them set (once, before it measures anything). It also UNSETS ``OPENBLAS_CORETYPE`` and
``OPENBLAS_L2_SIZE`` for its own process (older-CPU workarounds some machines set, which slow a
current OpenBLAS) unless ``--keep-openblas-env`` is given; its output says which.

A fifth figure: decode at context 256 against the bandwidth bound, ``tokens/s / (read bandwidth /
bytes per token)``. The read bandwidth is measured in every round, before the engines: the best of
three streaming reads of 1 GiB by the same number of threads (numba ``prange``, a sum of 64-bit
words). Bytes per token are the weights each engine streams in a decode step: ours as held
(``CausalLM.nbytes_per_token``: 6-bit GGUF blocks are held 8-bit, 4-bit ones with float32
scales), llama.cpp's the GGUF's own tensors (all but the embedding, unless it is the LM head); the
KV cache's read at context 256 (under 2% here) is left out.

Models: ``--tag`` (a registry tag, default the embedded SmolLM2-135M), ``--gguf PATH``, or
``--shape NAME``, a random-weight file shaped like a real model (``flm_bench.shaped_gguf``:
Llama 3.2 1B Q4_K_M, Llama 3.2 3B Q4_0), written once into ``--shape-dir``.

Needs the optional extra ``peers`` (llama-cpp-python, built from source with the flags that
pyproject.toml gives); without it the script says so and exits 0.

    python benchmarks/peers.py [--tag smollm2:135m | --gguf PATH | --shape NAME] [--threads 2] [--weights auto,q8,f32]
        [--rounds 6] [--steps 16] [--prefills 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np

from flm_bench.options import positive_int, thread_env
from flm_bench.shaped_gguf import SHAPES, write_shaped_gguf
from flm_runtime import paths, pull
from flm_runtime.backends import forward, prefill
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.loading import load_model_files
from flm_runtime.loading.gguf import open_gguf
from flm_runtime.loading.weights import WEIGHT_KINDS
from flm_runtime.models.causal_lm import CausalLM

CONTEXTS = (256, 4096)  # decode contexts (positions already in the KV cache)
PASS_ROWS = 8  # positions of the verify-sized pass, appended at PASS_CONTEXT
PASS_CONTEXT = 256
PREFILL = 512  # prompt positions of the prefill figure
DEFAULT_WEIGHTS = "auto,q8"
SETTLE_S = 0.3  # pause between engines: OpenBLAS's and OpenMP's idle workers spin for ~0.1 s
LLAMA = "llama.cpp"
MISSING = (
    "llama-cpp-python is not installed, so there is nothing to compare against. Install the "
    "optional extra, built from source (its default native build uses AMX, which faults on some "
    "CPUs):\n"
    "  CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
    "pip install -e '.[peers]' --no-binary llama-cpp-python"
)
# The figures, in table order: key, row label.
FIGURES = (
    ("decode_256", "decode tokens/s, context 256"),
    ("decode_4096", "decode tokens/s, context 4,096"),
    ("pass_cost", f"{PASS_ROWS}-token pass at context {PASS_CONTEXT}, in decodes"),
    ("prefill", f"prefill tokens/s, {PREFILL} tokens"),
    ("bound", f"decode at context {CONTEXTS[0]} / bandwidth bound"),
)
PROBE_BYTES = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``weights`` becomes a list of weight kinds (``WEIGHT_KINDS``, no repeats).

    Raises:
        SystemExit: (argparse) an unknown weight kind, a repeated one, or a count below 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--tag", default="smollm2:135m", help="registry tag of the GGUF to compare on")
    model.add_argument("--gguf", type=Path, help="a GGUF file to compare on")
    model.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight GGUF shaped like this model")
    parser.add_argument("--shape-dir", type=Path, default=paths.model_dir() / "shaped",
                        help="where --shape's file is written once (default: the model cache's shaped/)")
    parser.add_argument("--threads", type=positive_int, default=2, help="threads of both engines")
    parser.add_argument("--weights", default=DEFAULT_WEIGHTS,
                        help=f"our weight kinds, comma-separated, of {','.join(WEIGHT_KINDS)} (default {DEFAULT_WEIGHTS})")
    parser.add_argument("--rounds", type=positive_int, default=6, help="interleaved rounds")
    parser.add_argument("--steps", type=positive_int, default=16,
                        help="timed decode steps and 8-token passes per figure and round (median taken)")
    parser.add_argument("--prefills", type=positive_int, default=2, help="timed prefills per round (median taken)")
    parser.add_argument("--json", type=Path, help="also write the raw per-round times here")
    parser.add_argument("--keep-openblas-env", action="store_true",
                        help="keep OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE instead of unsetting them")
    args = parser.parse_args(argv)
    kinds = [k.strip().lower() for k in args.weights.split(",") if k.strip()]
    bad = [k for k in kinds if k not in WEIGHT_KINDS]
    if not kinds or bad or len(set(kinds)) < len(kinds):
        parser.error(f"--weights {args.weights!r}: give distinct kinds of {', '.join(WEIGHT_KINDS)}")
    args.weights = kinds
    return args


def engine_label(kind: str) -> str:
    """Our column for weight kind ``kind``; the default kind says so."""
    return f"ours {kind} (default)" if kind == "auto" else f"ours {kind}"


def summarize(times: dict[str, dict[str, list[float]]], bandwidth: list[float],
              nbytes: dict[str, int]) -> dict[str, dict[str, float]]:
    """Figures and ratios from per-round seconds.

    Args:
        times: engine -> ``{"decode_256", "decode_4096", "pass", "prefill"}`` -> seconds per round
            (one decode step, one 8-token pass, one 512-token prefill), the same rounds for every
            engine; the engine ``LLAMA`` is the reference.
        bandwidth: bytes/s the read probe streamed in each round.
        nbytes: engine -> weight bytes it reads per decode step.
    Returns:
        engine -> figure (``FIGURES``' keys) -> median over rounds, and, for engines other than
        ``LLAMA``, ``ratio_<figure>`` -> median over rounds of ours / llama.cpp for the tokens/s
        figures (higher is better for us) and the pass cost (lower is better for us); the bound
        figure has no ratio.
    """
    per_round = {name: _per_round(t, bandwidth, nbytes[name]) for name, t in times.items()}
    summary = {}
    for name, figures in per_round.items():
        row = {key: statistics.median(values) for key, values in figures.items()}
        if name != LLAMA:
            ref = per_round[LLAMA]
            row |= {f"ratio_{key}": statistics.median(a / b for a, b in zip(values, ref[key]))
                    for key, values in figures.items() if key != "bound"}
        summary[name] = row
    return summary


def _per_round(t: dict[str, list[float]], bandwidth: list[float], nbytes: int) -> dict[str, list[float]]:
    """One engine's figures per round (tokens/s, the pass in decode units of its round, and decode
    at 256 as a share of its round's bound ``bandwidth / nbytes``)."""
    return {
        "decode_256": [1 / s for s in t["decode_256"]],
        "decode_4096": [1 / s for s in t["decode_4096"]],
        "pass_cost": [p / d for p, d in zip(t["pass"], t["decode_256"])],
        "prefill": [PREFILL / s for s in t["prefill"]],
        "bound": [nbytes / (s * bw) for s, bw in zip(t["decode_256"], bandwidth)],
    }


def format_table(summary: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per figure, llama.cpp's column, then each of ours with its ratio
    to llama.cpp (``summarize``'s result, in its engine order)."""
    ours = [name for name in summary if name != LLAMA]
    head = ["figure", LLAMA] + [col for name in ours for col in (name, "ratio")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in FIGURES:
        digits = 2 if key in ("pass_cost", "bound") else 1
        cells = [label, f"{summary[LLAMA][key]:.{digits}f}"]
        for name in ours:
            ratio = summary[name].get(f"ratio_{key}")
            cells += [f"{summary[name][key]:.{digits}f}", "-" if ratio is None else f"{ratio:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse, check that llama-cpp-python is installed (else say so: exit status 0), set the
    process's thread environment (re-executing once), then measure and print."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print(MISSING)
        return 0
    env = _wanted_env(args, os.environ)
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    return run(args)


def _wanted_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """``environ`` with our kernel team's, numba's and OpenBLAS's thread counts set to ``--threads``
    (``flm_bench.options.thread_env``)."""
    return thread_env(environ, args.threads, args.keep_openblas_env)


def run(args: argparse.Namespace) -> int:
    """Load every engine, warm it up, measure ``args.rounds`` interleaved rounds, print the table
    (and write ``args.json``). Assumes ``_wanted_env`` is in effect."""
    path = model_path(args)
    ours = {engine_label(kind): Ours(path, kind) for kind in args.weights}
    n_vocab = next(iter(ours.values())).model.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, n_vocab, size=max(CONTEXTS) + PASS_ROWS).tolist()
    engines = {LLAMA: LlamaCpp(path, args.threads)} | ours
    probe = ReadProbe()
    load = [os.getloadavg()[0]]
    started = time.time()
    for name, engine in engines.items():
        print(f"preparing {name} (KV caches at {', '.join(map(str, CONTEXTS))} positions) ...", flush=True)
        engine.prepare(tokens)
        _measure(engine, tokens, 1, 1)  # warm-up: compiled kernels, buffers
    times = {name: {"decode_256": [], "decode_4096": [], "pass": [], "prefill": []} for name in engines}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(probe.read())
        order = list(engines) if r % 2 == 0 else list(engines)[1:] + [LLAMA]
        for name in order:
            time.sleep(SETTLE_S)
            for key, seconds in _measure(engines[name], tokens, args.steps, args.prefills).items():
                times[name][key].append(seconds)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    load.append(os.getloadavg()[0])

    nbytes = {name: engine.nbytes_per_token for name, engine in engines.items()}
    summary = summarize(times, bandwidth, nbytes)
    header = _header(args, path, engines, load, time.time() - started)
    header.append(f"read bandwidth {statistics.median(bandwidth) / 1e9:.1f} GB/s (median of rounds; "
                  f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidth)}); weight bytes per decode step: "
                  + ", ".join(f"{name} {n / 1e6:.0f} MB" for name, n in nbytes.items()))
    print("\n" + "\n".join(header) + "\n\n" + format_table(summary))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "seconds_per_round": times, "read_bandwidth": bandwidth,
                                         "summary": summary}, indent=1))
    return 0


def model_path(args: argparse.Namespace) -> Path:
    """The GGUF compared on: ``--gguf``, ``--shape``'s file (written first if missing) or ``--tag``'s."""
    if args.gguf:
        return args.gguf
    if args.shape:
        return write_shaped_gguf(args.shape_dir, args.shape)
    return pull.locate(args.tag)


class ReadProbe:
    """The process's streaming-read bandwidth: its threads (``NUMBA_NUM_THREADS``) sum a 1 GiB
    array of 64-bit words, each thread a contiguous share."""

    def __init__(self):
        self.words = np.random.default_rng(0).integers(0, 1 << 62, PROBE_BYTES // 8, dtype=np.uint64)
        _word_sum(self.words)  # compiled before any round

    def read(self) -> float:
        """Bytes/s of the best of three reads."""
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            _word_sum(self.words)
            best = min(best, time.perf_counter() - t0)
        return self.words.nbytes / best


@numba.njit(parallel=True, cache=True)
def _word_sum(words: np.ndarray) -> int:
    shares = 64
    step = len(words) // shares
    total = np.uint64(0)
    for share in numba.prange(shares):
        for i in range(share * step, (share + 1) * step):
            total += words[i]
    return total


def _measure(engine, tokens: list[int], steps: int, prefills: int) -> dict[str, float]:
    """One round of one engine: median seconds of a decode step at each context, of an 8-token
    pass at PASS_CONTEXT, and of a 512-token prefill."""
    out = {f"decode_{c}": statistics.median(engine.step(c, tokens[c : c + 1]) for _ in range(steps))
           for c in CONTEXTS}
    out["pass"] = statistics.median(engine.step(PASS_CONTEXT, tokens[PASS_CONTEXT : PASS_CONTEXT + PASS_ROWS])
                                    for _ in range(steps))
    out["prefill"] = statistics.median(engine.prefill(tokens[:PREFILL]) for _ in range(prefills))
    return out


def _header(args: argparse.Namespace, path: Path, engines: dict, load: list[float], elapsed: float) -> list[str]:
    """The lines that say what was run, where and how."""
    import llama_cpp

    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=here).stdout.strip() or "unknown"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                      cwd=here).stdout.strip():  # the code measured is not the commit's
        commit += " with uncommitted changes"
    unset = ("kept" if args.keep_openblas_env
             else "unset for this process (they slow a current OpenBLAS; --keep-openblas-env keeps them)")
    kinds = ", ".join(f"{name}: {engine.held}" for name, engine in engines.items() if name != LLAMA)
    return [
        f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}, "
        f"command: python benchmarks/peers.py {' '.join(sys.argv[1:])}",
        f"model {path.name}, {args.threads} threads for both engines, "
        f"{args.rounds} rounds ({args.steps} steps / passes, {args.prefills} prefills per figure and round), "
        f"{elapsed:.0f} s, load average {load[0]:.1f} at start, {load[1]:.1f} at end",
        f"our weights: {kinds}; the default is auto",
        f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}",
        f"OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE: {unset}",
        "ratio = ours / llama.cpp, the median of per-round ratios (tokens/s: higher is better for us; "
        "pass cost: lower is better for us)",
    ]


class Ours:
    """Our cpu backend on weight kind ``kind``: KV caches at each of ``CONTEXTS``, timed passes."""

    def __init__(self, path: Path, kind: str):
        bundle = load_model_files(path, weights=kind)
        self.model = CausalLM(bundle.config, bundle.weights)
        m = self.model
        matrices = [w for layer in m.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [m.lm_head]
        self.held = "/".join(f"q{b}" for b in sorted({w.bits for w in matrices if isinstance(w, QuantWeight)})) or "f32"
        self.nbytes_per_token = m.nbytes_per_token
        self.caches = {}

    def prepare(self, tokens: list[int]) -> None:
        """A KV cache at each context (not timed): the first ``CONTEXTS[0]`` positions prefilled,
        the longer caches holding those keys and values repeated (attention's cost does not depend
        on their values, and a real long prefill costs minutes on a busy machine)."""
        first = self.model.new_cache(CONTEXTS[0])
        prefill(self.model, tokens[: CONTEXTS[0]], first)
        keys, values = first.keys(), first.values()  # [L, Hkv, N, D]
        for c in CONTEXTS:
            cache = self.caches[c] = self.model.new_cache(c + PASS_ROWS)
            cache.reserve(c)
            for s in range(0, c, CONTEXTS[0]):
                n = min(CONTEXTS[0], c - s)
                for layer in range(keys.shape[0]):
                    cache.write(layer, keys[layer, :, :n], values[layer, :, :n])
                cache.commit(n)

    def step(self, context: int, ids: list[int]) -> float:
        """Seconds of one forward of ``ids`` appended at ``context`` (logits for every new
        position); the cache is rolled back to ``context`` after."""
        cache = self.caches[context]
        t0 = time.perf_counter()
        forward(self.model, ids, cache, all_logits=True)
        seconds = time.perf_counter() - t0
        cache.trim(context)
        return seconds

    def prefill(self, ids: list[int]) -> float:
        """Seconds of a chunked prefill of ``ids`` into a new cache (as the engine serves a prompt)."""
        cache = self.model.new_cache(len(ids))
        t0 = time.perf_counter()
        prefill(self.model, ids, cache)
        return time.perf_counter() - t0


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C bindings: one context per decode context and one for
    prefill, each batch one ``llama_decode``."""

    held = "the GGUF as it is"

    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        self._log = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept: C holds it
        llama_cpp.llama_log_set(self._log, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        assert self.model, f"llama.cpp could not load {path}"
        self.threads = threads
        tensors = {t.name: t.data.nbytes for t in open_gguf(path).tensors}
        if "output.weight" in tensors:  # untied: the embedding is not read but a row
            del tensors["token_embd.weight"]
        self.nbytes_per_token = sum(tensors.values())
        self.contexts = {c: self._context(c + PASS_ROWS) for c in CONTEXTS}
        self.prefill_context = self._context(PREFILL)
        self.batch = llama_cpp.llama_batch_init(PREFILL, 0, 1)

    def _context(self, n_ctx: int):
        params = self.lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, PREFILL, PREFILL, 1
        params.n_threads = params.n_threads_batch = self.threads
        ctx = self.lib.llama_init_from_model(self.model, params)
        assert ctx, "llama.cpp could not create a context"
        return ctx

    def prepare(self, tokens: list[int]) -> None:
        """Fill each decode context's KV cache to its length, ``PREFILL`` positions per batch."""
        for c, ctx in self.contexts.items():
            for s in range(0, c, PREFILL):
                self._decode(ctx, s, tokens[s : min(c, s + PREFILL)], all_logits=False)

    def step(self, context: int, ids: list[int]) -> float:
        """Seconds of one ``llama_decode`` of ``ids`` at ``context`` (logits for every new
        position); the sequence is rolled back to ``context`` after."""
        ctx = self.contexts[context]
        seconds = self._decode(ctx, context, ids, all_logits=True)
        assert self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(ctx), 0, context, -1)
        return seconds

    def prefill(self, ids: list[int]) -> float:
        """Seconds of one ``llama_decode`` of ``ids`` into an emptied context (last logits only)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.prefill_context), True)
        return self._decode(self.prefill_context, 0, ids, all_logits=False)

    def _decode(self, ctx, start: int, ids: list[int], *, all_logits: bool) -> float:
        """Seconds of decoding ``ids`` at positions ``start ..`` of sequence 0 (the batch is
        filled before the clock starts)."""
        b = self.batch
        b.n_tokens = len(ids)
        for i, token in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, start + i, 1, all_logits or i == len(ids) - 1
            b.seq_id[i][0] = 0
        t0 = time.perf_counter()
        rc = self.lib.llama_decode(ctx, b)
        self.lib.llama_synchronize(ctx)
        seconds = time.perf_counter() - t0
        assert rc == 0, f"llama_decode returned {rc}"
        return seconds


if __name__ == "__main__":
    sys.exit(main())
