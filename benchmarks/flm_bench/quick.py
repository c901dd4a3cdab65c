"""``litellm-flm bench --quick``: the reference benchmark's ``flm bench`` table (docs/benchmarks.md), measured on our runtime.

One prompt per context length (1k, 2k, 4k, 8k by default, up to the model's maximum: a length whose
generation would not fit is clipped to what does): "summarize this" around a prefix of the first
long document. Per context and ``--iterations`` times, one greedy request of about 30 generated
tokens on the plain tag and on its DFlash tag, interleaved (contexts inside iterations, the two
tags in alternating order), so that machine noise hits both.

Per request, from the engine's own timing: TTFT (submit to first token: the prefill), prefill
tokens/s = prompt tokens / TTFT, decode tokens/s = tokens after the first / seconds after the
first. Reported as mean ± std over the iterations. Like the reference benchmark's, this table decodes only a few
tokens of one prompt per length: a coarse measure of speculative decoding (the full one is
``litellm-flm bench``).

Files in ``--out``: ``quick.md`` (tables, the command, the machine) and ``quick.csv`` (one row per
request).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from tqdm import tqdm

from flm_bench import report
from flm_bench.documents import (Document, Prompt, chat_ids, load_documents, longest_summary, short_prompts,
                                         summary_prompt)
from flm_bench.engines import (Context, Engines, Run, load_engines, parse_contexts, run_request, sampling,
                                       warm_up)
from flm_bench.options import QUICK_CONTEXTS, QUICK_MAX_TOKENS
from flm_runtime import InvalidRequestError

COLUMNS = ("context", "prompt_tokens", "tag", "iteration", "ttft_s", "prefill_tokens_per_s",
           "decode_tokens_per_s", "generated_tokens", "acceptance_length")
PROG_NAME = "litellm-flm bench --quick"


def main(args: argparse.Namespace) -> int:
    max_tokens = args.max_tokens or QUICK_MAX_TOKENS
    if args.iterations < 1:
        raise InvalidRequestError(f"--iterations must be >= 1, got {args.iterations}", param="--iterations")
    engines = load_engines(args.tag, draft=args.draft, baseline_only=args.baseline_only, ngram=not args.no_ngram)
    tok = engines.baseline.tokenizer
    document = load_documents(args.documents)[0]
    contexts, notes = parse_contexts(args.contexts or QUICK_CONTEXTS, engines.baseline.context_length, max_tokens,
                                     fill=longest_summary(tok, [document]))
    prompts = [(ctx, context_prompt(tok, ctx, document, args)) for ctx in contexts]
    info = report.machine_info()
    warm_up(engines, chat_ids(tok, "Hello!"))
    runs = measure(engines, prompts, args.iterations, max_tokens=max_tokens, ignore_eos=not args.stop_at_eos,
                   quiet=args.quiet)
    out = report.output_dir(args.out)
    report.write_csv(out / "quick.csv", COLUMNS, (_row(ctx, tag, i, r) for (ctx, tag, i), r in runs.items()))
    sections = tables(engines, runs, contexts, args.iterations, max_tokens, notes)
    report.write_report(out / "quick.md", "flm bench (quick)", command(args, max_tokens), sections, info)
    print(sections[1])
    print(f"{PROG_NAME}: wrote {out / 'quick.md'}, {out / 'quick.csv'}")
    return 0


def context_prompt(tokenizer, ctx: Context, document: Document, args: argparse.Namespace) -> Prompt:
    """The one prompt of a context length: a short chat prompt, or a summary of ``document``."""
    if ctx.tokens is None:
        name, text = short_prompts(args.prompts, 1)[0]
        return Prompt(name, tuple(chat_ids(tokenizer, text)))
    return summary_prompt(tokenizer, document, ctx.tokens)


def measure(engines: Engines, prompts: list[tuple[Context, Prompt]], iterations: int, *, max_tokens: int,
            ignore_eos: bool, quiet: bool = False) -> dict[tuple[str, str, int], Run]:
    """{(context label, tag, iteration): Run}; greedy requests, contexts inside iterations, the
    tags in alternating order."""
    total = iterations * len(prompts) * len(engines.pairs())
    bar = tqdm(total=total, desc="bench --quick", unit="req", disable=quiet, file=sys.stderr)
    runs, k = {}, 0
    for it in range(iterations):
        for ctx, prompt in prompts:
            params = sampling(engines.baseline, "greedy", max_tokens=max_tokens, seed=0, ignore_eos=ignore_eos)
            for tag, engine in engines.pairs() if k % 2 == 0 else engines.pairs()[::-1]:
                bar.set_postfix_str(f"{ctx.label} {tag} #{it + 1}")
                runs[(ctx.label, tag, it)] = run_request(engine, prompt.ids, params)
                bar.update()
            k += 1
    bar.close()
    return runs


def _row(ctx: str, tag: str, it: int, r: Run) -> dict:
    return {"context": ctx, "prompt_tokens": r.prompt_tokens, "tag": tag, "iteration": it + 1,
            "ttft_s": f"{r.ttft_s:.4f}", "prefill_tokens_per_s": f"{r.prefill_tokens_per_s:.2f}",
            "decode_tokens_per_s": f"{r.decode_tokens_per_s:.3f}", "generated_tokens": r.generated_tokens,
            "acceptance_length": f"{r.acceptance_length:.4f}" if r.spec_steps else ""}


def tables(engines: Engines, runs: dict, contexts: list[Context], iterations: int, max_tokens: int,
           notes: list[str]) -> list[str]:
    """Markdown sections: decode tokens/s in the reference benchmark's layout, then TTFT and prefill tokens/s."""
    by = defaultdict(list)
    for (ctx, tag, _), r in runs.items():
        by[(ctx, tag)].append(r)
    labels = [c.label for c in contexts]
    hw = engines.hardware
    pairs = engines.pairs()[::-1]  # the reference benchmark lists the DFlash model first

    def cells(tag: str, value) -> list[str]:
        return [report.mean_std([value(r) for r in by[(lb, tag)]]) for lb in labels]

    decode = [[tag, hw, *cells(tag, lambda r: r.decode_tokens_per_s)] for tag, _ in pairs]
    if engines.dflash is not None:
        ratio = [statistics.fmean(r.decode_tokens_per_s for r in by[(lb, engines.dflash_tag)])
                 / statistics.fmean(r.decode_tokens_per_s for r in by[(lb, engines.base_tag)]) for lb in labels]
        decode.append(["DFlash / baseline", "", *[f"{x:.2f}x" for x in ratio]])
        decode.append([f"{engines.dflash_tag} AL", "", *[report.mean_std(
            [r.acceptance_length for r in by[(lb, engines.dflash_tag)]], 2) for lb in labels]])
    prefill = []
    for tag, _ in pairs:
        prefill.append([tag, "TTFT (s)", *[report.mean_std([r.ttft_s for r in by[(lb, tag)]], 2) for lb in labels]])
        prefill.append([tag, "prefill tokens/s", *cells(tag, lambda r: r.prefill_tokens_per_s)])
    tokens = {lb: by[(lb, engines.base_tag)][0].prompt_tokens for lb in labels}
    header = (f"## flm bench: decode tokens/s (about {max_tokens} generated tokens, greedy, one prompt per "
              f"context length, mean ± std over {iterations} iterations)")
    lines = [f"Prompt tokens per context: {', '.join(f'{lb}: {n}' for lb, n in tokens.items())}.",
             f"Draft: {engines.draft or 'none (--baseline-only)'}.",
             "The prompts summarize a prefix of the first long document "
             "(flm_bench/texts/README.md, or --documents).", *notes]
    return [header, report.markdown_table(["Model", "HW", *labels], decode),
            "Time to first token and prefill speed (mean ± std):",
            report.markdown_table(["Model", "", *labels], prefill), "\n".join(f"- {ln}" for ln in lines)]


def command(args: argparse.Namespace, max_tokens: int) -> str:
    return report.command_text("bench --quick", [
        ("--tag", args.tag), ("--draft", args.draft), ("--baseline-only", args.baseline_only),
        ("--no-ngram", args.no_ngram), ("--contexts", args.contexts or QUICK_CONTEXTS), ("--max-tokens", max_tokens),
        ("--stop-at-eos", args.stop_at_eos), ("--iterations", args.iterations), ("--prompts", args.prompts),
        ("--documents", args.documents), ("--out", args.out)])
