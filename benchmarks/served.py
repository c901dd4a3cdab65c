"""The path users take: flm through LiteLLM against llama-server through LiteLLM, interleaved in one run.

Both sides are called the way a user calls them, streamed and greedy (``temperature=0``):

- flm: ``litellm.acompletion(model="flm/<tag>", stream=True, stream_options={"include_usage":
  True})`` in this process (``import litellm_flm`` registers the provider; the engine runs in its
  own thread, as it does for every user);
- llama-server (llama.cpp's HTTP server) on the same GGUF file that ``flm/<tag>`` loads, with the
  same threads (``-t N -tb N``), reached through LiteLLM's ``openai/`` provider
  (``model="openai/llama-server", api_base="http://127.0.0.1:PORT/v1", api_key="none"``) with
  ``cache_prompt: true`` in every request's body (llama-server's default, sent anyway). It runs
  with ``--parallel`` set to the largest concurrency measured and one unified KV buffer
  (``--kv-unified``, ``--ctx-size 16384``) so that every concurrent stream has a slot.

What is measured (each figure per round; the table gives medians over ``--rounds``):

1. one stream, a short chat prompt (our ``documents.SHORT_PROMPTS``), ``--max-tokens`` (128)
   tokens with the end of turn ignored (``ignore_eos``, which both sides accept): decode tokens/s
   after the first token, (completion tokens - 1) / (last content chunk - first content chunk),
   and TTFT, seconds from sending the request to its first content chunk;
2. ``--streams`` (8 and 32) concurrent streams of such prompts: aggregate completion tokens/s,
   the completion tokens of all the requests (from the final chunks' ``usage``) over the seconds
   from sending the first request to the last chunk of the last one;
3. a multi-turn chat: the first user message asks for a summary of the first
   ``--document-tokens`` (2,000) tokens of a shipped public-domain text
   (``flm_bench.documents``), then ``--turns`` - 1 follow-up questions, each request resending the
   whole history (each side's own previous answers appended, ``--turn-tokens`` (64) at most each,
   stopping at the end of turn): the TTFT of each turn. flm runs it twice, with its prefix cache
   on (this process) and off (a worker process, ``python served.py --worker-chat``, started with
   ``FLM_PREFIX_CACHE=0``). llama-server runs it with ``cache_prompt`` on. The prompt tokens of each turn (from ``usage``)
   are in the row labels, flm's / llama-server's: the histories differ where the answers do; turn
   1's prompt tokens / its TTFT is the prefill rate;
4. decode against the read-bandwidth bound: each round, once other processes are quiet, this
   process streams a 1 GiB float32 matrix through the 1-row product a decode step uses and through
   a numpy sum (``decode_bandwidth.read_bandwidth``, the faster of the two: the read bandwidth this
   process gets with its threads). An engine's bound is that bandwidth / its bytes per decode
   token, and its figure the round's single-stream decode tokens/s / the bound. flm's bytes per
   token are what its weights stream per decode step (``model.nbytes_per_token``: every layer,
   the final norm and the LM head as the engine holds them, not the embedding row); llama-server's
   are the GGUF's tensor bytes (``gguf_bytes_per_token``: all of them but ``token_embd`` when the
   file has an ``output`` tensor, since then only one row of it is read per token). The KV cache a
   step reads (a short prompt's) is left out of both;
5. cold start: the wall time of ``subprocess.run`` of a new process ``litellm-flm run <tag> "Hi"
   --temperature 0``, run twice, the second reported (caches warm). flm only.

Every prompt of a round starts with a tag of its own (``Request 2-5.``, ``Conversation 2.``), so
no round reuses a previous round's cache; the chat template's system prompt is shared, as it is
for every user. Rounds alternate the order of the engines (flm first, then llama-server; then the
reverse), engine by engine within each measurement, with a pause between engines (OpenMP's idle
workers spin for a while). Each ratio is flm / llama-server, the median of the per-round ratios
(tokens/s: higher is better for flm; seconds: lower is better for flm). Before the rounds, each
engine serves a short request and a document-length one (loading, compiling).

Machine noise: on a shared machine other processes take CPUs, and the two engines do not suffer
alike. llama.cpp's threads spin at their barriers, so when a CPU is taken from one of them the
others wait spinning: on our 2-CPU machine, with other processes keeping both CPUs busy,
llama-server decoded at ~6 tokens/s instead of ~80, while flm (whose kernel threads sleep at a barrier after a short spin) lost far
less; ratios measured under load flatter flm. So before each engine's turn (its stream, its
streams, its chat) the script waits, ``--max-wait`` seconds at most (default 60), until other
processes have kept fewer than ``QUIET_CPUS`` (0.25) CPUs busy over a second, runs a turn again
(``--retries`` times at most, default 2, with a fresh prompt) when they kept more than
``NOISY_CPUS`` (0.5) busy on average during it, and its header gives, per round, how many CPUs
other processes kept busy during the turns kept (from ``/proc``: the machine's CPU time less that
of this process, the cache-off worker and llama-server). Rounds where that is well above 0.25 are
suspect.

Threads: ``--threads N`` (default 2) sets llama-server's ``-t`` and ``-tb`` and, for flm,
``FLM_THREADS``, ``NUMBA_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``. Those are read when numba and numpy load, so
the script re-executes itself with them set, once, before it imports the runtime. It also UNSETS
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (workarounds for older CPUs that our machines set
and that slow a current OpenBLAS, hence numpy) for its own process and the processes it starts,
unless ``--keep-openblas-env``; its header says which. Nothing outside the script's processes is
changed.

llama-server is built from the sources of the ``llama-cpp-python`` sdist, native without AMX
(``flm_bench.llama_server`` holds the recipe); ``--build-llama-server DIR`` builds it there
(about 15 minutes on 2 cores; an existing build in DIR is reused) and measures with the result.

Usage (``--quick``: one round of everything, smaller, to check that it runs):

    python benchmarks/served.py --llama-server PATH | --build-llama-server DIR
        [--tag smollm2:135m] [--threads 2] [--rounds 3] [--max-tokens 128] [--streams 8,32]
        [--turns 4] [--document-tokens 2000] [--turn-tokens 64] [--max-wait 60] [--retries 2]
        [--quick] [--keep-openblas-env]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flm_bench.llama_server import LLAMA_CPP_PYTHON, LlamaServer, build_llama_server
from flm_bench.options import positive_int, thread_env

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch it

FLM, NOCACHE, LLAMA = "flm", "flm, prefix cache off", "llama-server"
PROBE = "read-bandwidth probe"  # not an engine: the process's read bandwidth, per round
LLAMA_CTX = 16384  # llama-server's unified KV buffer, shared by its slots
SETTLE_S = 0.5  # pause between engines: idle OpenMP / OpenBLAS workers spin for ~0.1-0.2 s
QUIET_CPUS = 0.25  # other processes busier than this (in CPUs, over a second) delay the next engine's turn
NOISY_CPUS = 0.5  # a turn during which other processes kept more CPUs busy (on average) is run again
TIMEOUT_S = 900
FOLLOW_UPS = ("Who are the main people in it, and what do they want?", "What happens at the end?",
              "Summarize the whole text in one sentence.", "Which detail is the most surprising?",
              "What would you ask the author?")
QUICK = {"rounds": 1, "max_tokens": 16, "streams": [2, 4], "turns": 2, "document_tokens": 300, "turn_tokens": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``streams`` becomes a list of ints; ``--quick`` replaces the sizes by
    ``QUICK``'s.

    Raises:
        SystemExit: (argparse) neither or both of ``--llama-server`` and ``--build-llama-server``
            (unless ``--worker-chat``), a count below 1, more turns than follow-up questions + 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--llama-server", type=Path, help="a built llama-server binary")
    peer.add_argument("--build-llama-server", type=Path, metavar="DIR",
                      help=f"build llama-server from the {LLAMA_CPP_PYTHON} sdist in DIR (reused if built), then measure")
    parser.add_argument("--tag", default="smollm2:135m", help="registry tag of the model (and its GGUF)")
    parser.add_argument("--threads", type=positive_int, default=2, help="threads of both engines")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds")
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per single / concurrent stream")
    parser.add_argument("--streams", type=_counts, default=[8, 32], help="concurrent streams, comma-separated")
    parser.add_argument("--turns", type=positive_int, default=4, help="turns of the multi-turn chat")
    parser.add_argument("--document-tokens", type=positive_int, default=2000, help="document tokens in the chat's first turn")
    parser.add_argument("--turn-tokens", type=positive_int, default=64, help="answer tokens at most per chat turn")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--max-wait", type=float, default=60,
                        help="seconds to wait at most, before each engine's turn, for other processes to quieten")
    parser.add_argument("--retries", type=int, default=2,
                        help="times at most a turn is run again when other processes were busy during it")
    parser.add_argument("--keep-openblas-env", action="store_true",
                        help="keep OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE instead of unsetting them")
    parser.add_argument("--worker-chat", action="store_true", help=argparse.SUPPRESS)  # the cache-off process
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if not args.worker_chat and args.llama_server is None and args.build_llama_server is None:
        parser.error("give --llama-server PATH (a built binary) or --build-llama-server DIR")
    if args.turns > len(FOLLOW_UPS) + 1:
        parser.error(f"--turns {args.turns}: at most {len(FOLLOW_UPS) + 1}")
    return args


def _counts(text: str) -> list[int]:
    try:
        values = [positive_int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give stream counts, e.g. 8,32")
    return values


def gguf_bytes_per_token(gguf: Path) -> int:
    """Bytes of ``gguf``'s tensors that a decode step reads: all of them, less ``token_embd.weight``
    when the file has an ``output.weight`` (the embedding is then only gathered, a row per token).

    Raises:
        ValueError: (gguf) not a GGUF file.
    """
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    gathered = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return sum(tensors.values()) - gathered


def wanted_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """``environ`` with flm's, numba's and OpenBLAS's thread counts set to ``--threads``
    (``flm_bench.options.thread_env``)."""
    return thread_env(environ, args.threads, args.keep_openblas_env)


# --- One streamed request, and the three measurements built on it ---------------------------------


@dataclass
class Stream:
    """What one streamed request took: seconds from its send to its first and last content chunks
    and to its end, and its ``usage``."""

    first: float
    last: float
    end: float
    prompt_tokens: int
    completion_tokens: int
    text: str

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first token."""
        return (self.completion_tokens - 1) / (self.last - self.first)


