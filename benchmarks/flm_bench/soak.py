"""``litellm-flm soak``: back-to-back requests through LiteLLM, counting tokens, requests, verify
passes, errors, stalls and the process's resident memory (a stability check).

Requests go one after the other through ``litellm.completion(model="flm/<tag>")``, the path a user's
code takes, cycling through the kinds of ``SCHEDULE``: long generations (``--long-tokens``, 2048),
short requests (``--short-tokens``), summaries of a ``--document-tokens`` excerpt of the shipped
documents (long prompts, a new excerpt each time so that each is prefilled), structured output
(``response_format`` with a JSON schema; a reply that ends with ``stop`` must parse and hold the
schema's keys), and streams the client closes after ``--cancel-after`` chunks (``ignore_eos``, so
that each is still generating when it is cancelled). Most are streamed, some are not; greedy and
sampled alternate, sampled ones with the model's default sampler and seeds ``--seed`` and up. The
soak goes on until it has run ``--min-requests`` requests *and* delivered ``--min-tokens``
completion tokens (or reached ``--max-requests``).

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
  its first content chunk, between two content chunks, or from the last one to the end of the
  stream (``StallWatch``); a request that is not streamed is one gap, start to answer;
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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import litellm
import litellm_flm  # noqa: F401 - registers the flm/ provider with LiteLLM
from tqdm import tqdm

from flm_bench import documents, report
from flm_runtime import InvalidRequestError, default_runtime, get_engine
from flm_runtime import paths, registry
from flm_runtime.cli import Command
from flm_runtime.settings import variable

PROVIDER_PREFIX = "flm/"


@dataclass(frozen=True)
class Kind:
    """One entry of the schedule: what a request asks and how it is read."""

    name: str     # long, short, document, structured, cancelled
    mode: str     # greedy or sampled
    stream: bool


# Successive requests, cycled: every kind in both modes over the cycle but the document and
# cancelled ones (one each), two of eight not streamed.
SCHEDULE = (
    Kind("long", "greedy", True), Kind("short", "sampled", False), Kind("document", "greedy", True),
    Kind("structured", "sampled", True), Kind("long", "sampled", True), Kind("cancelled", "sampled", True),
    Kind("structured", "greedy", False), Kind("short", "greedy", True),
)
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
    """The gaps between tokens of one stream, against a threshold.

    ``start()`` when the request is sent, ``mark()`` at each token (content chunk) and once more at
    the end of the stream; every gap over ``threshold_s`` is one stall.

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
        self.max_gap = max(self.max_gap, gap)
        self.stalls += gap > self.threshold_s
        return gap


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
    """What request ``i`` sends: its kind, its messages and its LiteLLM parameters.

    ``cancel_after``: for a stream the client closes, the content chunks read before closing it
    (0: read to the end).
    """

    kind: Kind
    messages: list[dict]
    params: dict
    cancel_after: int = 0


def _content(chunk) -> str:
    choices = getattr(chunk, "choices", None) or []
    return (choices[0].delta.content or "") if choices else ""


def one_request(completion: Callable, model: str, plan: Plan, result: Result, *, stall_s: float, timeout: float,
                block_drafts: int, clock: Callable[[], float] = time.monotonic) -> Result:
    """Send one request through ``completion`` (``litellm.completion``) and fill ``result``.

    A streamed request is read chunk by chunk (``StallWatch`` at each content chunk), or closed
    after ``plan.cancel_after`` content chunks (``finish_reason`` "cancelled"); one that is not
    streamed is a single gap. Structured output (``response_format`` in ``plan.params``) that ends
    with ``stop`` must parse as a JSON object holding the schema's required keys, or is an error.

    Args:
        block_drafts: K, tokens drafted per verify pass (0 for a plain model).
    """
    watch = StallWatch(stall_s, clock)
    t0 = clock()
    first = None
    text = []
    try:
        if not plan.kind.stream:
            watch.start()
            response = completion(model=model, messages=plan.messages, stream=False, timeout=timeout, **plan.params)
            watch.mark()
            first = clock()
            text.append(response.choices[0].message.content or "")
            result.finish_reason = response.choices[0].finish_reason or ""
            _take_usage(result, response.usage, block_drafts)
        else:
            stream = completion(model=model, messages=plan.messages, stream=True,
                                stream_options={"include_usage": True}, timeout=timeout, **plan.params)
            for chunk in watch_stream(stream, watch, lambda c: bool(_content(c))):
                if content := _content(chunk):
                    first = first if first is not None else clock()
                    text.append(content)
                    if len(text) == plan.cancel_after:
                        stream.close()  # the client goes away mid-generation
                        result.finish_reason = "cancelled"
                        break
                if getattr(chunk, "choices", None) and chunk.choices[0].finish_reason:
                    result.finish_reason = chunk.choices[0].finish_reason
                usage = getattr(chunk, "usage", None)
                if usage:
                    _take_usage(result, usage, block_drafts)
        if "response_format" in plan.params and result.finish_reason == "stop":
            _check_structured("".join(text))
    except Exception as e:  # noqa: BLE001 - every failure is counted, the soak goes on
        result.error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    result.seconds = clock() - t0
    result.ttft_s = (first - t0) if first is not None else 0.0
    result.max_gap_s, result.stalls = watch.max_gap, watch.stalls
    return result


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


