"""``litellm-flm bench``: the reference benchmark's decode-speed table (docs/benchmarks.md), measured on our runtime.

For each prompt context (about 30 tokens, 1k, 4k and the largest prompt the model allows with the
generation after it), ``--prompts-per-context`` real prompts: the short chat prompts of
``documents.short_prompts``, and "summarize this" around the longest prefix of a long document
that fits (``documents.summary_prompt``; the documents and their sources: ``texts/README.md``).
Each prompt is run greedy and sampled (the model's default sampler), with thinking on and off
where the model's chat template has the switch, on the plain tag (the baseline) and on its DFlash
tag, one right after the other and in alternating order, so that machine noise hits both alike.

Measured per request by the engine itself (``Completion.stats``): decode tokens/s = tokens after
the first / seconds from the first to the last token; a request generates exactly ``--max-tokens``
tokens unless ``--stop-at-eos``. Per table cell (context x mode x thinking): baseline tokens/s and
DFlash tokens/s are total tokens / total seconds over the prompts, the speed-up is their ratio,
and AL (acceptance length) = tokens kept per verify step, bonus token included, over all steps.

Files in ``--out``: ``speed.md`` (the reference benchmark's layout, the command, the machine), ``speed.csv``
(one row per prompt x mode x thinking) and ``speed.png`` (needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from flm_bench import quick, report
from flm_bench.documents import (Document, Prompt, chat_ids, load_documents, longest_summary, short_prompts,
                                         summary_prompt, supports_thinking)
from flm_bench.engines import (Context, Engines, Run, load_engines, parse_contexts, run_request, sampling,
                                       warm_up)
from flm_bench.options import SPEED_CONTEXTS, SPEED_MAX_TOKENS, bench_arguments, parse_modes
from flm_runtime.cli import Command
from flm_runtime.request import PROPOSERS, SPEC_FIGURE_KEYS

COLUMNS = ("context", "prompt", "prompt_tokens", "mode", "thinking", "baseline_tokens", "baseline_decode_s",
           "baseline_tokens_per_s", "dflash_tokens", "dflash_decode_s", "dflash_tokens_per_s", "speedup",
           "acceptance_length", "verify_steps", *SPEC_FIGURE_KEYS)
PROG_NAME = "litellm-flm bench"


@dataclass(frozen=True)
class Pair:
    """One prompt in one mode, run on both engines (``dflash`` None when baseline only)."""

    context: Context
    prompt: Prompt
    mode: str
    thinking: bool | None
    baseline: Run
    dflash: Run | None

    @property
    def column(self) -> tuple[str, bool | None]:
        return self.mode, self.thinking

    def row(self) -> dict:
        b, d = self.baseline, self.dflash
        row = {"context": self.context.label, "prompt": self.prompt.name, "prompt_tokens": b.prompt_tokens,
               "mode": self.mode, "thinking": "" if self.thinking is None else ("on" if self.thinking else "off"),
               "baseline_tokens": b.generated_tokens, "baseline_decode_s": f"{b.decode_s:.4f}",
               "baseline_tokens_per_s": f"{b.decode_tokens_per_s:.3f}"}
        if d is None:
            return row | dict.fromkeys(COLUMNS[8:], "")
        return row | {"dflash_tokens": d.generated_tokens, "dflash_decode_s": f"{d.decode_s:.4f}",
                      "dflash_tokens_per_s": f"{d.decode_tokens_per_s:.3f}",
                      "speedup": f"{d.decode_tokens_per_s / b.decode_tokens_per_s:.4f}",
                      "acceptance_length": f"{d.acceptance_length:.4f}" if d.spec_steps else "",
                      "verify_steps": d.spec_steps,
                      **{k: _figure(d.figures.get(k)) for k in SPEC_FIGURE_KEYS}}


@dataclass(frozen=True)
class Cell:
    """The aggregate of one table cell (one context, one mode and thinking setting)."""

    baseline_tps: float
    dflash_tps: float | None
    acceptance_length: float | None

    @property
    def speedup(self) -> float | None:
        return None if self.dflash_tps is None else self.dflash_tps / self.baseline_tps

    @classmethod
    def of(cls, pairs: list[Pair]) -> Cell:
        base = _tps([p.baseline for p in pairs])
        if any(p.dflash is None for p in pairs):
            return cls(base, None, None)
        runs = [p.dflash for p in pairs]
        steps = sum(r.spec_steps for r in runs)
        al = sum(r.acceptance_length * r.spec_steps for r in runs) / steps if steps else None
        return cls(base, _tps(runs), al)

    def label(self) -> str:
        """``"1.24x (AL 3.85)"``; ``"0.98x (no verify step)"`` where the DFlash tag decoded plainly."""
        al = "no verify step" if self.acceptance_length is None else f"AL {self.acceptance_length:.2f}"
        return f"{self.speedup:.2f}x ({al})"


def _tps(runs: list[Run]) -> float:
    """Total decoded tokens / total decode seconds."""
    seconds = sum(r.decode_s for r in runs)
    return sum(r.generated_tokens - 1 for r in runs) / seconds if seconds > 0 else 0.0


def main(args: argparse.Namespace) -> int:
    max_tokens = args.max_tokens or SPEED_MAX_TOKENS
    engines = load_engines(args.tag, draft=args.draft, baseline_only=args.baseline_only, ngram=not args.no_ngram)
    tok = engines.baseline.tokenizer
    modes = parse_modes(args.modes)
    sampler = _sampler(args)
    engines.baseline.sampling_params(**sampler)  # a value out of range fails here, before any request
    thinking = _thinking_settings(tok, args.thinking)
    docs = load_documents(args.documents)[:args.prompts_per_context]
    fill = min(longest_summary(tok, docs, thinking=think) for think in thinking)
    contexts, notes = parse_contexts(args.contexts or SPEED_CONTEXTS, engines.baseline.context_length, max_tokens,
                                     fill=fill)
    contexts, prompts = build_prompts(tok, contexts, thinking, docs, args)
    info = report.machine_info()
    warm_up(engines, chat_ids(tok, "Hello!"))
    pairs = measure(engines, prompts, modes, max_tokens=max_tokens, seed=args.seed,
                    ignore_eos=not args.stop_at_eos, sampler=sampler, quiet=args.quiet)
    out = report.output_dir(args.out)
    report.write_csv(out / "speed.csv", COLUMNS, (p.row() for p in pairs))
    sections = tables(engines, pairs, contexts, modes, thinking, max_tokens, notes, args)
    report.write_report(out / "speed.md", "Decoding speed", command(args, max_tokens), sections, info)
    written = ["speed.md", "speed.csv"]
    if not args.no_plot and plot(pairs, contexts, engines, out / "speed.png"):
        written.append("speed.png")
    print(sections[1])
    print(f"{PROG_NAME}: wrote {', '.join(str(out / f) for f in written)}")
    return 0


def _sampler(args: argparse.Namespace) -> dict:
    """The sampled mode's fields given on the command line (None: the model's default)."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def _thinking_settings(tokenizer, choice: str) -> list[bool | None]:
    """[None] for a model without a thinking switch; else off and/or on."""
    if not supports_thinking(tokenizer):
        return [None]
    return {"both": [False, True], "off": [False], "on": [True]}[choice]