async def stream(target: dict, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Stream:
    """Send one greedy streamed chat request to ``target`` (``acompletion`` keyword arguments: the
    model and, for llama-server, where it is) and read it to the end."""
    import litellm

    extra = dict(target.get("extra_body", {}), **({"ignore_eos": True} if ignore_eos else {}))
    t0 = time.perf_counter()
    response = await litellm.acompletion(**(target | {"extra_body": extra}), messages=messages,
                                         temperature=0, max_tokens=max_tokens, stream=True,
                                         stream_options={"include_usage": True}, timeout=TIMEOUT_S)
    first = last = None
    usage, parts = None, []
    async for chunk in response:
        now = time.perf_counter() - t0
        usage = getattr(chunk, "usage", None) or usage
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            first = now if first is None else first
            last = now
    end = time.perf_counter() - t0
    assert usage is not None and first is not None, f"{target['model']}: no usage or no content in the stream"
    return Stream(first, last, end, usage.prompt_tokens, usage.completion_tokens, "".join(parts))


def short_message(question: str, tag: str) -> list[dict]:
    """A short chat prompt made unique by ``tag`` (so that no earlier request's cache holds it)."""
    return [{"role": "user", "content": f"Request {tag}. {question}"}]


async def single(target: dict, question: str, max_tokens: int, tag: str) -> dict[str, float]:
    """Measurement 1: one stream of ``max_tokens`` tokens (end of turn ignored)."""
    s = await stream(target, short_message(question, tag), max_tokens, ignore_eos=True)
    assert s.completion_tokens == max_tokens, f"{target['model']}: {s.completion_tokens} tokens, not {max_tokens}"
    return {"decode": s.decode_rate, "ttft": s.first}


async def concurrent(target: dict, questions: list[str], n: int, max_tokens: int, tag: str) -> float:
    """Measurement 2: ``n`` streams at once; aggregate completion tokens/s."""
    t0 = time.perf_counter()
    done = await asyncio.gather(*(stream(target, short_message(questions[i % len(questions)], f"{tag}-{i + 1}"),
                                         max_tokens, ignore_eos=True) for i in range(n)))
    seconds = time.perf_counter() - t0
    tokens = sum(s.completion_tokens for s in done)
    assert tokens == n * max_tokens, f"{target['model']}: {tokens} tokens from {n} requests of {max_tokens}"
    return tokens / seconds


async def chat(target: dict, first: str, follow_ups: list[str], max_tokens: int) -> dict[str, list]:
    """Measurement 3: the multi-turn chat, history resent each turn; each turn's TTFT and prompt
    tokens."""
    messages, ttfts, prompts = [], [], []
    for question in [first, *follow_ups]:
        messages.append({"role": "user", "content": question})
        s = await stream(target, messages, max_tokens, ignore_eos=False)
        messages.append({"role": "assistant", "content": s.text})
        ttfts.append(s.first)
        prompts.append(s.prompt_tokens)
    return {"ttft": ttfts, "prompt_tokens": prompts}


def chat_opening(tokenizer, document_tokens: int, tag: str) -> str:
    """The chat's first user message: ``tag``, the summary instruction and the first
    ``document_tokens`` tokens of the first shipped document."""
    from flm_bench.documents import SUMMARY_INSTRUCTION, load_documents

    text = load_documents()[0].text
    return f"{tag}. {SUMMARY_INSTRUCTION}{tokenizer.decode(tokenizer.encode(text)[:document_tokens])}"


def cold_start(tag: str, max_wait: float) -> list[float]:
    """Measurement 4: wall seconds of ``litellm-flm run <tag> "Hi" --temperature 0`` in a new
    process, twice (the second with warm caches), each once other processes are quiet
    (``wait_for_quiet``).

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    cli = str(Path(sys.executable).with_name("litellm-flm"))
    seconds = []
    for _ in range(2):
        wait_for_quiet([os.getpid()], max_wait)
        t0 = time.perf_counter()
        subprocess.run([cli, "run", tag, "Hi", "--temperature", "0"], check=True, capture_output=True)
        seconds.append(time.perf_counter() - t0)
    return seconds


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """CPU seconds used since boot by the whole machine (``/proc/stat``: all but idle and iowait)
    and by the processes ``pids`` (their ``utime`` + ``stime``, all their threads). The difference
    of two calls, over the wall time between them, is how busy other processes kept the CPUs: the
    machine noise a round saw."""
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    ours = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        ours += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return (user + nice + system + irq + softirq + steal) / tick, ours / tick


class Noise:
    """The other processes around the engines' turns. ``turn`` runs one engine's turn once they
    are quiet (``wait_for_quiet``) and again, up to ``retries`` times, while they kept more than
    ``NOISY_CPUS`` busy during it; ``take`` says how many CPUs they kept busy, on average, during
    the turns kept since the last ``take``."""

    def __init__(self, ours: list[int], max_wait: float, retries: int):
        self.ours, self.max_wait, self.retries = ours, max_wait, retries
        self.busy = self.wall = 0.0
        self.repeated = 0  # turns run again because of other processes

    async def turn(self, run):
        """``await run(attempt)`` (attempt 0, 1, ...: a fresh prompt each, so that no cache holds
        it) as said above; returns the kept attempt's result."""
        for attempt in range(1 + self.retries):
            wait_for_quiet(self.ours, self.max_wait)
            t0, (total0, mine0) = time.perf_counter(), cpu_seconds(self.ours)
            result = await run(attempt)
            (total, mine), wall = cpu_seconds(self.ours), time.perf_counter() - t0
            busy = (total - total0) - (mine - mine0)
            if busy / wall < NOISY_CPUS or attempt == self.retries:
                break
            self.repeated += 1
        self.busy, self.wall = self.busy + busy, self.wall + wall
        return result

    def take(self) -> float:
        busy, self.busy, self.wall = self.busy / self.wall, 0.0, 0.0
        return busy


def wait_for_quiet(ours: list[int], max_wait: float) -> float:
    """Pause ``SETTLE_S``, then wait until processes other than ``ours`` have kept fewer than
    ``QUIET_CPUS`` CPUs busy over a second, or ``max_wait`` seconds have passed; returns the
    seconds waited. Blocks: call it only while no request is in flight."""
    t0 = time.perf_counter()
    time.sleep(SETTLE_S)
    while time.perf_counter() - t0 < max_wait:
        start, (total0, mine0) = time.perf_counter(), cpu_seconds(ours)
        time.sleep(1.0)
        total, mine = cpu_seconds(ours)
        if ((total - total0) - (mine - mine0)) / (time.perf_counter() - start) < QUIET_CPUS:
            break
    return time.perf_counter() - t0


# --- The peers: llama-server, and flm with its prefix cache off in a process of its own ------------


class CacheOffChat:
    """flm with ``FLM_PREFIX_CACHE=0`` in a worker process (``--worker-chat``) that runs the chat on
    request: one JSON line in (the chat), one out (``chat``'s result)."""

    def __init__(self, tag: str):
        env = dict(os.environ, FLM_PREFIX_CACHE="0")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker-chat", "--tag", tag],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def chat(self, first: str, follow_ups: list[str], max_tokens: int) -> dict[str, list]:
        self.proc.stdin.write(json.dumps({"first": first, "follow_ups": follow_ups, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = await asyncio.to_thread(self.proc.stdout.readline)
        assert line, f"the cache-off worker ended (exit status {self.proc.wait()})"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker_chat(tag: str) -> int:
    """The cache-off process: run each chat read from stdin, write its result to stdout, until
    stdin ends."""
    import litellm_flm  # noqa: F401 - registers the flm provider

    async def serve() -> None:  # one event loop for all the chats, as in the main process
        while line := await asyncio.to_thread(sys.stdin.readline):
            job = json.loads(line)
            result = await chat({"model": f"flm/{tag}"}, job["first"], job["follow_ups"], job["max_tokens"])
            print(json.dumps(result), flush=True)

    asyncio.run(serve())
    return 0


# --- The run: warm-up, interleaved rounds, cold start ----------------------------------------------


async def measure(args: argparse.Namespace, llama: dict, cache_off: CacheOffChat, tokenizer,
                  bytes_per_token: dict[str, int], ours: list[int],
                  others: list[float]) -> tuple[dict[str, dict[str, list]], int]:
    """Warm every engine up, then ``args.rounds`` interleaved rounds; returns per engine (and
    ``PROBE``: the read bandwidth, bytes/s), per figure, the values of every round, and the turns
    run again because of other processes; appends to ``others`` the CPUs that processes other than
    ``ours`` kept busy during each round's turns (``Noise``).

    Args:
        bytes_per_token: per engine (``FLM``, ``LLAMA``), the weight bytes a decode step reads.
    """
    import numpy as np
    from decode_bandwidth import PROBE_BYTES, read_bandwidth  # benchmarks/, this script's folder

    from flm_bench.documents import SHORT_PROMPTS

    flm = {"model": f"flm/{args.tag}"}
    targets = {FLM: flm, LLAMA: llama}
    follow_ups = list(FOLLOW_UPS[: args.turns - 1])
    print("warming up ...", flush=True)
    warm_doc = chat_opening(tokenizer, args.document_tokens, "Warm-up")
    for target in targets.values():
        await stream(target, short_message("Hello!", "warm-up"), 4, ignore_eos=False)
        await stream(target, [{"role": "user", "content": warm_doc}], 4, ignore_eos=False)
        await concurrent(target, list(SHORT_PROMPTS), 2, 4, "warm-up")
    await cache_off.chat(warm_doc, [], 4)

    values: dict[str, dict[str, list]] = {FLM: {}, NOCACHE: {}, LLAMA: {}, PROBE: {}}
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((PROBE_BYTES // 4 // 4096, 4096), dtype=np.float32)
    vector = rng.standard_normal(4096, dtype=np.float32)

    async def probe(_attempt: int) -> float:
        return read_bandwidth(matrix, vector)

    def keep(engine: str, figure: str, value) -> None:
        values[engine].setdefault(figure, []).append(value)

    noise = Noise(ours, args.max_wait, args.retries)
    for r in range(args.rounds):
        order = [FLM, LLAMA] if r % 2 == 0 else [LLAMA, FLM]
        question = SHORT_PROMPTS[r % len(SHORT_PROMPTS)]
        for name in order:
            result = await noise.turn(lambda a: single(targets[name], question, args.max_tokens, f"{r + 1}.{a}"))
            for figure, value in result.items():
                keep(name, figure, value)
        keep(PROBE, "bandwidth", await noise.turn(probe))
        for name in (FLM, LLAMA):
            keep(name, "bound", values[name]["decode"][-1] * bytes_per_token[name] / values[PROBE]["bandwidth"][-1])
        for n in args.streams:
            for name in order:
                keep(name, f"streams_{n}", await noise.turn(lambda a: concurrent(
                    targets[name], list(SHORT_PROMPTS), n, args.max_tokens, f"{r + 1}.{a}-{n}")))
        for name in ([FLM, NOCACHE, LLAMA] if r % 2 == 0 else [LLAMA, NOCACHE, FLM]):
            def conversation(a: int):
                opening = chat_opening(tokenizer, args.document_tokens, f"Conversation {r + 1}.{a}")
                if name == NOCACHE:
                    return cache_off.chat(opening, follow_ups, args.turn_tokens)
                return chat(targets[name], opening, follow_ups, args.turn_tokens)

            result = await noise.turn(conversation)
            for turn, (ttft, prompt) in enumerate(zip(result["ttft"], result["prompt_tokens"]), 1):
                keep(name, f"chat_{turn}", ttft)
                keep(name, f"chat_{turn}_prompt", prompt)
            if name != NOCACHE:
                keep(name, "prefill", result["prompt_tokens"][0] / result["ttft"][0])
        others.append(noise.take())
        print(f"round {r + 1}/{args.rounds}, other processes {others[-1]:.1f} CPUs: " + "; ".join(
            f"{name}: {values[name]['decode'][-1]:.1f} tokens/s ({values[name]['bound'][-1]:.2f} of its bound), "
            + ", ".join(f"{n} streams {values[name][f'streams_{n}'][-1]:.1f}" for n in args.streams)
            + f", chat turn {args.turns} TTFT {values[name][f'chat_{args.turns}'][-1]:.2f} s"
            for name in (FLM, LLAMA)), flush=True)
        if r + 1 < args.rounds:  # the table so far, should the run be cut short
            keys = [key for key, _, _ in figures(args.streams, args.turns)]
            print(format_table(summarize(values, keys), args.streams, args.turns, None, bytes_per_token), flush=True)
    return values, noise.repeated


# --- The report ------------------------------------------------------------------------------------


def figures(streams: list[int], turns: int) -> list[tuple[str, str, str]]:
    """The table's rows in order: (figure key, row label, format of a value)."""
    rows = [("decode", "1 stream: decode tokens/s after the first token", ".1f"),
            ("bound", "1 stream: decode / the read-bandwidth bound", ".2f"),
            ("ttft", "1 stream: TTFT s, short prompt", ".3f")]
    rows += [(f"streams_{n}", f"{n} concurrent streams: aggregate tokens/s", ".1f") for n in streams]
    rows += [(f"chat_{t}", f"chat turn {t}: TTFT s", ".3f") for t in range(1, turns + 1)]
    rows.append(("prefill", "chat turn 1: prefill tokens/s (prompt tokens / TTFT)", ",.0f"))
    return rows


def summarize(values: dict[str, dict[str, list]], keys: list[str]) -> dict[str, dict[str, float]]:
    """Per engine, the median over rounds of each of its figures and, for each engine but
    llama-server, ``ratio_<key>`` for each of ``keys``: the median over rounds of the engine's value
    / llama-server's; for flm with the prefix cache off also ``on_off_<key>``: the median over
    rounds of flm's value / its own."""

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    out = {name: {k: statistics.median(v) for k, v in per.items()} for name, per in values.items()}
    for name, per in values.items():
        if name != LLAMA:
            out[name] |= {f"ratio_{k}": ratio(per[k], values[LLAMA][k]) for k in keys if k in per}
    if NOCACHE in values:
        off = values[NOCACHE]
        out[NOCACHE] |= {f"on_off_{k}": ratio(values[FLM][k], off[k]) for k in keys if k in off}
    return out


def format_table(summary: dict[str, dict[str, float]], streams: list[int], turns: int,
                 cold: float | None, bytes_per_token: dict[str, int]) -> str:
    """The markdown table: a row per figure with flm, llama-server and their ratio; each engine's
    bytes per decode token and the probe's read bandwidth (the bound's terms); the chat rows again
    for flm with the prefix cache off, then the cache on / off ratio of each turn and the cold
    start (flm's alone)."""
    flm, off, llama = summary[FLM], summary.get(NOCACHE, {}), summary[LLAMA]
    lines = [f"| figure | {FLM} | {LLAMA} | ratio {FLM} / {LLAMA} |", "|---|---|---|---|"]
    rows = figures(streams, turns)
    for key, label, fmt in rows:
        if key.startswith("chat_"):
            label += f" (prompt {flm[key + '_prompt']:,.0f} / {llama[key + '_prompt']:,.0f} tokens)"
        lines.append(f"| {label} | {flm[key]:{fmt}} | {llama[key]:{fmt}} | {flm[f'ratio_{key}']:.2f}x |")
    ours, theirs = bytes_per_token[FLM], bytes_per_token[LLAMA]
    lines.append(f"| bytes per decode token, MB (flm: its weights as held; llama-server: the GGUF's tensors) | "
                 f"{ours / 1e6:,.1f} | {theirs / 1e6:,.1f} | {ours / theirs:.2f}x |")
    lines.append(f"| read bandwidth of this process, GB/s (the probe; bound = bandwidth / bytes per token) | "
                 f"{summary[PROBE]['bandwidth'] / 1e9:.1f} | – | – |")
    chat = [(key, label, fmt) for key, label, fmt in rows if key.startswith("chat_") and key in off]
    for key, label, fmt in chat:
        lines.append(f"| {label.replace('chat', 'chat, FLM_PREFIX_CACHE=0,', 1)} | {off[key]:{fmt}} | "
                     f"{llama[key]:{fmt}} | {off[f'ratio_{key}']:.2f}x |")
    for key, label, _ in chat:
        lines.append(f"| {label.replace('TTFT s', 'TTFT')}, flm prefix cache on / off | {off[f'on_off_{key}']:.2f}x | – | – |")
    if cold is not None:
        lines.append(f'| cold start s: a new `litellm-flm run ... "Hi"`, the second run | {cold:.2f} | – | – |')
    return "\n".join(lines)


def header(args: argparse.Namespace, argv: list[str], gguf: Path, server: LlamaServer, others: list[float],
           repeated: int, elapsed: float, cold: list[float]) -> list[str]:
    """The lines that say what was run, where and how."""
    import litellm_flm

    cpu = "unknown CPU"
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "unknown CPU":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    unset = ("kept" if args.keep_openblas_env
             else "unset for this benchmark's processes (they slow a current OpenBLAS; --keep-openblas-env keeps them)")
    return [
        f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"command: python benchmarks/served.py {' '.join(argv)}",
        f"benchmark at commit {_commit(Path(__file__).parent)}; flm runtime imported from "
        f"{Path(litellm_flm.__file__).parents[1]} at commit {_commit(Path(litellm_flm.__file__).parent)}",
        f"host: {cpu}, {os.cpu_count()} CPUs, avx512_vnni {'yes' if 'avx512_vnni' in flags else 'no'}; "
        f"other processes kept {', '.join(f'{x:.2f}' for x in others)} CPUs busy during each round's turns "
        f"(each turn waited for fewer than {QUIET_CPUS}, {args.max_wait:.0f} s at most; {repeated} turns run again, "
        f"up to {args.retries} times each, when above {NOISY_CPUS}); {elapsed:.0f} s",
        f"model {args.tag} ({gguf}); {args.threads} threads for both engines; {args.rounds} round(s), interleaved",
        f"llama-server {server.binary} ({server.version()}): "
        f"{server.flags}, cache_prompt true",
        f"single and concurrent streams: {args.max_tokens} tokens each, end of turn ignored; chat: "
        f"{args.turns} turns, {args.document_tokens} document tokens, answers of {args.turn_tokens} tokens at most",
        f"cold start runs: {', '.join(f'{s:.2f} s' for s in cold)} (the second is reported)",
        f"OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE: {unset}",
        "values are medians over rounds; ratio = flm / llama-server, the median of per-round ratios "
        "(tokens/s: higher is better for flm; seconds: lower is better for flm)",
    ]


def _commit(where: Path) -> str:
    """The short commit of the checkout holding ``where``, marked if it has uncommitted changes."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=where).stdout.strip() or "unknown"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                      cwd=where).stdout.strip():
        commit += " with uncommitted changes"
    return commit


def main(argv: list[str] | None = None) -> int:
    """Parse, set the thread environment (re-executing once), build llama-server if asked, then
    start the peers, measure and print."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    env = wanted_env(args, os.environ)
    if env != dict(os.environ):
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    if args.worker_chat:
        return worker_chat(args.tag)
    binary = build_llama_server(args.build_llama_server) if args.build_llama_server else args.llama_server
    return run(args, argv, binary)


def run(args: argparse.Namespace, argv: list[str], binary: Path) -> int:
    """Start llama-server and the cache-off worker, measure, run the cold starts, print the table
    (Markdown ready for docs/benchmarks.md: a heading, the header's lines as a list, the table)."""
    import litellm_flm  # noqa: F401 - registers the flm provider
    from flm_runtime import get_engine, pull

    gguf = pull.locate(args.tag)
    engine = get_engine(args.tag)  # the engine flm/<tag> serves with (one per process)
    tokenizer = engine.tokenizer
    bytes_per_token = {FLM: engine.model.nbytes_per_token, LLAMA: gguf_bytes_per_token(gguf)}
    started, others = time.time(), []
    cache_off = CacheOffChat(args.tag)
    try:
        with LlamaServer(binary, gguf, args.threads, max(args.streams), LLAMA_CTX) as server:
            ours = [os.getpid(), cache_off.proc.pid, server.proc.pid]
            values, repeated = asyncio.run(measure(args, server.target, cache_off, tokenizer, bytes_per_token, ours,
                                                   others))
    finally:
        cache_off.close()
    print("cold starts ...", flush=True)
    cold = cold_start(args.tag, args.max_wait)
    summary = summarize(values, [key for key, _, _ in figures(args.streams, args.turns)])
    lines = header(args, argv, gguf, server, others, repeated, time.time() - started, cold)
    table = format_table(summary, args.streams, args.turns, cold[-1], bytes_per_token)
    print(f"\n#### `{args.tag}` through LiteLLM against llama-server\n\n" + "\n".join(f"- {line}" for line in lines)
          + f"\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