def request_plan(i: int, args: argparse.Namespace, defaults, excerpt: Callable[[int], str]) -> Plan:
    """The request ``i`` of the soak.

    Args:
        defaults: the model's default sampler (``SamplingDefaults``), for the sampled requests.
        excerpt: ``excerpt(j)``, the text of the ``j``-th document excerpt.
    """
    kind = SCHEDULE[i % len(SCHEDULE)]
    turn = i // len(SCHEDULE)
    params: dict = {"max_tokens": args.short_tokens}
    cancel_after = 0
    if kind.name == "long":
        text, params["max_tokens"] = LONG_PROMPTS[turn % len(LONG_PROMPTS)], args.long_tokens
    elif kind.name == "short":
        text = SHORT_PROMPTS[turn % len(SHORT_PROMPTS)]
    elif kind.name == "document":
        text = documents.SUMMARY_INSTRUCTION + excerpt(turn)
    elif kind.name == "structured":
        text, params["response_format"] = STRUCTURED_PROMPTS[turn % len(STRUCTURED_PROMPTS)], RESPONSE_FORMAT
    else:  # cancelled
        text, cancel_after = LONG_PROMPTS[turn % len(LONG_PROMPTS)], args.cancel_after
        params |= {"max_tokens": args.long_tokens, "ignore_eos": True}
    if kind.mode == "greedy":
        params["temperature"] = 0.0
    else:
        params |= {"temperature": defaults.temperature, "top_p": defaults.top_p, "seed": args.seed + i}
        if defaults.top_k:
            params["top_k"] = defaults.top_k
    return Plan(kind, [{"role": "user", "content": text}], params, cancel_after)


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
    info = report.machine_info()
    cancelled_before = engine.stats()["cancelled"]
    results: list[Result] = []
    tokens = 0
    bar = tqdm(total=args.min_tokens, desc="soak", unit="tok", disable=args.quiet, file=sys.stderr)
    t0 = time.monotonic()
    while (len(results) < args.min_requests or tokens < args.min_tokens) and len(results) < args.max_requests:
        i = len(results)
        plan = request_plan(i, args, engine.default_sampling, excerpt)
        r = one_request(litellm.completion, args.model, plan,
                        Result(i + 1, plan.kind.name, plan.kind.mode, plan.kind.stream, plan.params["max_tokens"]),
                        stall_s=args.stall_s, timeout=args.timeout, block_drafts=block_drafts)
        r.rss_mb = resident_mb()
        results.append(r)
        tokens += r.completion_tokens
        bar.update(min(r.completion_tokens, max(args.min_tokens - bar.n, 0)))
        bar.set_postfix_str(f"req {i + 1}, {plan.kind.name} {plan.kind.mode}, "
                            f"errors {sum(bool(x.error) for x in results)}, stalls {sum(x.stalls for x in results)}")
    bar.close()
    wall = time.monotonic() - t0
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
    line = (f"{tokens:,} tokens over {len(results)} back-to-back requests through LiteLLM (`{args.model}`: "
            f"{args.long_tokens}-token generations, {args.short_tokens}-token answers, summaries of "
            f"{args.document_tokens}-token excerpts, structured output, {cancelled} streams closed after "
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
        ("--model", args.model), ("--draft", args.draft), ("--min-requests", args.min_requests),
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
COMMAND = Command("soak", "back-to-back requests through LiteLLM: tokens, requests, verify passes, errors, stalls",
                  main, arguments)
