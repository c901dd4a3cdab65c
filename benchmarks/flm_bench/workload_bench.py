"""``litellm-flm bench --workloads``: the plain tag against its DFlash tag, through LiteLLM, on the
workloads of ``workloads.py`` (chat, multi-turn chat, code edits, RAG, an agent loop, extraction).

Each workload runs ``--requests`` tasks greedy (temperature 0) and the next ``--requests`` tasks
sampled (the model's default sampler, seeds ``--seed`` and up, the same on both tags): no prompt
is sent twice, since the DFlash tag's suffix proposer indexes earlier answers and would copy the
answer to a repeated question (which a benchmark asks and a user rarely does). Each request is sent with
``litellm.completion(model="flm/<tag>")`` on the plain tag and on the DFlash tag one right after
the other, in alternating order, so that machine noise hits both alike. A conversation
(``multi-turn``, ``agent``) goes on on each tag with that tag's own answers (``workloads.follow_up``).

Measured per request from what LiteLLM returns (``_hidden_params["flm_stats"]``, the engine's own
figures; responses are not streamed, since only a whole response carries them):

- **decode tokens/s**: tokens after the first / seconds from the first token to the last (decode
  speed is what speculation changes; the time to the first token is the prompt's prefill);
- **steps per proposer**: the DFlash tag's verify steps of the draft's, prompt lookup's
  (``ngram``), the suffix proposer's and a grammar's forced tokens (``grammar``), and its plain
  steps (one token each, where no proposal was verified: generated tokens - 1 - tokens pushed by
  verify steps); and each proposer's tokens pushed (accepted + the bonus token);
- **greedy identical**: the two tags' greedy answers are the same tokens (every request asks for
  them with vLLM's ``return_token_ids``, which the provider honours);
- **copy ceiling**: decode tokens/s an oracle copy proposer would give over the plain tag on the
  DFlash tag's answers, on this host's verify curve (``flm_bench.ceiling``): what prompt lookup and
  the suffix proposer could reach at best. Its text to copy from: the request's prompt, its output
  so far, and the earlier answers of the DFlash tag in the run (what the suffix proposer indexes).

Per workload and mode: tokens/s = total tokens / total seconds over its requests (turns of a
conversation each count), the ratio DFlash / plain of those, the copy ceiling (decode positions /
their least cost over the requests), AL per proposer (its tokens pushed / its steps), the share of
all decode steps each proposer's (and plain steps) took, and identical greedy answers of all
compared. Files in ``--out``: ``workloads.md`` (the table, the
command, the machine), ``workloads.csv`` (one row per request pair) and ``workloads.png``
(needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import litellm
from litellm_flm import compat  # importing the package registers the flm/ provider with LiteLLM
from tqdm import tqdm

from flm_bench import ceiling, report, workloads
from flm_bench.documents import load_documents
from flm_bench.options import WORKLOAD_MAX_TOKENS, parse_modes
from flm_bench.soak import PROVIDER_PREFIX, draft_models_file
from flm_bench.workloads import Answer, Task
from flm_runtime import InvalidRequestError, paths, registry
from flm_runtime.models.dflash import CONFIG_FILE, read_config
from flm_runtime.request import PROPOSERS
from flm_runtime.speculation.costs import host_id, load as load_host_costs

PROG_NAME = "litellm-flm bench --workloads"
REQUEST_TIMEOUT_S = 3600.0
TOKEN_IDS = {"extra_body": {"return_token_ids": True}}
STEP_KINDS = (*PROPOSERS, "plain")  # the decode steps of a DFlash request, by what they verified
COLUMNS = ("workload", "task", "turn", "mode", "plain_tokens", "plain_decode_s", "plain_tokens_per_s",
           "dflash_tokens", "dflash_decode_s", "dflash_tokens_per_s", "ratio",
           *(f"{k}_steps" for k in STEP_KINDS), *(f"{p}_pushed" for p in PROPOSERS), "copy_positions", "copy_cost",
           "identical")


@dataclass(frozen=True)
class Reply:
    """One tag's answer to one request.

    Attributes:
        answer: its text and tool calls.
        completion_tokens: ``usage.completion_tokens``.
        stats: ``_hidden_params["flm_stats"]`` (``RequestStats.as_dict``).
        prompt_ids: the prompt's token ids (``prompt_token_ids``).
        token_ids: the answer's (``choices[0].token_ids``).
    """

    answer: Answer
    completion_tokens: int
    stats: dict
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, response) -> Reply:
        """From a LiteLLM ``ModelResponse`` of one choice asked with ``return_token_ids``."""
        choice = response.choices[0]
        calls = tuple((c.function.name, c.function.arguments) for c in choice.message.tool_calls or ())
        return cls(Answer(choice.message.content, calls), response.usage.completion_tokens,
                   compat.request_stats(response), tuple(response.prompt_token_ids), tuple(choice.token_ids))

    @property
    def decoded(self) -> int:
        """Tokens after the first."""
        return max(self.stats["generated_tokens"] - 1, 0)

    @property
    def decode_s(self) -> float:
        """Seconds from the first token to the last."""
        tps = self.stats["decode_tokens_per_s"]
        return self.decoded / tps if tps > 0 else 0.0

    def steps(self) -> dict[str, tuple[int, int]]:
        """{kind of ``STEP_KINDS``: (steps, tokens pushed)} of a DFlash tag's reply (a plain step
        pushes one token)."""
        s = self.stats
        out = {}
        for p in PROPOSERS[1:]:
            out[p] = (s[f"{p}_steps"], round((s[f"{p}_acceptance_length"] or 0) * s[f"{p}_steps"]))
        draft_steps = s["spec_steps"] - sum(n for n, _ in out.values())
        out["draft"] = (draft_steps, round((s["draft_acceptance_length"] or 0) * draft_steps))
        plain = self.decoded - sum(pushed for _, pushed in out.values())
        return {k: out[k] for k in PROPOSERS} | {"plain": (plain, plain)}


@dataclass(frozen=True)
class Pair:
    """One request on both tags (``turn`` counts from 1 within its conversation).

    ``copy``: the copy ceiling's decode positions of the DFlash answer and their least cost in
    decode steps (``copy_ceilings``); None until computed, or without a verify curve.
    """

    task: Task
    turn: int
    mode: str
    plain: Reply
    dflash: Reply
    copy: tuple[int, float] | None = None

    @property
    def identical(self) -> bool:
        return self.plain.token_ids == self.dflash.token_ids and self.plain.answer == self.dflash.answer

    def row(self) -> dict:
        p, d = self.plain, self.dflash
        steps, ratio = d.steps(), Cell([self]).ratio
        return {"workload": self.task.workload, "task": self.task.name, "turn": self.turn, "mode": self.mode,
                "plain_tokens": p.completion_tokens, "plain_decode_s": f"{p.decode_s:.4f}",
                "plain_tokens_per_s": f"{_tps([p]):.3f}", "dflash_tokens": d.completion_tokens,
                "dflash_decode_s": f"{d.decode_s:.4f}", "dflash_tokens_per_s": f"{_tps([d]):.3f}",
                "ratio": "" if ratio is None else f"{ratio:.4f}", **{f"{k}_steps": steps[k][0] for k in STEP_KINDS},
                **{f"{k}_pushed": steps[k][1] for k in PROPOSERS},
                "copy_positions": "" if self.copy is None else self.copy[0],
                "copy_cost": "" if self.copy is None else f"{self.copy[1]:.4f}",
                "identical": ("yes" if self.identical else "no") if self.mode == "greedy" else ""}


def _tps(replies: list[Reply]) -> float:
    """Total decoded tokens / total decode seconds (0.0 over none)."""
    seconds = sum(r.decode_s for r in replies)
    return sum(r.decoded for r in replies) / seconds if seconds > 0 else 0.0


def converse(task: Task, mode: str, tags: tuple[str, str], seed: int, k: int, *,
             on_request=lambda: None) -> list[Pair]:
    """Run ``task``'s conversation in ``mode`` on the plain and the DFlash tag (``tags``), each
    request on both, the order alternating with ``k`` + the turn; each tag's conversation goes on
    with its own answers while ``follow_up`` gives a next request on both.

    Args:
        seed: the sampled mode's seed of the first turn (the next turns add one each).
        on_request: called after each request (progress).
    """
    requests = dict.fromkeys(tags, task.request)
    pairs = []
    turn = 0
    while all(requests.values()):
        turn += 1
        sampler = {"temperature": 0.0} if mode == "greedy" else {"seed": seed + turn - 1}
        order = tags if (k + turn) % 2 else tags[::-1]
        replies = {}
        for tag in order:
            response = litellm.completion(model=PROVIDER_PREFIX + tag, timeout=REQUEST_TIMEOUT_S, **requests[tag],
                                          **sampler, **TOKEN_IDS)
            replies[tag] = Reply.of(response)
            on_request()
        pairs.append(Pair(task, turn, mode, replies[tags[0]], replies[tags[1]]))
        requests = {tag: workloads.follow_up(task, requests[tag], replies[tag].answer, turn) for tag in tags}
    return pairs


def main(args: argparse.Namespace) -> int:
    if args.llama_server or args.spec_off:
        from flm_bench import peer_workloads

        return peer_workloads.main(args)
    if args.quick or args.baseline_only or args.no_ngram or args.contexts or args.stop_at_eos:
        raise InvalidRequestError("--workloads runs both tags through LiteLLM and takes none of --quick, "
                                  "--baseline-only, --no-ngram, --contexts, --stop-at-eos", param="--workloads")
    names = workloads.parse_workloads(args.workloads, workloads.DFLASH_WORKLOADS, workloads.CHAT_WORKLOADS)
    modes = parse_modes(args.modes)
    max_tokens = args.max_tokens or WORKLOAD_MAX_TOKENS
    docs = load_documents(args.documents)
    n = args.requests
    jobs = []
    for name in names:
        tasks = workloads.build(name, n * len(modes), max_tokens=max_tokens, documents=docs, chat_prompts=args.prompts)
        jobs += [(task, mode) for j, mode in enumerate(modes) for task in tasks[j * n:(j + 1) * n]]
    entry = registry.resolve(args.tag)
    base = entry.base or entry.tag
    tags = (base, registry.dflash_tag(base))
    with draft_models_file(tags[1], args.draft) if args.draft else contextlib.nullcontext():
        info = report.machine_info()
        for tag in tags:  # first-call costs (loading, allocations) are not the model's speed
            litellm.completion(model=PROVIDER_PREFIX + tag, messages=[{"role": "user", "content": "Hello!"}],
                               max_tokens=8, temperature=0.0)
        drafted = read_config(registry.locate_draft(tags[1]) / CONFIG_FILE).block_size - 1  # K
        if args.ceiling_curve:
            check_curve(args.ceiling_curve, tags[1], drafted)
        pairs = measure(jobs, tags, seed=args.seed, quiet=args.quiet)
        curve = args.ceiling_curve or verify_curve(tags[1], drafted)
    if curve is not None:
        pairs = copy_ceilings(pairs, curve, args.ceiling_min_run)
    out = report.output_dir(args.out)
    report.write_csv(out / "workloads.csv", COLUMNS, (p.row() for p in pairs))
    sections = tables(pairs, names, modes, tags, max_tokens, args, curve)
    report.write_report(out / "workloads.md", "Workloads", command(args, max_tokens), sections, info)
    written = ["workloads.md", "workloads.csv"]
    if not args.no_plot and plot(pairs, names, modes, tags, out / "workloads.png"):
        written.append("workloads.png")
    print(sections[1])
    print(f"{PROG_NAME}: wrote {', '.join(str(out / f) for f in written)}")
    return 0


def measure(jobs: list[tuple[Task, str]], tags: tuple[str, str], *, seed: int, quiet: bool) -> list[Pair]:
    """Each (task, mode) of ``jobs`` on both tags (``converse``); conversation ``k`` starts at
    seed ``seed`` + 100 ``k`` (no two requests share a seed while a conversation has under 100
    turns)."""
    total = sum(t.max_requests for t, _ in jobs) * len(tags)
    bar = tqdm(total=total, desc="bench --workloads", unit="req", disable=quiet, file=sys.stderr)
    pairs = []
    for k, (task, mode) in enumerate(jobs):
        bar.set_postfix_str(f"{task.workload} {task.name} {mode}")
        done = converse(task, mode, tags, seed + 100 * k, k, on_request=bar.update)
        bar.update(len(tags) * (task.max_requests - len(done)))  # a conversation that ended early
        pairs += done
    bar.close()
    return pairs


def check_curve(curve: list[float], tag: str, drafted: int) -> None:
    """``--ceiling-curve`` prices a step verifying 1 .. K tokens, K = ``drafted``, DFlash ``tag``'s
    draft's block size - 1 (the most its proposers propose a step).

    Raises:
        InvalidRequestError: ``curve`` has not K costs: fewer would price a lower ceiling, more a
            step the tag never runs.
    """
    if len(curve) != drafted:
        raise InvalidRequestError(f"--ceiling-curve has {len(curve)} costs; {tag} verifies up to {drafted} tokens a "
                                  f"step (passes of 2 .. {drafted + 1} rows): give {drafted}", param="--ceiling-curve")


def verify_curve(tag: str, drafted: int) -> list[float] | None:
    """The verify curve this host measured for DFlash ``tag``'s target on the cpu backend
    (``speculation.costs``, kept when an engine of the tag first started on this host):
    ``verify_ratio``, ``drafted`` values; None when none was kept for this host and that many
    (every engine of the tag started with ``FLM_HOST_COSTS=0`` or a calibrated table)."""
    costs = load_host_costs(paths.host_costs_file(tag, "cpu"), host_id(), tag, "cpu", drafted, drafted)
    return None if costs is None else costs.verify_ratio


def copy_ceilings(pairs: list[Pair], verify_ratio: list[float], min_run: int = 1) -> list[Pair]:
    """``pairs`` (in the order they ran) with their ``copy`` set: each DFlash answer's copy
    lengths (``ceiling.copy_lengths``, runs of up to K = len(``verify_ratio``) tokens) from its
    prompt, its output so far and the DFlash answers before it, runs shorter than ``min_run``
    left out (a run is measured up to ``min_run`` long even where K is shorter), and their least
    cost."""
    earlier = ceiling.SubstringIndex()
    most = max(len(verify_ratio), min_run)  # cheapest_cost verifies at most K of a run
    out = []
    for pair in pairs:
        reply = pair.dflash
        lengths = [m if m >= min_run else 0
                   for m in ceiling.copy_lengths(reply.prompt_ids, reply.token_ids, earlier, most)]
        out.append(dataclasses.replace(pair, copy=(len(lengths), ceiling.cheapest_cost(lengths, verify_ratio))))
        earlier.add_sequence(reply.token_ids)
    return out


@dataclass(frozen=True)
class Cell:
    """The aggregate of one workload in one mode."""

    pairs: list[Pair]

    @property
    def plain_tps(self) -> float:
        return _tps([p.plain for p in self.pairs])

    @property
    def dflash_tps(self) -> float:
        return _tps([p.dflash for p in self.pairs])

    @property
    def ratio(self) -> float | None:
        return self.dflash_tps / self.plain_tps if self.plain_tps > 0 else None

    @property
    def ceiling(self) -> float | None:
        """The copy ceiling: decode positions / their least cost, over the pairs; None without."""
        copies = [p.copy for p in self.pairs if p.copy is not None]
        cost = sum(c for _, c in copies)
        return sum(n for n, _ in copies) / cost if copies and cost > 0 else None

    def steps(self) -> dict[str, tuple[int, int]]:
        """{kind of ``STEP_KINDS``: (steps, tokens pushed)} over the DFlash replies."""
        total = {k: (0, 0) for k in STEP_KINDS}
        for p in self.pairs:
            for k, (n, pushed) in p.dflash.steps().items():
                total[k] = (total[k][0] + n, total[k][1] + pushed)
        return total

    def al(self) -> str:
        """``"draft 1.72, ngram 2.10, suffix —"``: tokens pushed per step of each proposer."""
        s = self.steps()
        return ", ".join(f"{p} {s[p][1] / s[p][0]:.2f}" if s[p][0] else f"{p} —" for p in PROPOSERS)

    def shares(self) -> str:
        """``"draft 61%, ngram 9%, suffix 0%, plain 30%"``: of all decode steps."""
        s = self.steps()
        steps = sum(n for n, _ in s.values())
        return ", ".join(f"{k} {100 * s[k][0] / steps:.0f}%" for k in STEP_KINDS) if steps else "no decode step"

    def identical(self) -> str:
        """``"12 of 12"`` greedy pairs with identical answers; ``"—"`` in sampled mode."""
        if any(p.mode != "greedy" for p in self.pairs):
            return "—"
        return f"{sum(p.identical for p in self.pairs)} of {len(self.pairs)}"


def cells(pairs: list[Pair]) -> dict[tuple[str, str], Cell]:
    """{(workload, mode): Cell}."""
    groups = defaultdict(list)
    for p in pairs:
        groups[(p.task.workload, p.mode)].append(p)
    return {key: Cell(group) for key, group in groups.items()}


def tables(pairs: list[Pair], names: list[str], modes: list[str], tags: tuple[str, str], max_tokens: int,
           args: argparse.Namespace, curve: list[float] | None) -> list[str]:
    """The Markdown sections: the header, the table and the notes (``curve``: the verify costs the
    copy ceiling was priced on, None without)."""
    by = cells(pairs)
    rows = []
    for name in names:
        for mode in modes:
            c = by[(name, mode)]
            rows.append([name, mode, len(c.pairs), f"{c.plain_tps:.1f}", f"{c.dflash_tps:.1f}",
                         "—" if c.ratio is None else f"{c.ratio:.2f}x",
                         "—" if c.ceiling is None else f"{c.ceiling:.2f}x", c.al(), c.shares(), c.identical()])
    table = report.markdown_table(
        ["Workload", "Mode", "Requests", f"{tags[0]} tokens/s", f"{tags[1]} tokens/s", "Ratio", "Copy ceiling",
         "AL by proposer", "Share of decode steps", "Greedy identical"], rows)
    header = (f"## Workloads through LiteLLM: `flm/{tags[1]}` against `flm/{tags[0]}`\n\n"
              f"{args.requests} tasks per workload and mode (the sampled ones other than the greedy ones: no prompt "
              f"is sent twice), at most {max_tokens} completion tokens a request, stopping at the end of the answer; "
              "a conversation's turns each count as a request. Decode tokens/s (tokens after "
              "the first / seconds after the first, the engine's own timing) over all requests of a row; the "
              "ratio is DFlash / plain.")
    if curve is None:
        priced = "— here: this host kept no verify curve for the DFlash tag (`--ceiling-curve` gives one)."
    else:
        source = "the verify costs given" if args.ceiling_curve else "this host's verify curve"
        priced = (f"Priced on {source} ({','.join(map(str, curve))} decode steps for passes of 2, 3, ... rows)"
                  + (f", runs of at least {args.ceiling_min_run} tokens only." if args.ceiling_min_run > 1 else "."))
    notes = ["AL by proposer: tokens pushed (accepted + the bonus token) per verify step of the draft's, "
             "prompt lookup's (ngram), the suffix proposer's and a grammar's forced tokens (grammar); share of "
             "decode steps: those verify steps and the plain steps (one token, no proposal verified), of all decode "
             "steps of the DFlash tag.",
             "Copy ceiling: the ratio an oracle copy proposer would reach on the DFlash tag's answers (every "
             "run of the answer found in its prompt, its output so far or the tag's earlier answers, verified in "
             "the cheapest steps the verify curve allows, never wrong, at no proposing cost): the most "
             "prompt lookup and the suffix proposer can give. " + priced,
             "Greedy identical: both tags gave the same tokens (`return_token_ids`).",
             f"Sampled: the model's default sampler, seeds from {args.seed}, the same on both tags.",
             "Draft: " + (args.draft or f"{tags[1]}'s own") + "; chat prompts: "
             + (args.prompts or "flm_bench/texts/chat_prompts.jsonl") + "."]
    return [header, table, "\n".join(f"- {n}" for n in notes)]


def command(args: argparse.Namespace, max_tokens: int) -> str:
    return report.command_text("bench", [
        ("--workloads", args.workloads), ("--tag", args.tag), ("--draft", args.draft), ("--requests", args.requests),
        ("--max-tokens", max_tokens), ("--modes", args.modes), ("--prompts", args.prompts),
        ("--ceiling-curve", ",".join(map(str, args.ceiling_curve)) if args.ceiling_curve else None),
        ("--ceiling-min-run", args.ceiling_min_run if args.ceiling_min_run > 1 else None),
        ("--documents", args.documents), ("--seed", args.seed), ("--out", args.out)])


def plot(pairs: list[Pair], names: list[str], modes: list[str], tags: tuple[str, str], path: Path) -> bool:
    """``workloads.png``: the DFlash / plain ratio per workload and mode, bars annotated with
    the AL of all verify steps (every proposer's), the copy ceiling a black line on each bar.

    Returns False (after saying why) when matplotlib is not installed.
    """
    plt = report.pyplot(PROG_NAME)
    if plt is None:
        return False
    by = cells(pairs)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(modes)
    top = 1.0
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(names))]
        ratios = [by[(n, mode)].ratio or 0.0 for n in names]
        top = max(top, *ratios)
        ax.bar(xs, ratios, width, label=mode, color=f"C{j}")
        ceilings = [(x, by[(n, mode)].ceiling) for x, n in zip(xs, names, strict=True) if by[(n, mode)].ceiling]
        if ceilings:
            top = max(top, *(c for _, c in ceilings))
            ax.scatter(*zip(*ceilings, strict=True), marker="_", s=600 * width, color="black", zorder=3,
                       label="copy ceiling" if j == 0 else None)
        for x, n, r in zip(xs, names, ratios, strict=True):
            steps = by[(n, mode)].steps()
            verified = sum(steps[p][0] for p in PROPOSERS)
            if verified:
                ax.annotate(f"AL {sum(steps[p][1] for p in PROPOSERS) / verified:.2f}", (x, r), fontsize=7,
                            ha="center", textcoords="offset points", xytext=(0, 3))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.2 * top)
    ax.set(ylabel="decode tokens/s, DFlash / plain",
           title=f"{tags[1]} against {tags[0]} per workload (AL: all verify steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
