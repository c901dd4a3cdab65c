"""``litellm-flm bench --workloads --llama-server PATH`` (or ``--spec-off``): any tag against
llama-server on the same GGUF, both through LiteLLM, on the workloads of ``workloads.py``
(``all``: chat, code edits returning the whole function, search/replace edits, the same with
``prediction``, fill-in-the-middle while typing, an agent loop).

The engines, each sent every request of a run:

- ``flm``: ``litellm.completion(model="flm/<tag>")`` (a text completion for ``fim``:
  ``litellm.text_completion(prompt=prefix, suffix=...)``) in this process, the engine in its own
  thread as for every user, with whatever speculation the tag runs by default;
- ``flm, FLM_SPECULATION=0`` (``--spec-off``): the same calls in a worker process started with
  ``FLM_SPECULATION=0`` (``python -m flm_bench.peer_workloads TAG``, JSON lines in and out), so
  that our greedy outputs with and without speculation can be held token-identical;
- ``llama-server <config>`` (``--llama-server PATH``): one llama-server per ``--llama-configs``
  entry (``llama_server.SPEC_CONFIGS``: plain and each n-gram speculation type), all started at
  once on the tag's GGUF with ``--threads`` threads and one slot, reached through LiteLLM's
  ``openai/`` provider. llama-server's ``/v1/completions`` refuses ``suffix``, so a ``fim``
  request reaches it as the prompt our provider builds (``Tokenizer.encode_fim``): the model's
  FIM prefix token, the prefix, its FIM suffix token, the suffix, its FIM middle token, as text
  (which llama-server parses into the same tokens; the prompt token counts are in the CSV).
  llama-server has no predicted outputs: the ``prediction`` field reaches it and is ignored.

Every request goes to every engine one after the other, the order rotating from request to
request, so that machine noise hits all alike; a conversation (``agent``) goes on on each engine
with that engine's own answers (``workloads.follow_up``); ``fim``'s pauses follow one another
whatever the answers. Greedy requests have ``temperature`` 0, sampled ones ``temperature``
``SAMPLED_TEMPERATURE`` and a seed (``--seed`` + 100 per conversation + its turn; the same on
every engine).

Measured per request: wall seconds from sending it to the whole response (not streamed: the
end-to-end time, prefill included), completion and prompt tokens (``usage``), our answer's token
ids (``return_token_ids``; text completions return none, so ``fim`` compares texts).

Reported per workload, mode and engine: end-to-end tokens/s (completion tokens / seconds over all
its requests), llama-server's best configuration and flm / that best; with ``--spec-off`` flm /
``FLM_SPECULATION=0`` and how many greedy answers are identical across the two. ``fim``: median
and 90th-percentile latency per completion instead, the ratio of medians. Files in ``--out``:
``peer_workloads.md`` (tables, command, machine), ``peer_workloads.csv`` (a row per request and
engine), ``peer_workloads.png`` (needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import litellm
import litellm_flm  # noqa: F401 - registers the flm/ provider with LiteLLM
from tqdm import tqdm

from flm_bench import report, workloads
from flm_bench.documents import load_documents
from flm_bench.llama_server import SPEC_CONFIGS, LlamaServer
from flm_bench.options import parse_modes, thread_env
from flm_bench.soak import PROVIDER_PREFIX
from flm_bench.workloads import Answer, Task
from flm_runtime import InvalidRequestError, get_engine, pull
from flm_runtime.kernels.team import default_threads
from flm_runtime.settings import Settings

PROG_NAME = "litellm-flm bench --workloads"
FLM, FLM_OFF = "flm", "flm, FLM_SPECULATION=0"
LLAMA = "llama-server"
PEER_MAX_TOKENS = 1024  # a whole 90-line function is ~900 tokens
SAMPLED_TEMPERATURE = 0.7
LLAMA_CTX = 16384  # a slot's context: the 340-line file, its edit and an agent's history fit
REQUEST_TIMEOUT_S = 3600.0
COLUMNS = ("workload", "task", "turn", "mode", "engine", "prompt_tokens", "completion_tokens", "seconds",
           "tokens_per_s", "accepted_prediction_tokens", "rejected_prediction_tokens", "error")


@dataclass(frozen=True)
class Reply:
    """One engine's answer to one request.

    Attributes:
        seconds: wall seconds from sending the request to having the whole response.
        token_ids: the answer's token ids (ours, chat only), else None.
        prediction: ``usage.completion_tokens_details``' accepted and rejected prediction
            tokens, where the response has them.
        error: why the engine did not answer (our provider refusing ``prediction``), else None.
    """

    text: str | None
    tool_calls: tuple[tuple[str, str], ...]
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    token_ids: tuple[int, ...] | None = None
    prediction: tuple[int, int] | None = None
    error: str | None = None

    @property
    def answer(self) -> Answer:
        return Answer(self.text, self.tool_calls)

    @classmethod
    def of(cls, response, seconds: float) -> Reply:
        """From a LiteLLM ``ModelResponse`` or ``TextCompletionResponse`` of one choice."""
        choice = response.choices[0]
        message = getattr(choice, "message", None)
        calls = tuple((c.function.name, c.function.arguments) for c in (message.tool_calls or ())) if message else ()
        ids = getattr(choice, "token_ids", None)
        details = getattr(response.usage, "completion_tokens_details", None)
        accepted = getattr(details, "accepted_prediction_tokens", None)
        prediction = None if accepted is None else (accepted, details.rejected_prediction_tokens or 0)
        return cls(message.content if message else choice.text, calls, response.usage.prompt_tokens,
                   response.usage.completion_tokens, seconds, None if ids is None else tuple(ids), prediction)

    @classmethod
    def from_json(cls, data: dict) -> Reply:
        """The inverse of ``dataclasses.asdict`` through JSON (lists back to tuples)."""
        tuples = {"tool_calls": tuple(tuple(c) for c in data["tool_calls"]),
                  "token_ids": None if data["token_ids"] is None else tuple(data["token_ids"]),
                  "prediction": None if data["prediction"] is None else tuple(data["prediction"])}
        return cls(**(data | tuples))


def flm_send(tag: str, request: dict, sampler: dict) -> Reply:
    """``request`` (a ``Task`` request) with ``sampler`` to ``flm/<tag>`` through LiteLLM, timed;
    a chat asks for the answer's token ids. Our provider refusing ``prediction`` gives a Reply
    with ``error`` set.

    Raises:
        litellm.BadRequestError: any other refusal.
    """
    kwargs = {"model": PROVIDER_PREFIX + tag, "timeout": REQUEST_TIMEOUT_S, **request, **sampler}
    t0 = time.perf_counter()
    if "prompt" in request:
        response = litellm.text_completion(**kwargs)
    else:
        response = litellm.completion(**kwargs, extra_body={"return_token_ids": True})
    return Reply.of(response, time.perf_counter() - t0)


def llama_send(server: LlamaServer, fim_tokens: tuple[str, str, str] | None, request: dict,
               sampler: dict) -> Reply:
    """``request`` with ``sampler`` to ``server`` through LiteLLM, timed; a ``fim`` request as the
    text of its FIM prompt (``fim_prompt``)."""
    t0 = time.perf_counter()
    if "prompt" in request:
        assert fim_tokens is not None, "a fim request needs the model's FIM tokens"
        prompt = fim_prompt(fim_tokens, request["prompt"], request["suffix"])
        response = litellm.text_completion(**server.text_target, prompt=prompt, max_tokens=request["max_tokens"],
                                           timeout=REQUEST_TIMEOUT_S, **sampler)
    else:
        response = litellm.completion(**server.target, **request, timeout=REQUEST_TIMEOUT_S, **sampler)
    return Reply.of(response, time.perf_counter() - t0)


def fim_prompt(tokens: tuple[str, str, str], prefix: str, suffix: str) -> str:
    """The text of a fill-in-the-middle prompt in the order ``Tokenizer.encode_fim`` builds it:
    ``tokens`` are the texts of the model's FIM prefix, suffix and middle tokens."""
    return f"{tokens[0]}{prefix}{tokens[1]}{suffix}{tokens[2]}"


