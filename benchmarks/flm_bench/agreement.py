"""``litellm-flm agreement``: does the 8-token verify pass pick the tokens token-by-token decoding picks?

Teacher-forced on real text (the long documents of ``documents.py``): for each context length and
document, the target prefills ``context`` tokens of the text, then computes the logits of the next
``--positions`` positions of the same text twice:

- the **verify path**: ``forward(8 tokens, all_logits=True)`` blocks, each appending to the KV
  cache the previous blocks wrote, as speculative steps do (the 8-token layer);
- the **reference**: token-by-token decoding (the 1-token layer) of the same tokens, on the float32
  weights of the same files (``--reference f32``, the default: the reference benchmark compares its NPU path
  with token-by-token decoding the same way) or on the served model itself (``--reference same``:
  its own prefill, the cache trimmed back to the context, rollback being a trim).

At each position the verify path's pick (argmax) is compared with the reference's:

- **same top-1**: the two argmaxes are equal;
- **different by more than a near-tie**: they differ, and in the reference logits the pick trails
  the reference's top-1 by more than a near-tie;
- **near-tie**: a margin ``ref[top1] - ref[pick]`` of at most ``NEAR_TIE_STEPS`` = 2 bfloat16
  rounding steps of ``ref[top1]``, where one step at ``x`` is the spacing of bfloat16 numbers there,
  ``2 ** (floor(log2 |x|) - 7)`` (8 significant bits; ``|x|`` below 2**-126 counts as 2**-126).
  When the pick is the reference's second-best token this is the reference benchmark's "top-1 / top-2 logit
  margin of 2 bf16 rounding steps or less". A difference within a near-tie is a valid greedy
  continuation either way;
- **cosine**: of the two logit vectors (float64), averaged over positions.

Files in ``--out``: ``agreement.md`` (the reference benchmark's table, the command, the machine) and
``agreement.csv`` (one row per context and document, then one total row per context).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from flm_bench import report
from flm_bench.documents import load_documents, token_stream
from flm_bench.engines import Context, parse_contexts
from flm_bench.options import agreement_arguments
from flm_runtime import InvalidRequestError, get_engine
from flm_runtime import pull
from flm_runtime.backends import decode, forward, prefill
from flm_runtime.cli import Command
from flm_runtime.loading import load_model_files
from flm_runtime.models.causal_lm import CausalLM

NEAR_TIE_STEPS = 2
BF16_MANTISSA_BITS = 7  # explicit fraction bits of bfloat16 (8 significant bits with the implicit one)
BF16_MIN_NORMAL = 2.0 ** -126
COLUMNS = ("context", "context_tokens", "document", "positions", "same_top1", "same_top1_pct",
           "beyond_near_tie", "beyond_near_tie_pct", "within_near_tie", "mean_cosine", "max_abs_logit_diff")


def bf16_step(x: np.ndarray | float) -> np.ndarray:
    """The spacing of bfloat16 numbers at ``x`` (one rounding step): ``2 ** (floor(log2 |x|) - 7)``.

    Args:
        x: ``[...]`` values (logits).
    Returns:
        ``[...]`` float64 steps; values below the smallest normal bfloat16 take its step.
    """
    a = np.maximum(np.abs(np.asarray(x, dtype=np.float64)), BF16_MIN_NORMAL)
    return np.exp2(np.floor(np.log2(a)) - BF16_MANTISSA_BITS)


@dataclass
class Agreement:
    """Counts over compared positions (add two with ``+``).

    Attributes:
        positions: positions compared.
        same_top1: positions where both paths pick the same token.
        beyond_near_tie: positions where they differ by more than a near-tie.
        cosine_sum: sum of the per-position cosines of the two logit vectors.
        max_abs_diff: largest absolute difference of one logit between the paths.
    """

    positions: int = 0
    same_top1: int = 0
    beyond_near_tie: int = 0
    cosine_sum: float = 0.0
    max_abs_diff: float = 0.0

    def __add__(self, other: Agreement) -> Agreement:
        return Agreement(self.positions + other.positions, self.same_top1 + other.same_top1,
                         self.beyond_near_tie + other.beyond_near_tie, self.cosine_sum + other.cosine_sum,
                         max(self.max_abs_diff, other.max_abs_diff))

    @property
    def within_near_tie(self) -> int:
        """Positions that differ, but by a near-tie at most."""
        return self.positions - self.same_top1 - self.beyond_near_tie

    @property
    def same_top1_pct(self) -> float:
        return 100.0 * self.same_top1 / self.positions if self.positions else 0.0

    @property
    def beyond_near_tie_pct(self) -> float:
        return 100.0 * self.beyond_near_tie / self.positions if self.positions else 0.0

    @property
    def mean_cosine(self) -> float:
        return self.cosine_sum / self.positions if self.positions else 0.0


def compare_logits(reference: np.ndarray, test: np.ndarray) -> Agreement:
    """Compare the picks of ``test`` with those of ``reference``, position by position.

    Args:
        reference: ``[P, V]`` logits of token-by-token decoding.
        test: ``[P, V]`` logits of the verify path at the same positions.
    Returns:
        the counts (see the module docstring for the near-tie rule).
    """
    assert reference.shape == test.shape and reference.ndim == 2, f"{reference.shape} vs {test.shape}"
    ref = reference.astype(np.float64)
    tst = test.astype(np.float64)
    rows = np.arange(ref.shape[0])
    ref_top = np.argmax(ref, axis=-1)  # [P]
    pick = np.argmax(tst, axis=-1)  # [P]
    top_value = ref[rows, ref_top]  # [P]
    margin = top_value - ref[rows, pick]  # [P] >= 0, 0 where the picks agree
    same = ref_top == pick
    beyond = ~same & (margin > NEAR_TIE_STEPS * bf16_step(top_value))
    cosine = np.einsum("pv,pv->p", ref, tst) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(tst, axis=-1))
    return Agreement(ref.shape[0], int(same.sum()), int(beyond.sum()), float(cosine.sum()),
                     float(np.max(np.abs(ref - tst))))


def teacher_forced(model, ids: np.ndarray, context: int, positions: int, block: int,
                   step=lambda n: None, reference=None) -> Agreement:
    """Prefill ``ids[:context]``, then compare the verify path with token-by-token decoding on the
    next ``positions`` positions (see the module docstring).

    Args:
        model: the target (``forward``, ``prefill``, ``decode``, ``new_cache``).
        reference: the model that decodes token by token (another copy of the weights, with its
            own prefill); None: ``model`` itself.
        ids: ``[>= context + positions]`` int64 token ids of the text.
        context: tokens prefilled.
        positions: positions compared, a multiple of ``block``.
        block: positions per verify pass (8).
        step: called with the number of tokens each pass ran (progress: the prefill, then each
            verify pass and each block of decode steps).
    """
    assert positions % block == 0, f"positions {positions} must be a multiple of the block {block}"
    assert ids.shape[0] >= context + positions, "the text is shorter than context + positions"
    cache = model.new_cache(context + positions)
    prefill(model, ids[:context], cache)
    step(context)
    verify = []
    for s in range(context, context + positions, block):
        verify.append(forward(model, ids[s : s + block], cache, all_logits=True).logits)  # [block, V]
        step(block)
    if reference is None:
        reference, ref_cache = model, cache
        cache.trim(context)
    else:
        ref_cache = reference.new_cache(context + positions)
        prefill(reference, ids[:context], ref_cache)
        step(context)
    total = Agreement()
    for b, s in enumerate(range(context, context + positions, block)):
        decoded = np.stack([decode(reference, int(ids[p]), ref_cache).logits for p in range(s, s + block)])  # [block, V]
        total = total + compare_logits(decoded, verify[b])
        step(block)
    return total


def main(args: argparse.Namespace) -> int:
    if args.block < 2 or args.positions < args.block or args.positions % args.block:
        raise InvalidRequestError(f"--positions ({args.positions}) must be a positive multiple of --block "
                                  f"({args.block})", param="--positions")
    engine = get_engine(args.tag)
    model, tok = engine.model, engine.tokenizer
    contexts, notes = parse_contexts(args.contexts, engine.context_length, args.positions)
    if any(c.tokens is None for c in contexts):
        raise InvalidRequestError("agreement needs context lengths in tokens (N, Nk or max), not 'short'",
                                  param="--contexts")
    docs = load_documents(args.documents)
    info = report.machine_info()
    reference = None
    if args.reference == "f32":
        bundle = load_model_files(pull.locate(args.tag), weights="f32")
        reference = CausalLM(bundle.config, bundle.weights)
    prefills = 1 if reference is None else 2
    work = sum(prefills * c.tokens + 2 * args.positions for c in contexts) * len(docs)  # prefilled, compared twice
    bar = tqdm(total=work, desc="agreement", unit="tok", disable=args.quiet, file=sys.stderr)
    rows, totals = [], []
    for ctx in contexts:
        total = Agreement()
        for i, doc in enumerate(docs):
            bar.set_postfix_str(f"{ctx.label} {doc.name}")
            ids = np.asarray(token_stream(tok, docs, i, ctx.tokens + args.positions), dtype=np.int64)
            a = teacher_forced(model, ids, ctx.tokens, args.positions, args.block, bar.update, reference)
            rows.append(_row(ctx, doc.name, a))
            total = total + a
        rows.append(_row(ctx, "all", total))
        totals.append((ctx, total))
    bar.close()
    out = report.output_dir(args.out)
    report.write_csv(out / "agreement.csv", COLUMNS, rows)
    sections = tables(args, engine, totals, len(docs), notes)
    report.write_report(out / "agreement.md", "Agreement with token-by-token decoding", command(args), sections, info)
    print(sections[1])
    print(f"litellm-flm agreement: wrote {out / 'agreement.md'}, {out / 'agreement.csv'}")
    return 0


def _row(ctx: Context, document: str, a: Agreement) -> dict:
    return {"context": ctx.label, "context_tokens": ctx.tokens, "document": document, "positions": a.positions,
            "same_top1": a.same_top1, "same_top1_pct": f"{a.same_top1_pct:.3f}",
            "beyond_near_tie": a.beyond_near_tie, "beyond_near_tie_pct": f"{a.beyond_near_tie_pct:.3f}",
            "within_near_tie": a.within_near_tie, "mean_cosine": f"{a.mean_cosine:.8f}",
            "max_abs_logit_diff": f"{a.max_abs_diff:.3g}"}


def tables(args: argparse.Namespace, engine, totals: list[tuple[Context, Agreement]], n_docs: int,
           notes: list[str]) -> list[str]:
    n = sum(a.positions for _, a in totals)
    where = ", ".join(c.label for c, _ in totals)
    header = (f"## Agreement with token-by-token decoding\n\nThe verify path checks {args.block} positions in one "
              f"pass. Teacher-forced on real text ({n:,} positions at {where} tokens of context: {args.positions} "
              f"per document, {n_docs} documents), the token it picks at each position matches token-by-token "
              f"decoding of `{args.tag}` ({engine.model.backend.value} backend; reference: "
              f"{'its float32 weights' if args.reference == 'f32' else 'the same weights'}):")
    table = report.markdown_table(
        ["Context", "Positions", "Same top-1 token", "Different by more than a near-tie", "Mean cosine of the logits",
         "Largest logit difference"],
        [[c.label, a.positions, f"{a.same_top1_pct:.2f}%", f"{a.beyond_near_tie_pct:.2f}%", f"{a.mean_cosine:.6f}",
          f"{a.max_abs_diff:.2g}"] for c, a in totals])
    lines = [f"A \"near-tie\" is a margin, in the token-by-token logits, between their top-1 token and the verify "
             f"path's pick of {NEAR_TIE_STEPS} bfloat16 rounding steps of the top-1 logit or less (one step at x: "
             f"2^(floor(log2|x|) - 7)); for a pick that is the second-best token, the reference benchmark's top-1 / top-2 margin.",
             "Text: " + ("the public-domain documents shipped in the package (flm_bench/texts/README.md)"
                         if args.documents is None else f"the *.txt files of {args.documents}")
             + "; a context longer than one document continues with the next.", *notes]
    return [header, table, "\n".join(f"- {ln}" for ln in lines)]


def command(args: argparse.Namespace) -> str:
    return report.command_text("agreement", [
        ("--tag", args.tag), ("--contexts", args.contexts), ("--positions", args.positions), ("--block", args.block),
        ("--reference", args.reference), ("--documents", args.documents), ("--out", args.out)])


# The subcommand ``litellm-flm agreement`` (entry point of the group ``litellm_flm.commands``).
COMMAND = Command("agreement", "the 8-token verify path against token-by-token decoding, teacher-forced on real "
                  "text", main, agreement_arguments)
