"""``litellm-flm soak``: back-to-back requests through LiteLLM, counting tokens, requests, verify
passes, errors and stalls (a stability check).

Requests go one after the other through ``litellm.completion(model="flm/<tag>", stream=True)``, the
path a user's code takes, cycling through four kinds: a long generation (``--long-tokens``, 2048)
greedy, a short request (``--short-tokens``) sampled, a long one sampled, a short one greedy;
sampled requests use the model's default sampler with seeds ``--seed`` and up. The soak goes on
until it has run ``--min-requests`` requests *and* delivered ``--min-tokens`` completion tokens
(or reached ``--max-requests``).

Per request, from the stream itself:

- **tokens**: the final chunk's ``usage.completion_tokens`` (tokens delivered);
- **verify passes**: the 8-token checks of speculative steps, from ``usage.completion_tokens_details``
  (accepted + rejected drafted tokens over K, rounded up, K = block size - 1: a pass verifies at
  most K, fewer where the confidence gate cut the draft or a suffix proposal was shorter, so the
  count is a lower bound);
- **error**: any exception out of LiteLLM (the request still counts);
- **stall**: a gap of more than ``--stall-s`` seconds without a token: from the request's start to
  its first content chunk, between two content chunks, or from the last one to the end of the
  stream (``StallWatch``).

The exit status is 0 only with zero errors, zero stalls and both minimums reached. Files in
``--out``: ``soak.md`` (summary, the command, the machine) and ``soak.csv`` (one row per request).

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

from flm_bench import report
from flm_runtime import InvalidRequestError, default_runtime, get_engine
from flm_runtime import paths, registry
from flm_runtime.cli import Command
from flm_runtime.settings import variable

PROVIDER_PREFIX = "flm/"
# (kind, mode) of successive requests, cycled.
SCHEDULE = (("long", "greedy"), ("short", "sampled"), ("long", "sampled"), ("short", "greedy"))
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
    error: str = ""


COLUMNS = tuple(f.name for f in fields(Result))


def _content(chunk) -> str:
    choices = getattr(chunk, "choices", None) or []
    return (choices[0].delta.content or "") if choices else ""


def one_request(completion: Callable, model: str, prompt: str, params: dict, result: Result, *, stall_s: float,
                timeout: float, block_drafts: int, clock: Callable[[], float] = time.monotonic) -> Result:
    """Stream one request through ``completion`` (``litellm.completion``) and fill ``result``.

    Args:
        block_drafts: K, tokens drafted per verify pass (0 for a plain model).
    """
    watch = StallWatch(stall_s, clock)
    t0 = clock()
    first = None
    try:
        stream = completion(model=model, messages=[{"role": "user", "content": prompt}], stream=True,
                            stream_options={"include_usage": True}, timeout=timeout, **params)
        for chunk in watch_stream(stream, watch, lambda c: bool(_content(c))):
            if first is None and _content(chunk):
                first = clock()
            if getattr(chunk, "choices", None) and chunk.choices[0].finish_reason:
                result.finish_reason = chunk.choices[0].finish_reason
            usage = getattr(chunk, "usage", None)
            if usage:
                _take_usage(result, usage, block_drafts)
    except Exception as e:  # noqa: BLE001 - every failure is counted, the soak goes on
        result.error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    result.seconds = clock() - t0
    result.ttft_s = (first - t0) if first is not None else 0.0
    result.max_gap_s, result.stalls = watch.max_gap, watch.stalls
    return result


def _take_usage(result: Result, usage, block_drafts: int) -> None:
    result.prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
    result.completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
    details = getattr(usage, "completion_tokens_details", None)
    accepted = int(getattr(details, "accepted_prediction_tokens", 0) or 0) if details else 0
    rejected = int(getattr(details, "rejected_prediction_tokens", 0) or 0) if details else 0
    result.accepted_tokens = accepted
    result.verify_passes = -(-(accepted + rejected) // block_drafts) if block_drafts else 0  # rounded up


def request_plan(i: int, args: argparse.Namespace, defaults) -> tuple[str, str, str, dict]:
    """(kind, mode, prompt, LiteLLM parameters) of request ``i``."""
    kind, mode = SCHEDULE[i % len(SCHEDULE)]
    prompts = LONG_PROMPTS if kind == "long" else SHORT_PROMPTS
    params = {"max_tokens": args.long_tokens if kind == "long" else args.short_tokens}
    if mode == "greedy":
        params["temperature"] = 0.0
    else:
        params |= {"temperature": defaults.temperature, "top_p": defaults.top_p, "seed": args.seed + i}
        if defaults.top_k:
            params["top_k"] = defaults.top_k
    return kind, mode, prompts[(i // len(SCHEDULE)) % len(prompts)], params


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
    info = report.machine_info()
    results: list[Result] = []
    tokens = 0
    bar = tqdm(total=args.min_tokens, desc="soak", unit="tok", disable=args.quiet, file=sys.stderr)
    t0 = time.monotonic()
    while (len(results) < args.min_requests or tokens < args.min_tokens) and len(results) < args.max_requests:
        i = len(results)
        kind, mode, prompt, params = request_plan(i, args, engine.default_sampling)
        r = one_request(litellm.completion, args.model, prompt, params, Result(i + 1, kind, mode, params["max_tokens"]),
                        stall_s=args.stall_s, timeout=args.timeout, block_drafts=block_drafts)
        results.append(r)
        tokens += r.completion_tokens
        bar.update(min(r.completion_tokens, max(args.min_tokens - bar.n, 0)))
        bar.set_postfix_str(f"req {i + 1}, {kind} {mode}, errors {sum(bool(x.error) for x in results)}, "
                            f"stalls {sum(x.stalls for x in results)}")
    bar.close()
    wall = time.monotonic() - t0
    out = report.output_dir(args.out)
    report.write_csv(out / "soak.csv", COLUMNS, (asdict(r) for r in results))
    ok, sections = summary(args, tag, results, wall, block_drafts)
    report.write_report(out / "soak.md", "Stability (soak)", command(args), sections, info)
    print(sections[1])
    print(f"litellm-flm soak: {'PASS' if ok else 'FAIL'}; wrote {out / 'soak.md'}, {out / 'soak.csv'}")
    return 0 if ok else 1


def summary(args: argparse.Namespace, tag: str, results: list[Result], wall: float,
            block_drafts: int) -> tuple[bool, list[str]]:
    """(passed, Markdown sections)."""
    tokens = sum(r.completion_tokens for r in results)
    errors = [r for r in results if r.error]
    stalls = sum(r.stalls for r in results)
    passes = sum(r.verify_passes for r in results)
    ok = not errors and not stalls and len(results) >= args.min_requests and tokens >= args.min_tokens
    kinds = {}
    for r in results:
        k = kinds.setdefault(f"{r.kind} {r.mode}", [0, 0, 0])
        k[0], k[1], k[2] = k[0] + 1, k[1] + r.completion_tokens, k[2] + r.verify_passes
    checks = f"{block_drafts + 1}-token checks" if block_drafts else "verify passes (none: plain decoding)"
    line = (f"{tokens:,} tokens over {len(results)} back-to-back requests through LiteLLM (`{args.model}`: "
            f"{args.long_tokens}-token generations and {args.short_tokens}-token requests, greedy and sampled) "
            f"and {passes:,} {checks} in one session: {len(errors)} error(s), {stalls} stall(s) "
            f"(a stall: more than {args.stall_s:g} s without a token).")
    table = report.markdown_table(
        ["Requests", "Completion tokens", "Verify passes", "Errors", f"Stalls (> {args.stall_s:g} s)",
         "Longest gap between tokens", "Wall time"],
        [[len(results), f"{tokens:,}", f"{passes:,}", len(errors), stalls,
          f"{max((r.max_gap_s for r in results), default=0):.2f} s", f"{wall / 60:.1f} min"]])
    per_kind = report.markdown_table(["Requests", "Count", "Completion tokens", "Verify passes"],
                                     [[k, *v] for k, v in kinds.items()])
    notes = [f"Result: {'PASS' if ok else 'FAIL'} (zero errors, zero stalls, at least {args.min_requests} "
             f"requests and {args.min_tokens:,} tokens).", "Draft: " + (args.draft or "the model's own") + "."]
    notes += [f"request {r.index}: {r.error}" for r in errors[:10]]
    return ok, [f"## Stability\n\n{line}", table, per_kind, "\n".join(f"- {n}" for n in notes)]


def command(args: argparse.Namespace) -> str:
    return report.command_text("soak", [
        ("--model", args.model), ("--draft", args.draft), ("--min-requests", args.min_requests),
        ("--min-tokens", args.min_tokens), ("--max-requests", args.max_requests),
        ("--long-tokens", args.long_tokens), ("--short-tokens", args.short_tokens), ("--stall-s", args.stall_s),
        ("--timeout", args.timeout), ("--seed", args.seed), ("--out", args.out)])


def arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``litellm-flm soak``."""
    p.add_argument("--model", default="flm/smollm2-dflash:135m",
                   help="the LiteLLM model to soak (default flm/smollm2-dflash:135m)")
    p.add_argument("--draft", metavar="DIR",
                   help="serve the model's DFlash tag with this draft directory for the run (through a "
                        "temporary models file that keeps your own entries)")
    p.add_argument("--min-requests", type=int, default=20, help="run at least this many requests (default 20)")
    p.add_argument("--min-tokens", type=int, default=8000,
                   help="and at least this many completion tokens (default 8000)")
    p.add_argument("--max-requests", type=int, default=100,
                   help="stop after this many requests even if --min-tokens is not reached (default 100)")
    p.add_argument("--long-tokens", type=int, default=2048, help="max_tokens of the long requests (default 2048)")
    p.add_argument("--short-tokens", type=int, default=64, help="max_tokens of the short requests (default 64)")
    p.add_argument("--stall-s", type=float, default=10.0,
                   help="a stall: no token for more than this many seconds (default 10)")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout in seconds (default 900)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first sampled request (default 0)")
    p.add_argument("--out", default="flm-bench", metavar="DIR", help="where the files go (default ./flm-bench)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


# The subcommand ``litellm-flm soak`` (entry point ``soak`` of the group ``litellm_flm.commands``).
COMMAND = Command("soak", "back-to-back requests through LiteLLM: tokens, requests, verify passes, errors, stalls",
                  main, arguments)