def fim_tokens_of(tag: str) -> tuple[str, str, str] | None:
    """The texts of ``tag``'s FIM prefix, suffix and middle tokens (its engine's tokenizer), or
    None when its vocabulary lacks one."""
    tokenizer = get_engine(tag).tokenizer
    fim = tokenizer.fim
    if fim.missing:
        return None
    return tuple(tokenizer.decode([i]) for i in (fim.prefix, fim.suffix, fim.middle))


class SpecOffWorker:
    """``flm_send`` in a process of its own started with ``FLM_SPECULATION=0``: one JSON line in
    (request, sampler), one out (the Reply, or the error that ended it); ``close`` ends it."""

    def __init__(self, tag: str, threads: int):
        env = thread_env(os.environ, threads, keep_openblas_env=True) | {"FLM_SPECULATION": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flm_bench.peer_workloads", tag], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, request: dict, sampler: dict) -> Reply:
        """Raises:
            RuntimeError: the worker failed (its error) or ended."""
        self.proc.stdin.write(json.dumps({"request": request, "sampler": sampler}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the FLM_SPECULATION=0 worker ended (exit status {self.proc.wait()})")
        data = json.loads(line)
        if "failed" in data:
            raise RuntimeError(f"the FLM_SPECULATION=0 worker: {data['failed']}")
        return Reply.from_json(data)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker(tag: str) -> int:
    """The ``FLM_SPECULATION=0`` process: ``flm_send`` each job read from stdin, its Reply (or
    ``{"failed": ...}``) to stdout, until stdin ends. Anything else printed goes to stderr."""
    channel, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        job = json.loads(line)
        try:
            out = dataclasses.asdict(flm_send(tag, job["request"], job["sampler"]))
        except Exception as e:  # noqa: BLE001 - the parent raises it with its message
            out = {"failed": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), file=channel, flush=True)
    return 0


# --- The run -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Result:
    """One engine's reply to one request of a conversation (``turn`` counts from 1)."""

    task: Task
    turn: int
    mode: str
    engine: str
    reply: Reply

    def row(self) -> dict:
        r = self.reply
        return {"workload": self.task.workload, "task": self.task.name, "turn": self.turn, "mode": self.mode,
                "engine": self.engine, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "seconds": f"{r.seconds:.4f}", "tokens_per_s": f"{r.completion_tokens / r.seconds:.3f}",
                "accepted_prediction_tokens": "" if r.prediction is None else r.prediction[0],
                "rejected_prediction_tokens": "" if r.prediction is None else r.prediction[1],
                "error": r.error or ""}


Send = Callable[[dict, dict], Reply]


def sampler_of(mode: str, seed: int) -> dict:
    """The sampling parameters of a request in ``mode`` (greedy or sampled)."""
    return {"temperature": 0.0} if mode == "greedy" else {"temperature": SAMPLED_TEMPERATURE, "seed": seed}


def converse(task: Task, mode: str, engines: dict[str, Send], seed: int, k: int, *,
             on_request=lambda: None) -> list[Result]:
    """Run ``task``'s conversation in ``mode`` on every engine of ``engines``, request by request,
    the order rotated by ``k`` + the turn; each engine's conversation goes on with its own answers
    until ``follow_up`` ends it (or the engine refused the request).

    Args:
        seed: the sampled mode's seed of the first turn (the next turns add one each).
        on_request: called after each request (progress).
    """
    names = list(engines)
    requests: dict[str, dict | None] = dict.fromkeys(names, task.request)
    results = []
    turn = 0
    while any(requests.values()):
        turn += 1
        shift = (k + turn) % len(names)
        for name in names[shift:] + names[:shift]:
            if requests[name] is None:
                continue
            reply = engines[name](requests[name], sampler_of(mode, seed + turn - 1))
            results.append(Result(task, turn, mode, name, reply))
            requests[name] = None if reply.error else workloads.follow_up(task, requests[name], reply.answer, turn)
            on_request()
    return results


def measure(jobs: list[tuple[Task, str]], engines: dict[str, Send], *, seed: int, quiet: bool) -> list[Result]:
    """Each (task, mode) of ``jobs`` on every engine (``converse``); conversation ``k`` starts at
    seed ``seed`` + 100 ``k``."""
    bar = tqdm(total=sum(t.max_requests for t, _ in jobs) * len(engines), desc="bench --workloads", unit="req",
               disable=quiet, file=sys.stderr)
    results = []
    for k, (task, mode) in enumerate(jobs):
        bar.set_postfix_str(f"{task.workload} {task.name} {mode}")
        done = converse(task, mode, engines, seed + 100 * k, k, on_request=bar.update)
        bar.update(len(engines) * task.max_requests - len(done))  # conversations that ended early
        results += done
    bar.close()
    return results


# --- The report ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One engine's replies in one workload and mode."""

    replies: list[Reply]

    @property
    def refused(self) -> str | None:
        """The first refusal's reason, if the engine refused any request."""
        return next((r.error for r in self.replies if r.error), None)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens / seconds over all the replies (0.0 over none)."""
        seconds = sum(r.seconds for r in self.replies)
        return sum(r.completion_tokens for r in self.replies) / seconds if seconds > 0 else 0.0

    def latency(self, q: float) -> float:
        """The ``q`` quantile (0.5: the median) of the replies' seconds, linearly interpolated."""
        return statistics.quantiles([r.seconds for r in self.replies], n=100, method="inclusive")[round(q * 100) - 1] \
            if len(self.replies) > 1 else self.replies[0].seconds

    def speed(self, fim: bool) -> float:
        """Higher is better: tokens/s, or for ``fim`` completions per second at the median."""
        return 1.0 / self.latency(0.5) if fim else self.tokens_per_s

    def label(self, fim: bool) -> str:
        if self.refused:
            return "not supported"
        return f"{self.latency(0.5):.3f} / {self.latency(0.9):.3f}" if fim else f"{self.tokens_per_s:.1f}"


def cells(results: list[Result]) -> dict[tuple[str, str, str], Cell]:
    """{(workload, mode, engine): Cell}."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.task.workload, r.mode, r.engine)].append(r.reply)
    return {key: Cell(group) for key, group in groups.items()}


def best_llama(by: dict, workload: str, mode: str, llamas: list[str]) -> str | None:
    """The llama-server configuration (engine name) fastest in ``workload`` and ``mode``."""
    fim = workload == "fim"
    present = [e for e in llamas if (workload, mode, e) in by]
    return max(present, key=lambda e: by[(workload, mode, e)].speed(fim)) if present else None


def ratio(by: dict, workload: str, mode: str, ours: str, theirs: str | None) -> float | None:
    """Our speed over theirs (``Cell.speed``: tokens/s; ``fim``: their median latency over ours);
    None where either has no figure."""
    a, b = by.get((workload, mode, ours)), by.get((workload, mode, theirs))
    if a is None or b is None or a.refused or b.refused:
        return None
    return a.speed(workload == "fim") / b.speed(workload == "fim")


def identical(results: list[Result], workload: str) -> str:
    """``"5 of 6"``: greedy requests of ``workload`` where flm and ``FLM_SPECULATION=0`` gave the
    same answer (token ids; the text where there are none, and the tool calls); ``—`` without
    both."""
    answers = defaultdict(dict)
    for r in results:
        if r.task.workload == workload and r.mode == "greedy" and r.engine in (FLM, FLM_OFF) and not r.reply.error:
            answers[(r.task.name, r.turn)][r.engine] = r.reply
    pairs = [(d[FLM], d[FLM_OFF]) for d in answers.values() if len(d) == 2]
    if not pairs:
        return "—"
    same = sum(a.token_ids == b.token_ids and a.answer == b.answer for a, b in pairs)
    return f"{same} of {len(pairs)}"


def tables(results: list[Result], names: list[str], modes: list[str], engines: list[str], tag: str,
           max_tokens: int, args: argparse.Namespace) -> list[str]:
    """The Markdown sections: the header, the table, the notes."""
    by = cells(results)
    llamas = [e for e in engines if e.startswith(LLAMA)]
    others = [e for e in engines if e != FLM]
    rows = []
    for name in names:
        for mode in modes:
            if (name, mode, FLM) not in by:
                continue
            best = best_llama(by, name, mode, llamas)
            vs_best = ratio(by, name, mode, FLM, best)
            vs_off = ratio(by, name, mode, FLM, FLM_OFF)
            row = [name, mode, len(by[(name, mode, FLM)].replies), by[(name, mode, FLM)].label(name == "fim")]
            row += [by[(name, mode, e)].label(name == "fim") if (name, mode, e) in by else "—" for e in others]
            if llamas:
                row.append("—" if vs_best is None else f"{vs_best:.2f}x ({best.removeprefix(LLAMA).strip()})")
            if FLM_OFF in engines:
                row += ["—" if vs_off is None else f"{vs_off:.2f}x", identical(results, name) if mode == "greedy"
                        else "—"]
            rows.append(row)
    header = ["Workload", "Mode", "Requests", f"`flm/{tag}`", *others]
    if llamas:
        header.append("flm / llama-server's best")
    if FLM_OFF in engines:
        header += ["flm / FLM_SPECULATION=0", "greedy identical"]
    table = report.markdown_table(header, rows)
    intro = (f"## Workloads through LiteLLM: `flm/{tag}` against llama-server\n\n"
             f"{args.requests} tasks per workload and mode (the sampled ones other than the greedy ones), at most "
             f"{max_tokens} completion tokens a request ({workloads.FIM_MAX_TOKENS} for fim), stopping at the end of "
             "the answer; a conversation's turns and fim's pauses each count as a request. End-to-end tokens/s: "
             "completion tokens / wall seconds from sending each request to its whole response (prefill "
             "included), over all requests of a row; fim: median / 90th-percentile seconds per completion, the "
             "ratio of medians (theirs / ours). Ratios above 1 favour flm.")
    notes = [f"Engines, every request on each in rotating order: {', '.join(f'`{e}`' for e in engines)}."]
    for e in llamas:
        config = e.removeprefix(LLAMA).strip()
        flags = " ".join(SPEC_CONFIGS[config])
        notes.append(f"`{e}`: " + (f"`{flags}`." if flags else "no speculation."))
    if llamas:
        notes.append(f"llama-server {args.llama_server}: `-t {args.threads} -tb {args.threads} --parallel 1 "
                     f"--ctx-size {LLAMA_CTX} --cache-prompt`, `cache_prompt: true`; fim requests as the text of "
                     "the FIM prompt our provider builds (its `/v1/completions` refuses `suffix`); `prediction` "
                     "sent and ignored.")
    notes.append(f"Sampled: temperature {SAMPLED_TEMPERATURE}, seeds from {args.seed}, the same on every engine.")
    refusals = sorted({c.refused for (_, _, e), c in by.items() if e in (FLM, FLM_OFF) and c.refused})
    notes += [f"flm refused: {reason}" for reason in refusals]
    accepted = [r.reply.prediction for r in results
                if r.engine == FLM and r.task.workload == "prediction" and r.reply.prediction]
    if accepted:
        notes.append(f"prediction: flm's `usage.completion_tokens_details` counted {sum(a for a, _ in accepted)} "
                     f"accepted and {sum(b for _, b in accepted)} rejected prediction tokens over {len(accepted)} "
                     "requests.")
    return [intro, table, "\n".join(f"- {n}" for n in notes)]


def plot(results: list[Result], names: list[str], modes: list[str], engines: list[str], path: Path) -> bool:
    """``peer_workloads.png``: per workload and mode, flm / llama-server's best (and flm /
    ``FLM_SPECULATION=0`` where it ran), bars, a grey line at 1. Returns False (after saying why)
    when matplotlib is not installed."""
    plt = report.pyplot(PROG_NAME)
    if plt is None:
        return False
    by = cells(results)
    llamas = [e for e in engines if e.startswith(LLAMA)]
    series = ([("flm / llama-server's best", lambda w, m: best_llama(by, w, m, llamas))] if llamas else [])
    series += [("flm / FLM_SPECULATION=0", lambda w, m: FLM_OFF)] if FLM_OFF in engines else []
    bars = [(f"{label}, {mode}", mode, pick) for label, pick in series for mode in modes]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(bars), 1)
    top = 1.0
    for j, (label, mode, pick) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(names))]
        values = [ratio(by, w, mode, FLM, pick(w, mode)) or 0.0 for w in names]
        top = max(top, *values)
        ax.bar(xs, values, width, label=label, color=f"C{j}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.15 * top)
    ax.set(ylabel="flm / other (end-to-end tokens/s;\nfim: median latency, theirs / ours)",
           title="Workloads through LiteLLM: flm against llama-server's best and against itself")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def command(args: argparse.Namespace, max_tokens: int) -> str:
    return report.command_text("bench", [
        ("--workloads", args.workloads), ("--tag", args.tag), ("--llama-server", args.llama_server),
        ("--llama-configs", args.llama_configs if args.llama_server else None), ("--threads", args.threads),
        ("--spec-off", args.spec_off), ("--requests", args.requests), ("--max-tokens", max_tokens),
        ("--modes", args.modes), ("--prompts", args.prompts), ("--seed", args.seed), ("--out", args.out)])


def parse_configs(text: str) -> list[str]:
    """``--llama-configs``: comma-separated names of ``SPEC_CONFIGS``.

    Raises:
        InvalidRequestError: another name, or none.
    """
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names or any(c not in SPEC_CONFIGS for c in names):
        raise InvalidRequestError(f"--llama-configs takes some of {', '.join(SPEC_CONFIGS)}, got {text!r}",
                                  param="--llama-configs")
    return names


def main(args: argparse.Namespace) -> int:
    """The run: check the options, build the tasks, start the engines, measure, write the files.

    Raises:
        InvalidRequestError: an option of the DFlash comparison or of the other tables, an unknown
            workload or configuration, ``fim`` on a tag without FIM tokens.
    """
    if args.draft or args.ceiling_curve or args.ceiling_min_run > 1 or args.quick or args.baseline_only \
            or args.no_ngram or args.contexts or args.stop_at_eos:
        raise InvalidRequestError("--workloads with --llama-server or --spec-off takes none of --draft, "
                                  "--ceiling-curve, --ceiling-min-run, --quick, --baseline-only, --no-ngram, "
                                  "--contexts, --stop-at-eos", param="--workloads")
    names = workloads.parse_workloads(args.workloads, workloads.PEER_WORKLOADS)
    modes = parse_modes(args.modes)
    configs = parse_configs(args.llama_configs) if args.llama_server else []
    max_tokens = args.max_tokens or PEER_MAX_TOKENS
    # Every engine gets the same threads; FLM_THREADS is read when the first engine starts.
    args.threads = args.threads or Settings.from_env().positive("threads") or default_threads()
    os.environ["FLM_THREADS"] = str(args.threads)
    fim_tokens = fim_tokens_of(args.tag) if "fim" in names else None
    if "fim" in names and fim_tokens is None:
        raise InvalidRequestError(f"fim needs a model with FIM tokens; {args.tag}'s vocabulary has none",
                                  param="--workloads")
    docs = load_documents(args.documents)
    n = args.requests
    jobs = []
    for name in names:
        tasks = workloads.build(name, n * len(modes), max_tokens=max_tokens, documents=docs, chat_prompts=args.prompts)
        jobs += [(task, mode) for j, mode in enumerate(modes) for task in tasks[j * n:(j + 1) * n]]
    info = report.machine_info()
    with ExitStack() as stack:
        engines: dict[str, Send] = {FLM: lambda request, sampler: flm_send(args.tag, request, sampler)}
        if args.spec_off:
            off = SpecOffWorker(args.tag, args.threads)
            stack.callback(off.close)
            engines[FLM_OFF] = off.send
        gguf = pull.locate(args.tag)
        for config in configs:
            server = stack.enter_context(LlamaServer(args.llama_server, gguf, args.threads, 1, LLAMA_CTX,
                                                     SPEC_CONFIGS[config]))
            engines[f"{LLAMA} {config}"] = (lambda s: lambda request, sampler: llama_send(s, fim_tokens, request,
                                                                                         sampler))(server)
        for send in engines.values():  # first-call costs (loading, compiling) are not the engines' speed
            send({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}, sampler_of("greedy", 0))
        results = measure(jobs, engines, seed=args.seed, quiet=args.quiet)
    out = report.output_dir(args.out)
    report.write_csv(out / "peer_workloads.csv", COLUMNS, (r.row() for r in results))
    sections = tables(results, names, modes, list(engines), args.tag, max_tokens, args)
    report.write_report(out / "peer_workloads.md", "Workloads against llama-server", command(args, max_tokens),
                        sections, info)
    written = ["peer_workloads.md", "peer_workloads.csv"]
    if not args.no_plot and plot(results, names, modes, list(engines), out / "peer_workloads.png"):
        written.append("peer_workloads.png")
    print(sections[1])
    print(f"{PROG_NAME}: wrote {', '.join(str(out / f) for f in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
