"""How well the draft's confidence predicts acceptance, and what the confidence gate is worth.

Greedy, whole blocks (K = 7): every speculative step's drafted tokens with the draft's softmax
probability of each (``Proposal.confidence``) and the tokens the target accepted
(``calibrate.acceptance_records``), on chat prompts: calibration's own, or the first turns of a
``question.jsonl`` (``--prompts``). Then, in the same run, the step costs at ``--context`` tokens
(``calibrate.step_costs``, interleaved rounds) and, from them and the records, the expected
speed-up of every draft length K with and without a confidence gate (``calibrate.choose``'s
arithmetic: ``Acceptance.tokens_and_cost``). Prints:

1. acceptance of the first drafted token by the draft's confidence in it;
2. per K: tokens per step and speed-up without a gate, and with the best gate of
   ``calibrate.GATES`` (its share of steps left plain).

    python benchmarks/draft_confidence.py [--tag smollm2-dflash:135m] [--prompts question.jsonl]
        [--n 8] [--max-new 256] [--context 256] [--rounds 9]

Each figure is measured in this run; the step costs move with the machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

from flm_runtime.api import get_engine
from flm_bench import calibrate, documents
from flm_runtime.outputs import confident_length
from flm_runtime.speculation.speculative import SpeculativeDecoder

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default="smollm2-dflash:135m")
    p.add_argument("--prompts", default=None, help="a question.jsonl (first turns); default: calibration's prompts")
    p.add_argument("--n", type=int, default=8, help="prompts (the first n)")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--context", type=int, default=256, help="tokens of context for the step costs")
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()

    engine = get_engine(a.tag, "cpu")
    spec, tok = engine.speculative, engine.tokenizer
    # ALWAYS_SPECULATE: whole blocks, no gate; the draft alone: its confidence is what is measured
    decoder = SpeculativeDecoder(spec.target, spec.draft, ngram=False)
    if a.prompts:
        texts = [text for _, text in documents.short_prompts(a.prompts, a.n)]
    else:
        texts = calibrate.CALIBRATION_PROMPTS[: a.n]
    prompts = [documents.chat_ids(tok, t) for t in texts]
    with tqdm(total=len(prompts) * a.max_new, desc="acceptance", unit="tok") as bar:
        acceptance = calibrate.acceptance_records(decoder, tok, prompts, a.max_new, bar)
    costs = calibrate.step_costs(decoder, a.context, a.rounds, np.random.default_rng(0))
    engine.close()

    first, accepted = acceptance.confidence[:, 0], acceptance.accepted
    print(f"\n{len(accepted)} whole-block steps on {len(prompts)} prompts, AL at K = 7: {accepted.mean() + 1:.2f}")
    print("\n| draft's confidence in d1 | steps | share | d1 accepted | AL at K = 7 |\n|---|---:|---:|---:|---:|")
    for lo, hi in zip(BINS, BINS[1:]):
        rows = (first >= lo) & ((first < hi) if hi < 1.0 else (first <= hi))
        if rows.any():
            print(f"| {lo:.2f}-{hi:.2f} | {rows.sum()} | {rows.mean():.0%} | {(accepted[rows] >= 1).mean():.0%} | "
                  f"{accepted[rows].mean() + 1:.2f} |")
    decode = costs["decode"]
    print(f"\nstep costs at {a.context} tokens: decode {1e3 * decode:.1f} ms; verify of K+1 rows / decode "
          + " ".join(f"{v / decode:.2f}" for v in costs["verify"])
          + f"; propose / decode {costs['propose'][0] / decode:.2f}-{costs['propose'][-1] / decode:.2f}")
    print("\n| K | tokens per step, no gate | speed-up, no gate | best gate | steps left plain | tokens per step | "
          "speed-up |\n|---:|---:|---:|---:|---:|---:|---:|")
    for k in range(1, acceptance.confidence.shape[1] + 1):
        al, ratio = acceptance.tokens_and_cost(k, 0.0, costs)
        gate = max(calibrate.GATES, key=lambda g: np.divide(*acceptance.tokens_and_cost(k, g, costs)))
        gal, gratio = acceptance.tokens_and_cost(k, gate, costs)
        plain = (confident_length(acceptance.confidence[:, :k], gate) == 0).mean()
        print(f"| {k} | {al:.2f} | {al / ratio:.3f}x | {gate:g} | {plain:.0%} | {gal:.2f} | {gal / gratio:.3f}x |")


if __name__ == "__main__":
    main()