def build_prompts(tokenizer, contexts: list[Context], thinking: list[bool | None], docs: list[Document],
                  args: argparse.Namespace) -> tuple[list[Context], list[tuple[Context, bool | None, Prompt]]]:
    """Every (context, thinking, prompt) to run, ``--prompts-per-context`` per context; the long
    prompts summarize ``docs`` in turn.

    Returns:
        the contexts (the short one now labelled with its mean prompt length, "~37 tokens") and
        the plan.
    """
    n = args.prompts_per_context
    shorts = short_prompts(args.prompts, n)
    labelled, plan = [], []
    for ctx in contexts:
        prompts = []
        for think in thinking:
            for i in range(n):
                if ctx.tokens is None:
                    name, text = shorts[i % len(shorts)]
                    prompt = Prompt(name, tuple(chat_ids(tokenizer, text, thinking=think)))
                else:
                    prompt = summary_prompt(tokenizer, docs[i % len(docs)], ctx.tokens, thinking=think)
                prompts.append((think, prompt))
        if ctx.tokens is None:
            ctx = Context(f"~{sum(len(p.ids) for _, p in prompts) / len(prompts):.0f} tokens", None)
        labelled.append(ctx)
        plan += [(ctx, think, prompt) for think, prompt in prompts]
    return labelled, plan


def measure(engines: Engines, plan, modes: list[str], *, max_tokens: int, seed: int, ignore_eos: bool,
            sampler: dict | None = None, quiet: bool = False) -> list[Pair]:
    """Run every prompt in every mode on the baseline and the DFlash engine, interleaved (the order
    alternates from one pair to the next); both get the same parameters and seed (``sampler``:
    the sampled mode's fields over the model's default, ``engines.sampling``)."""
    jobs = [(ctx, think, prompt, mode) for ctx, think, prompt in plan for mode in modes]
    bar = tqdm(total=len(jobs) * len(engines.pairs()), desc="bench", unit="req", disable=quiet, file=sys.stderr)
    pairs = []
    for k, (ctx, think, prompt, mode) in enumerate(jobs):
        params = sampling(engines.baseline, mode, max_tokens=max_tokens, seed=seed + k, ignore_eos=ignore_eos,
                          sampler=sampler)
        runs: dict[str, Run] = {}
        order = engines.pairs() if k % 2 == 0 else engines.pairs()[::-1]
        for tag, engine in order:
            bar.set_postfix_str(f"{ctx.label} {prompt.name} {mode} {tag}")
            runs[tag] = run_request(engine, prompt.ids, params)
            bar.update()
        pairs.append(Pair(ctx, prompt, mode, think, runs[engines.base_tag], runs.get(engines.dflash_tag)))
    bar.close()
    return pairs


