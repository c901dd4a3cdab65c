"""``litellm-flm soak``: requests through LiteLLM, counting tokens, requests, verify passes,
errors, stalls and the process's resident memory (a stability check).

Requests go through ``litellm.completion(model="flm/<tag>")`` (``litellm.text_completion`` for
fill-in-the-middle), the path a user's code takes, cycling through the kinds of a schedule
(``--schedule``):

- ``chat`` (``CHAT``): long generations (``--long-tokens``, 2048), short requests
  (``--short-tokens``), summaries of a ``--document-tokens`` excerpt of the shipped documents
  (long prompts, a new excerpt each time so that each is prefilled), structured output
  (``response_format`` with a JSON schema; a reply that ends with ``stop`` must parse and hold the
  schema's keys), and streams the client closes after ``--cancel-after`` chunks (``ignore_eos``,
  so that each is still generating when it is cancelled);
- ``coding`` (``CODING``), what a coding assistant sends (``flm_bench.workloads``' tasks): edits
  that return a whole function (``--long-tokens``), fill-in-the-middle completions with a suffix
  while a function is typed (each pause one request), tool calls with their results fed back
  (each round one request), structured output and closed streams as above.

Most are streamed, some are not; greedy and sampled alternate, sampled ones with the model's
default sampler and seeds ``--seed`` and up. ``--concurrency`` clients send at once, each one
request (or conversation) after the other. The soak goes on until it has run ``--min-requests``
requests *and* delivered ``--min-tokens`` completion tokens (or reached ``--max-requests``).

Per request:

- **tokens**: ``usage.completion_tokens`` (tokens delivered; 0 for a cancelled stream, which gets
  no final usage);
- **verify passes**: the 8-token checks of speculative steps, from ``usage.completion_tokens_details``
  (accepted + rejected drafted tokens over K, rounded up, K = block size - 1: a pass verifies at
  most K, fewer where the confidence gate cut the draft or a suffix proposal was shorter, so the
  count is a lower bound);
- **error**: any exception out of LiteLLM, or structured output that does not parse (the request
  still counts);
- **stall**: a gap of more than ``--stall-s`` seconds without a token: from the request's start to
  its first chunk with text or a tool call's part, between two such chunks, or from the last one to
  the end of the stream (``StallWatch``); for a request that is not streamed, the same gaps as the
  engine measured them (``flm_stats``: ``engine_gaps``);
- **resident memory**: the process's resident set after the request (``/proc/self/statm``).

The run passes with zero errors, zero stalls, both minimums reached, the engine left with no running
sequence, queued request or KV block held and every closed stream counted as cancelled by the
engine, and resident memory over the last quarter of the requests at most ``--max-rss-growth``
(5%) above the first quarter's. Its exit status is 0 only then. Files in ``--out``: ``soak.md``
(summary, the command, the machine) and ``soak.csv`` (one row per request).

``flm_runtime`` never imports LiteLLM, nor this package: ``litellm-flm`` finds the command through
the entry point ``soak`` of the group ``litellm_flm.commands`` (``COMMAND``; see ``flm_runtime.cli``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import litellm
import litellm_flm  # noqa: F401 - registers the flm/ provider with LiteLLM
from tqdm import tqdm

from flm_bench import documents, report, workloads
from flm_bench.options import positive_int
from flm_runtime import InvalidRequestError, default_runtime, get_engine
from flm_runtime import paths, registry
from flm_runtime.cli import Command
from flm_runtime.settings import variable

PROVIDER_PREFIX = "flm/"


@dataclass(frozen=True)
class Kind:
    """One entry of a schedule: what a request asks and how it is read."""

    name: str     # chat: long, short, document; coding: edit, fim, agent; both: structured, cancelled
    mode: str     # greedy or sampled
    stream: bool


# Successive requests, cycled: every kind in both modes over the cycle but the document and
# cancelled ones (one each), two of eight not streamed.
CHAT = (
    Kind("long", "greedy", True), Kind("short", "sampled", False), Kind("document", "greedy", True),
    Kind("structured", "sampled", True), Kind("long", "sampled", True), Kind("cancelled", "sampled", True),
    Kind("structured", "greedy", False), Kind("short", "greedy", True),
)
# A coding assistant's requests: the edits, completions and tool rounds in both modes, streamed and not.
CODING = (
    Kind("edit", "greedy", True), Kind("fim", "sampled", False), Kind("agent", "greedy", True),
    Kind("structured", "sampled", True), Kind("edit", "sampled", False), Kind("cancelled", "sampled", True),
    Kind("fim", "greedy", True), Kind("agent", "sampled", False),
)
SCHEDULES = {"chat": CHAT, "coding": CODING}
LONG_PROMPTS = (
    "Write a detailed, long essay on the history of the printing press and how it changed Europe.",
    "Write a long story about a family of sailors over three generations, with many chapters.",
    "Explain in great detail how a modern computer works, from transistors up to operating systems.",
    "Write a complete travel guide to a fictional island: its history, towns, food, walks and festivals.",
)
SHORT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
)
STRUCTURED_PROMPTS = (
    "Describe a famous city: its name, its country and roughly how many people live there.",
    "Describe a well-known book: its title, its author and the year it came out.",
    "Describe a river: its name, the country where it ends and its length in kilometres.",
)
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "number": {"type": "integer"}},
    "required": ["name", "country", "number"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "facts", "schema": STRUCTURED_SCHEMA}}
# Where successive document excerpts start, in tokens: far enough apart that no two share a prefix.
DOCUMENT_STRIDE = 331


class StallWatch:
    """The gaps between tokens of one request, against a threshold.

    ``start()`` when the request is sent, ``mark()`` at each token (content chunk) and once more at
    the end of the stream; or, for an answer that was not streamed, ``gap(s)`` with each gap the
    engine measured (``engine_gaps``). Every gap over ``threshold_s`` is one stall.

    Args:
        threshold_s: seconds without a token that make a stall.
        clock: monotonic seconds (a fake one in tests).
    """

    def __init__(self, threshold_s: float, clock: Callable[[], float] = time.monotonic):
        self.threshold_s = threshold_s
        self.clock = clock
        self.last: float | None = None
        self.max_gap = 0.0
        self.stalls = 0

    def start(self) -> None:
        self.last = self.clock()

    def mark(self) -> float:
        """Record a token (or the end) now; returns the gap since the previous mark, seconds."""
        assert self.last is not None, "start() first"
        now = self.clock()
        gap, self.last = now - self.last, now
        return self.gap(gap)

    def gap(self, seconds: float) -> float:
        """Record one gap of ``seconds`` without a token; returns it."""
        self.max_gap = max(self.max_gap, seconds)
        self.stalls += seconds > self.threshold_s
        return seconds


def engine_gaps(stats: dict, elapsed_s: float) -> tuple[float, float, float]:
    """The gaps without a token of a request that was not streamed, from the engine's own clock
    (``flm_stats``: ``ttft_s``, ``max_gap_s``, ``decode_tokens_per_s``' parts, ``total_s``):
    before its first token (the time outside the engine counted here too: ``elapsed_s``, the
    client's, less the engine's ``total_s``), the longest between two tokens, and after the last.
    A client that does not stream sees one gap, start to answer, however steadily the tokens came.
    """
    ttft = stats.get("ttft_s")
    outside = max(0.0, elapsed_s - stats["total_s"])
    if ttft is None:  # no token generated: the whole request is one gap
        return elapsed_s, 0.0, 0.0
    decode = stats["generated_tokens"] - 1
    decode_s = decode / stats["decode_tokens_per_s"] if decode > 0 and stats["decode_tokens_per_s"] else 0.0
    return outside + ttft, stats["max_gap_s"], max(0.0, stats["total_s"] - ttft - decode_s)


def watch_stream(chunks: Iterable, watch: StallWatch, has_token: Callable[[object], bool]) -> Iterator:
    """Yield ``chunks``, marking ``watch`` at each one that carries a token and at the end."""
    watch.start()
    for chunk in chunks:
        if has_token(chunk):
            watch.mark()
        yield chunk
    watch.mark()


@dataclass
class Result:
    """One request of the soak (a CSV row)."""

    index: int
    kind: str
    mode: str
    stream: bool
    max_tokens: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    verify_passes: int = 0
    accepted_tokens: int = 0
    ttft_s: float = 0.0
    max_gap_s: float = 0.0
    stalls: int = 0
    seconds: float = 0.0
    rss_mb: float = 0.0
    error: str = ""


COLUMNS = tuple(f.name for f in fields(Result))


@dataclass(frozen=True)
class Plan:
    """What one request sends: its kind, its LiteLLM keyword arguments (``messages``, or ``prompt``
    and ``suffix`` for a text completion; the sampler and the limits) and what comes after it.

    Attributes:
        cancel_after: for a stream the client closes, the content chunks read before closing it
            (0: read to the end).
        task: the workload task of a coding request (``workloads.Task``), whose conversation
            ``workloads.follow_up`` goes on with (a fill-in-the-middle pause, a tool round), or None.
        answered: requests of ``task``'s conversation answered before this one.
    """

    kind: Kind
    request: dict
    cancel_after: int = 0
    task: workloads.Task | None = None
    answered: int = 0

    def next(self, answer: workloads.Answer) -> Plan | None:
        """The request after this one got ``answer`` in its conversation, or None."""
        if self.task is None:
            return None
        sampler = {k: v for k, v in self.request.items() if k in SAMPLER_KEYS}
        sent = {k: v for k, v in self.request.items() if k not in SAMPLER_KEYS}
        nxt = workloads.follow_up(self.task, sent, answer, self.answered + 1)
        return None if nxt is None else Plan(self.kind, nxt | sampler, task=self.task, answered=self.answered + 1)


SAMPLER_KEYS = ("temperature", "top_p", "top_k", "seed")


def _text(chunk) -> str:
    """The text a stream chunk carries: a chat chunk's ``delta.content``, a text completion's ``text``."""
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    delta = getattr(choices[0], "delta", None)
    return (delta.content or "") if delta is not None else (getattr(choices[0], "text", None) or "")


def _has_token(chunk) -> bool:
    """A chunk that carries text or a tool call's part: a token reached the client."""
    choices = getattr(chunk, "choices", None) or []
    delta = getattr(choices[0], "delta", None) if choices else None
    return bool(_text(chunk) or (delta is not None and getattr(delta, "tool_calls", None)))


def _answer(response) -> workloads.Answer:
    """What ``workloads.follow_up`` reads of a response: its text and its tool calls."""
    choice = response.choices[0]
    message = getattr(choice, "message", None)
    if message is None:  # a text completion
        return workloads.Answer(getattr(choice, "text", None))
    calls = tuple((c.function.name, c.function.arguments) for c in (getattr(message, "tool_calls", None) or ()))
    return workloads.Answer(message.content, calls)


def one_request(model: str, plan: Plan, result: Result, *, stall_s: float, timeout: float, block_drafts: int,
                clock: Callable[[], float] = time.monotonic, completion: Callable = litellm.completion,
                text_completion: Callable = litellm.text_completion) -> workloads.Answer | None:
    """Send one request through LiteLLM (``text_completion`` where ``plan.request`` has a
    ``prompt``, else ``completion``) and fill ``result``; returns the answer (None after an error
    or a closed stream).

    A streamed request is read chunk by chunk (``StallWatch`` at each chunk that carries a token),
    or closed after ``plan.cancel_after`` content chunks (``finish_reason`` "cancelled"); one that
    is not streamed is judged by the engine's clock (``engine_gaps``). A streamed answer is rebuilt
    with ``litellm.stream_chunk_builder`` for its tool calls. Structured output (``response_format``) that ends with ``stop`` must
    parse as a JSON object holding the schema's required keys, or is an error.

    Args:
        block_drafts: K, tokens drafted per verify pass (0 for a plain model).
    """
    watch = StallWatch(stall_s, clock)
    send = text_completion if "prompt" in plan.request else completion
    t0 = clock()
    first = None
    answer = None
    try:
        if not plan.kind.stream:
            response = send(model=model, stream=False, timeout=timeout, **plan.request)
            first = clock()
            for gap in engine_gaps(response._hidden_params["flm_stats"], first - t0):
                watch.gap(gap)
            answer = _answer(response)
            result.finish_reason = response.choices[0].finish_reason or ""
            _take_usage(result, response.usage, block_drafts)
        else:
            stream = send(model=model, stream=True, stream_options={"include_usage": True}, timeout=timeout,
                          **plan.request)
            chunks, texts = [], 0
            for chunk in watch_stream(stream, watch, _has_token):
                chunks.append(chunk)
                if _has_token(chunk):
                    first = first if first is not None else clock()
                if _text(chunk):
                    texts += 1
                    if texts == plan.cancel_after:
                        stream.close()  # the client goes away mid-generation
                        result.finish_reason = "cancelled"
                        break
                if getattr(chunk, "choices", None) and chunk.choices[0].finish_reason:
                    result.finish_reason = chunk.choices[0].finish_reason
                usage = getattr(chunk, "usage", None)
                if usage:
                    _take_usage(result, usage, block_drafts)
            if result.finish_reason != "cancelled":
                # the tool calls of a streamed answer, for the next round: rebuilt as LiteLLM rebuilds a stream
                answer = _answer(litellm.stream_chunk_builder(chunks)) if "tools" in plan.request else \
                    workloads.Answer("".join(_text(c) for c in chunks))
        if "response_format" in plan.request and result.finish_reason == "stop":
            _check_structured(answer.content or "")
    except Exception as e:  # noqa: BLE001 - every failure is counted, the soak goes on
        result.error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        answer = None
    result.seconds = clock() - t0
    result.ttft_s = (first - t0) if first is not None else 0.0
    result.max_gap_s, result.stalls = watch.max_gap, watch.stalls
    return answer


def _check_structured(text: str) -> None:
    """Raises ``ValueError`` unless ``text`` is a JSON object with the schema's required keys."""
    value = json.loads(text)
    missing = [k for k in STRUCTURED_SCHEMA["required"] if not isinstance(value, dict) or k not in value]
    if missing:
        raise ValueError(f"structured output {text[:80]!r} lacks {missing}")


def _take_usage(result: Result, usage, block_drafts: int) -> None:
    result.prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
    result.completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
    details = getattr(usage, "completion_tokens_details", None)
    accepted = int(getattr(details, "accepted_prediction_tokens", 0) or 0) if details else 0
    rejected = int(getattr(details, "rejected_prediction_tokens", 0) or 0) if details else 0
    result.accepted_tokens = accepted
    result.verify_passes = -(-(accepted + rejected) // block_drafts) if block_drafts else 0  # rounded up


# The coding tasks, each kind's every distinct one (``workloads.build`` says how many its data holds).
CODING_TASKS = {"edit": ("code-edit", 14), "fim": ("fim", 7), "agent": ("agent", 8)}


def coding_tasks(long_tokens: int, short_tokens: int) -> dict[str, list[workloads.Task]]:
    """The tasks of ``CODING``'s workload kinds, cycled by ``request_plan``: edits asked up to
    ``long_tokens``, completions and tool rounds up to ``short_tokens`` (a completion at most
    ``workloads.FIM_MAX_TOKENS``)."""
    limits = {"edit": long_tokens, "fim": short_tokens, "agent": short_tokens}
    return {kind: workloads.build(workload, n, max_tokens=limits[kind], documents=())
            for kind, (workload, n) in CODING_TASKS.items()}


def request_plan(i: int, args: argparse.Namespace, defaults, excerpt: Callable[[int], str],
                 tasks: dict[str, list[workloads.Task]]) -> Plan:
    """The request ``i`` of the soak's schedule (``args.schedule``), the first of its conversation.

    Args:
        defaults: the model's default sampler (``SamplingDefaults``), for the sampled requests.
        excerpt: ``excerpt(j)``, the text of the ``j``-th document excerpt.
        tasks: the coding tasks (``coding_tasks``).
    """
    schedule = SCHEDULES[args.schedule]
    kind = schedule[i % len(schedule)]
    turn = i // len(schedule)
    request: dict = {"max_tokens": args.short_tokens}
    cancel_after, task = 0, None
    if kind.name in tasks:
        task = tasks[kind.name][turn % len(tasks[kind.name])]
        request = dict(task.request)
    elif kind.name == "long":
        request |= {"messages": _user(LONG_PROMPTS[turn % len(LONG_PROMPTS)]), "max_tokens": args.long_tokens}
    elif kind.name == "short":
        request["messages"] = _user(SHORT_PROMPTS[turn % len(SHORT_PROMPTS)])
    elif kind.name == "document":
        request["messages"] = _user(documents.SUMMARY_INSTRUCTION + excerpt(turn))
    elif kind.name == "structured":
        request |= {"messages": _user(STRUCTURED_PROMPTS[turn % len(STRUCTURED_PROMPTS)]),
                    "response_format": RESPONSE_FORMAT}
    else:  # cancelled: a long generation, or in the coding schedule an edit
        messages = (tasks["edit"][turn % len(tasks["edit"])].request["messages"] if args.schedule == "coding"
                    else _user(LONG_PROMPTS[turn % len(LONG_PROMPTS)]))
        request |= {"messages": messages, "max_tokens": args.long_tokens, "ignore_eos": True}
        cancel_after = args.cancel_after
    if kind.mode == "greedy":
        request["temperature"] = 0.0
    else:
        request |= {"temperature": defaults.temperature, "top_p": defaults.top_p, "seed": args.seed + i}
        if defaults.top_k:
            request["top_k"] = defaults.top_k
    return Plan(kind, request, cancel_after, task)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def document_excerpts(tokenizer, n_tokens: int) -> Callable[[int], str]:
    """``excerpt(j)``: ``n_tokens`` tokens of the shipped documents, read one after the other,
    starting ``j * DOCUMENT_STRIDE`` tokens in (wrapping around)."""
    ids = [t for d in documents.load_documents() for t in tokenizer.encode(d.text)]
    if n_tokens > len(ids):
        raise InvalidRequestError(f"--document-tokens {n_tokens} is more than the shipped documents' {len(ids)} "
                                  "tokens", param="--document-tokens")

    def excerpt(j: int) -> str:
        start = j * DOCUMENT_STRIDE % (len(ids) - n_tokens + 1)
        return tokenizer.decode(ids[start:start + n_tokens])
    return excerpt


def resident_mb() -> float:
    """The process's resident set in MiB (``/proc/self/statm``), 0.0 where there is none."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def draft_models_file(tag: str, draft: str | Path):
    """For the duration: ``FLM_MODELS_FILE`` names a temporary models file that maps DFlash ``tag``
    to the ``draft`` directory and keeps every entry of the user's own models file (their paths
    made absolute by the registry). The tag's engine is dropped on entry and on exit, so that the
    run serves ``draft`` and nothing after it does."""
    entry = registry.resolve(tag)
    if not entry.is_dflash:
        raise InvalidRequestError(f"--draft needs a DFlash model (X-dflash:size); {tag} is not one",
                                  param="--draft")
    user = paths.models_file()
    specs = {}
    if user.is_file():
        origin = f"models file {user}"
        specs = {e.tag: e.model_dump(mode="json", exclude={"tag", "origin"}, exclude_none=True)
                 for e in registry.list_entries() if e.origin == origin}
    specs[entry.tag] = {"base": entry.base, "draft": str(Path(draft).expanduser().resolve())}
    models_file = variable("models_file")  # FLM_MODELS_FILE
    old = os.environ.get(models_file)
    with tempfile.TemporaryDirectory(prefix="flm-soak-") as tmp:
        path = Path(tmp) / "models.json"  # JSON is YAML
        path.write_text(json.dumps(specs, indent=2), encoding="utf-8")
        os.environ[models_file] = str(path)
        registry.reload()
        default_runtime.forget(entry.tag)
        try:
            yield path
        finally:
            if old is None:
                os.environ.pop(models_file, None)
            else:
                os.environ[models_file] = old
            registry.reload()
            default_runtime.forget(entry.tag)


def main(args: argparse.Namespace) -> int:
    if not args.model.startswith(PROVIDER_PREFIX):
        raise InvalidRequestError(f"--model must be a LiteLLM model name flm/<tag>, got {args.model!r}",
                                  param="--model")
    tag = args.model[len(PROVIDER_PREFIX):]
    with draft_models_file(tag, args.draft) if args.draft else contextlib.nullcontext():
        return soak(args, tag)


def soak(args: argparse.Namespace, tag: str) -> int:
    engine = get_engine(tag)  # load (and fail) before the clock starts; LiteLLM gets this same engine
    block_drafts = engine.speculative.block_size - 1 if engine.speculative is not None else 0
    excerpt = document_excerpts(engine.tokenizer, args.document_tokens)
    tasks = coding_tasks(args.long_tokens, args.short_tokens) if args.schedule == "coding" else {}
    info = report.machine_info()
    cancelled_before = engine.stats()["cancelled"]
    results: list[Result] = []
    lock = threading.Lock()
    counts = {"sent": 0, "conversations": 0, "tokens": 0}
    bar = tqdm(total=args.min_tokens, desc="soak", unit="tok", disable=args.quiet, file=sys.stderr)

    def wanted() -> bool:
        """Another request is to be sent (under ``lock``)."""
        return counts["sent"] < args.max_requests and (len(results) < args.min_requests
                                                        or counts["tokens"] < args.min_tokens)

    def client() -> None:
        """One client: conversations one after the other (a conversation's requests in turn) while
        the soak wants requests."""
        while True:
            with lock:
                if not wanted():
                    return
                plan = request_plan(counts["conversations"], args, engine.default_sampling, excerpt, tasks)
                counts["conversations"] += 1
            while plan is not None:
                with lock:
                    if not wanted():
                        return
                    counts["sent"] += 1
                    r = Result(counts["sent"], plan.kind.name, plan.kind.mode, plan.kind.stream,
                               plan.request["max_tokens"])
                answer = one_request(args.model, plan, r, stall_s=args.stall_s, timeout=args.timeout,
                                     block_drafts=block_drafts)
                r.rss_mb = resident_mb()
                with lock:
                    results.append(r)
                    counts["tokens"] += r.completion_tokens
                    bar.update(min(r.completion_tokens, max(args.min_tokens - bar.n, 0)))
                    bar.set_postfix_str(f"req {len(results)}, {r.kind} {r.mode}, errors "
                                        f"{sum(bool(x.error) for x in results)}, stalls {sum(x.stalls for x in results)}")
                plan = plan.next(answer) if answer is not None else None

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency, thread_name_prefix="soak-client") as pool:
        for done in [pool.submit(client) for _ in range(args.concurrency)]:
            done.result()  # a client's own bug is raised, not counted
    bar.close()
    wall = time.monotonic() - t0
    results.sort(key=lambda r: r.index)
    left = engine_left(engine, cancelled_before, sum(r.finish_reason == "cancelled" for r in results))
    out = report.output_dir(args.out)
    report.write_csv(out / "soak.csv", COLUMNS, (asdict(r) for r in results))
    ok, sections = summary(args, results, wall, left)
    report.write_report(out / "soak.md", "Stability (soak)", command(args), sections, info)
    print(sections[1])
    print(f"litellm-flm soak: {'PASS' if ok else 'FAIL'}; wrote {out / 'soak.md'}, {out / 'soak.csv'}")
    return 0 if ok else 1


def engine_left(engine, cancelled_before: int, closed: int, timeout: float = 30.0) -> list[str]:
    """What the soak left in ``engine`` once it is idle (waits up to ``timeout`` s for the closed
    streams' cancellations to land): running or queued sequences, KV blocks held, and closed
    streams the engine did not count as cancelled. Empty when nothing is left."""
    end = time.monotonic() + timeout
    while (stats := engine.stats())["active"] + stats["queued"] and time.monotonic() < end:
        time.sleep(0.05)
    cancelled = stats["cancelled"] - cancelled_before
    left = [f"{stats[k]} {what}" for k, what in (("active", "running sequence(s)"), ("queued", "queued sequence(s)"),
                                                  ("kv_blocks_used", "KV block(s) held")) if stats[k]]
    if cancelled != closed:
        left.append(f"{closed} stream(s) closed by the client but {cancelled} request(s) cancelled in the engine")
    return left


def rss_growth(results: list[Result]) -> float:
    """Mean resident memory of the last quarter of ``results`` over the first quarter's, minus 1
    (0.0 without a reading)."""
    quarter = max(len(results) // 4, 1)
    first = sum(r.rss_mb for r in results[:quarter]) / quarter
    last = sum(r.rss_mb for r in results[-quarter:]) / quarter
    return last / first - 1.0 if first else 0.0


def summary(args: argparse.Namespace, results: list[Result], wall: float, left: list[str]) -> tuple[bool, list[str]]:
    """(passed, Markdown sections)."""
    tokens = sum(r.completion_tokens for r in results)
    errors = [r for r in results if r.error]
    stalls = sum(r.stalls for r in results)
    passes = sum(r.verify_passes for r in results)
    cancelled = sum(r.finish_reason == "cancelled" for r in results)
    growth = rss_growth(results)
    quarter = max(len(results) // 4, 1)
    ok = (not errors and not stalls and not left and growth <= args.max_rss_growth
          and len(results) >= args.min_requests and tokens >= args.min_tokens)
    kinds: dict[tuple, list[int]] = {}
    for r in results:
        k = kinds.setdefault((r.kind, r.mode, "streamed" if r.stream else "not streamed"), [0, 0, 0, 0])
        k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + r.completion_tokens, k[2] + r.verify_passes, k[3] + bool(r.error)
    kinds_sent = (f"{args.long_tokens}-token generations, {args.short_tokens}-token answers, summaries of "
                  f"{args.document_tokens}-token excerpts, structured output" if args.schedule == "chat" else
                  f"edits returning a whole function (up to {args.long_tokens} tokens), fill-in-the-middle "
                  f"completions with a suffix, tool calls with their results fed back, structured output")
    line = (f"{tokens:,} tokens over {len(results)} requests through LiteLLM from {args.concurrency} client(s) "
            f"(`{args.model}`, the {args.schedule} schedule: {kinds_sent}, {cancelled} streams closed after "
            f"{args.cancel_after} chunks; greedy and sampled, streamed and not) and {passes:,} verify passes in one "
            f"session: {len(errors)} error(s), {stalls} stall(s) (a stall: more than {args.stall_s:g} s without a "
            f"token), resident memory {growth:+.1%} from the first to the last quarter.")
    table = report.markdown_table(
        ["Requests", "Completion tokens", "Verify passes", "Cancelled", "Errors", f"Stalls (> {args.stall_s:g} s)",
         "Longest gap between tokens", "Resident memory, first / last quarter", "Wall time"],
        [[len(results), f"{tokens:,}", f"{passes:,}", cancelled, len(errors), stalls,
          f"{max((r.max_gap_s for r in results), default=0):.2f} s",
          f"{sum(r.rss_mb for r in results[:quarter]) / quarter:,.0f} / "
          f"{sum(r.rss_mb for r in results[-quarter:]) / quarter:,.0f} MiB ({growth:+.1%})", f"{wall / 60:.1f} min"]])
    per_kind = report.markdown_table(
        ["Kind", "Mode", "Streamed", "Count", "Completion tokens", "Verify passes", "Errors"],
        [[*k, *v] for k, v in kinds.items()])
    notes = [f"Result: {'PASS' if ok else 'FAIL'} (zero errors and stalls, nothing left in the engine, resident "
             f"memory at most {args.max_rss_growth:.0%} above the first quarter's, at least {args.min_requests} "
             f"requests and {args.min_tokens:,} tokens).", "Draft: " + (args.draft or "the model's own") + "."]
    notes += [f"left in the engine: {x}" for x in left]
    notes += [f"request {r.index}: {r.error}" for r in errors[:10]]
    return ok, [f"## Stability\n\n{line}", table, per_kind, "\n".join(f"- {n}" for n in notes)]


def command(args: argparse.Namespace) -> str:
    return report.command_text("soak", [
        ("--model", args.model), ("--draft", args.draft), ("--schedule", args.schedule),
        ("--concurrency", args.concurrency), ("--min-requests", args.min_requests),
        ("--min-tokens", args.min_tokens), ("--max-requests", args.max_requests),
        ("--long-tokens", args.long_tokens), ("--short-tokens", args.short_tokens),
        ("--document-tokens", args.document_tokens), ("--cancel-after", args.cancel_after), ("--stall-s", args.stall_s),
        ("--max-rss-growth", args.max_rss_growth),
        ("--timeout", args.timeout), ("--seed", args.seed), ("--out", args.out)])


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``litellm-flm soak``."""
    p.add_argument("--model", default="flm/smollm2-dflash:135m",
                   help="the LiteLLM model to soak (default flm/smollm2-dflash:135m)")
    p.add_argument("--draft", metavar="DIR",
                   help="serve the model's DFlash tag with this draft directory for the run (through a "
                        "temporary models file that keeps your own entries)")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="chat",
                   help="the kinds of requests: chat (long and short answers, summaries, structured output, "
                        "closed streams) or coding (whole-function edits, fill-in-the-middle, tool rounds, "
                        "structured output, closed streams); default chat")
    p.add_argument("--concurrency", type=positive_int, default=1,
                   help="clients sending at once, each one request after the other (default 1)")
    p.add_argument("--min-requests", type=int, default=200, help="run at least this many requests (default 200)")
    p.add_argument("--min-tokens", type=int, default=100_000,
                   help="and at least this many completion tokens (default 100000)")
    p.add_argument("--max-requests", type=int, default=1000,
                   help="stop after this many requests even if --min-tokens is not reached (default 1000)")
    p.add_argument("--long-tokens", type=int, default=2048, help="max_tokens of the long requests (default 2048)")
    p.add_argument("--short-tokens", type=int, default=128,
                   help="max_tokens of the short, summary and structured requests (default 128)")
    p.add_argument("--document-tokens", type=int, default=1536,
                   help="tokens of document in each summary request's prompt (default 1536)")
    p.add_argument("--cancel-after", type=int, default=32,
                   help="content chunks read before the client closes a cancelled stream (default 32)")
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="most resident memory growth from the first to the last quarter, a fraction (default 0.05)")
    p.add_argument("--stall-s", type=float, default=10.0,
                   help="a stall: no token for more than this many seconds (default 10)")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout in seconds (default 900)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first sampled request (default 0)")
    p.add_argument("--out", default="flm-bench", metavar="DIR", help="where the files go (default ./flm-bench)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


# The subcommand ``litellm-flm soak`` (entry point ``soak`` of the group ``litellm_flm.commands``).
COMMAND = Command("soak", "requests through LiteLLM: tokens, requests, verify passes, errors, stalls, memory",
                  main, arguments)
