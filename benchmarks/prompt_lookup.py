"""AL with the prompt-lookup (n-gram) proposer beside the draft, against the draft alone.

The DFlash tag's draft verifying whole blocks at every step (``ALWAYS_SPECULATE``, as the reference
benchmark runs it, docs/benchmarks.md), greedy (``--sampled``: the model's default sampler, seeded), twice over the same prompts:
``SpeculativeDecoder(ngram=True)`` then ``ngram=False``, each engine running all prompts in one
batch. Prompts: the first turns of a ``question.jsonl`` (``--prompts``, the first ``--n``), and
per ``--contexts`` entry the bench's "summarize this" prompt of that many tokens around each
shipped document (``documents.summary_prompt``). Prints, per prompt set and engine: AL over all
speculative steps, and apart the n-gram proposer's steps and AL and the draft's; then whether both
engines gave the same tokens (they must: the verifier is the same).

    python benchmarks/prompt_lookup.py [--tag smollm2-dflash:135m] [--prompts question.jsonl]
        [--n 80] [--contexts 4096,8064] [--max-new 128] [--sampled]

AL only, no timing; figures: docs/benchmarks.md, "`benchmarks/prompt_lookup.py`".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flm_runtime.api import get_engine
from flm_bench import documents
from flm_runtime.request import Completion
from flm_runtime.scheduling.engine import Engine
from flm_runtime.speculation.speculative import SpeculativeDecoder


def run(spec, tok, prompts: list[list[int]], params, ngram: bool) -> list[Completion]:
    """All ``prompts`` in one batch on an engine around ``spec``'s target and draft."""
    engine = Engine(spec.target, tok, name=f"ngram-{ngram}", max_active=len(prompts), max_queue=len(prompts),
                    speculative=SpeculativeDecoder(spec.target, spec.draft, ngram=ngram))
    try:
        with engine.held():  # all queued before the first step: one batch
            handles = [engine.submit(p, params) for p in prompts]
        return [h.result() for h in handles]
    finally:
        engine.close()


def summary(done: list[Completion]) -> str:
    s = [d.stats.spec for d in done]
    steps, emitted = sum(x.steps for x in s), sum(x.emitted for x in s)
    n_steps, n_emitted = sum(x.counts("ngram").steps for x in s), sum(x.counts("ngram").emitted for x in s)
    d_steps = steps - n_steps
    return (f"AL {emitted / steps:.3f} over {steps} steps; n-gram {n_steps} steps, AL "
            f"{n_emitted / n_steps if n_steps else 0.0:.3f}; draft {d_steps} steps, AL "
            f"{(emitted - n_emitted) / d_steps if d_steps else 0.0:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default="smollm2-dflash:135m")
    p.add_argument("--prompts", default=None, help="a question.jsonl (first turns)")
    p.add_argument("--n", type=int, default=80, help="questions (the first n)")
    p.add_argument("--contexts", default="", help="comma-separated summary prompt lengths in tokens")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--sampled", action="store_true", help="the model's default sampler (seeded) instead of greedy")
    a = p.parse_args()

    engine = get_engine(a.tag, "cpu")
    spec, tok = engine.speculative, engine.tokenizer
    given = {} if a.sampled else {"temperature": 0.0}
    params = engine.sampling_params(max_tokens=a.max_new, seed=0, ignore_eos=True, **given)
    sets = {}
    if a.prompts:
        questions = [json.loads(ln) for ln in Path(a.prompts).read_text().splitlines() if ln.strip()][: a.n]
        sets["questions"] = [documents.chat_ids(tok, q["turns"][0]) for q in questions]
    docs = documents.load_documents()
    for n in (int(c) for c in a.contexts.split(",") if c.strip()):
        sets[f"summaries of {n} tokens"] = [list(documents.summary_prompt(tok, d, n).ids) for d in docs]
    for name, prompts in sets.items():
        both = {ngram: run(spec, tok, prompts, params, ngram) for ngram in (True, False)}
        print(f"{name} ({len(prompts)} prompts, {a.max_new} new tokens, {'sampled' if a.sampled else 'greedy'}):")
        print(f"  draft + n-gram: {summary(both[True])}")
        print(f"  draft alone:    {summary(both[False])}")
        print(f"  same tokens: {all(x.token_ids == y.token_ids for x, y in zip(both[True], both[False]))}")


if __name__ == "__main__":
    main()