def _figure(value: int | float | None) -> str | int:
    """A ``SpecStats.figures`` value in speed.csv: an AL to 4 decimals, a count as it is, None
    (an AL over no step, or no speculation) empty."""
    return "" if value is None else f"{value:.4f}" if isinstance(value, float) else value


def _proposer_share(ctx: Context, pairs: list[Pair]) -> str:
    """``"4k: 80 steps, ngram 12 (AL 5.10), suffix 0, grammar 0, 0 forced tokens, 0 kept"``: the
    verify steps at ``ctx``, over all modes, of them each retrieval proposer's and the grammar's
    with their AL, and the tokens a grammar forced, verified and kept."""
    runs = [p.dflash for p in pairs if p.context == ctx]
    shares = []
    for name in PROPOSERS[1:]:
        steps = sum(r.figures.get(f"{name}_steps", 0) for r in runs)
        pushed = sum((r.figures.get(f"{name}_acceptance_length") or 0.0) * r.figures.get(f"{name}_steps", 0)
                     for r in runs)
        shares.append(f"{name} {steps}" + (f" (AL {pushed / steps:.2f})" if steps else ""))
    forced = [sum(r.figures.get(k, 0) for r in runs) for k in ("forced_tokens", "forced_accepted_tokens")]
    return (f"{ctx.label}: {sum(r.spec_steps for r in runs)} steps, " + ", ".join(shares)
            + f", {forced[0]} forced tokens, {forced[1]} kept")


def _column_name(mode: str, thinking: bool | None) -> str:
    name = mode.capitalize()
    return name if thinking is None else f"{name}, think {'on' if thinking else 'off'}"


def tables(engines: Engines, pairs: list[Pair], contexts: list[Context], modes: list[str],
           thinking: list[bool | None], max_tokens: int, notes: list[str], args: argparse.Namespace) -> list[str]:
    """The Markdown sections: the reference benchmark's table, a tokens/s table, and the notes."""
    columns = [(m, t) for m in modes for t in thinking]
    cells = defaultdict(list)
    for p in pairs:
        cells[(p.context.label, p.column)].append(p)
    cell = {key: Cell.of(group) for key, group in cells.items()}
    n = args.prompts_per_context
    base, dfl = engines.base_tag, engines.dflash_tag
    card_rows, tps_rows = [], []
    for ctx in contexts:
        first = cell[(ctx.label, columns[0])]
        row = [ctx.label, f"{first.baseline_tps:.1f}"]
        for col in columns:
            c = cell[(ctx.label, col)]
            row.append("—" if c.speedup is None else c.label())
            tps_rows.append([ctx.label, _column_name(*col), f"{c.baseline_tps:.1f}",
                             "—" if c.dflash_tps is None else f"{c.dflash_tps:.1f}"])
        card_rows.append(row)
    eos = "at most, stopping at the end-of-turn token" if args.stop_at_eos else "each, end-of-turn tokens ignored"
    header = (f"## Decoding speed ({max_tokens} generated tokens {eos}; {n} prompts per context length)\n\n"
              + (f"Speed-up of `{dfl}` over `{base}`" if dfl else f"`{base}` alone (no DFlash run: --baseline-only)")
              + "; the AL figures are the tokens kept per verify step (acceptance length, bonus token included).")
    card = report.markdown_table(["Prompt context", f"{base} (TPS, {_column_name(*columns[0])})",
                                  *[_column_name(*c) for c in columns]], card_rows)
    tps = report.markdown_table(["Prompt context", "mode", f"{base} tokens/s", f"{dfl or 'DFlash'} tokens/s"], tps_rows)
    lines = [f"Hardware: {engines.hardware}; draft: {engines.draft or 'none'}."]
    if any(p.dflash for p in pairs):
        speedups = [p.dflash.decode_tokens_per_s / p.baseline.decode_tokens_per_s for p in pairs]
        lines.append(f"Per prompt the speed-up ranges from {min(speedups):.2f}x to {max(speedups):.2f}x.")
        lines.append("Verify steps, and of them those that verified prompt lookup's (ngram), the suffix "
                     "proposer's and a grammar's forced tokens alone, with their AL, and the forced tokens: "
                     + "; ".join(_proposer_share(ctx, pairs) for ctx in contexts) + ".")
    s = engines.baseline.sampling_params(**_sampler(args))
    whose = "the model's default" if s == engines.baseline.sampling_params() else "the given"
    lines.append(f"\"Sampled\" is {whose} sampler (temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
                 f"min_p {s.min_p}); seeds {args.seed} and up, the same for both tags.")
    lines.append("The long-context prompts ask for a summary of the longest prefix of a long document that fits: "
                 + ("the public-domain texts shipped in the package (flm_bench/texts/README.md)"
                    if args.documents is None else f"the *.txt files of {args.documents}") + ".")
    if thinking == [None]:
        lines.append("Thinking on/off: the model's chat template has no thinking switch, so one setting.")
    lines += notes
    return [header, card, "Decode tokens/s per cell (total tokens / total seconds over the prompts):", tps,
            "\n".join(f"- {ln}" for ln in lines)]


def command(args: argparse.Namespace, max_tokens: int) -> str:
    return report.command_text("bench", [
        ("--tag", args.tag), ("--draft", args.draft), ("--baseline-only", args.baseline_only),
        ("--no-ngram", args.no_ngram), ("--contexts", args.contexts or SPEED_CONTEXTS), ("--max-tokens", max_tokens),
        ("--stop-at-eos", args.stop_at_eos), ("--prompts-per-context", args.prompts_per_context),
        ("--modes", args.modes), ("--temperature", args.temperature), ("--top-k", args.top_k),
        ("--top-p", args.top_p), ("--thinking", args.thinking), ("--prompts", args.prompts),
        ("--documents", args.documents), ("--seed", args.seed), ("--out", args.out)])


def plot(pairs: list[Pair], contexts: list[Context], engines: Engines, path: Path) -> bool:
    """``speed.png``: decode tokens/s per context (both tags, each mode) and the speed-up.

    Returns False (after saying why) when matplotlib is not installed.
    """
    plt = report.pyplot(PROG_NAME)
    if plt is None:
        return False
    labels = [c.label for c in contexts]
    groups = defaultdict(list)
    for p in pairs:
        groups[(p.column, p.context.label)].append(p)
    columns = list(dict.fromkeys(p.column for p in pairs))
    has_dflash = engines.dflash is not None
    fig, axes = plt.subplots(1, 2 if has_dflash else 1, figsize=(11 if has_dflash else 6, 4), squeeze=False)
    ax = axes[0][0]
    top = 0.0
    for k, col in enumerate(columns):
        cells = [Cell.of(groups[(col, lb)]) for lb in labels]
        ax.plot(labels, [c.baseline_tps for c in cells], "o--", color=f"C{k}",
                label=f"{engines.base_tag} {_column_name(*col)}")
        top = max(top, *(c.baseline_tps for c in cells))
        if has_dflash:
            ax.plot(labels, [c.dflash_tps for c in cells], "o-", color=f"C{k}",
                    label=f"{engines.dflash_tag} {_column_name(*col)}")
            top = max(top, *(c.dflash_tps for c in cells))
    ax.set(xlabel="prompt context", ylabel="decode tokens/s", title="Decode speed")
    ax.set_ylim(0, 1.15 * top or 1.0)
    ax.legend(fontsize=7)
    if has_dflash:
        ax = axes[0][1]
        top = 1.0
        for k, col in enumerate(columns):
            cells = [Cell.of(groups[(col, lb)]) for lb in labels]
            top = max(top, *(c.speedup for c in cells))
            ax.plot(labels, [c.speedup for c in cells], "o-", color=f"C{k}", label=_column_name(*col))
            for x, c in zip(labels, cells, strict=True):
                if c.acceptance_length is not None:
                    ax.annotate(f"AL {c.acceptance_length:.2f}", (x, c.speedup), fontsize=7, color=f"C{k}",
                                textcoords="offset points", xytext=(0, 6 + 9 * k), ha="center")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(0, 1.2 * top)
        ax.set(xlabel="prompt context", ylabel=f"speed-up over {engines.base_tag}", title="DFlash speed-up")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    """``litellm-flm bench``: this table, with ``--quick`` the TTFT/prefill table (``quick``), with
    ``--workloads`` the workload table (``workload_bench``)."""
    if args.workloads:
        from flm_bench import workload_bench  # imports LiteLLM, seconds that the other tables need not pay

        return workload_bench.main(args)
    return (quick.main if args.quick else main)(args)


# The subcommand ``litellm-flm bench`` (entry point of the group ``litellm_flm.commands``).
COMMAND = Command("bench", "the decode-speed table: baseline tokens/s, DFlash speed-up and AL per prompt context "
                  "(--quick: TTFT, prefill and decode tokens/s at 1k-8k; --workloads: chat, code, RAG, agent, "
                  "extraction through LiteLLM)", run, bench_arguments)
