"""Acceptance length of a draft with the *serving* runtime (numpy; no torch) on MT-Bench first turns.

    python -m flm_train.eval_al --draft runtime/flm_runtime/drafts/smollm2-135m-dflash \\
        --questions ../shared/data/mt_bench_questions.jsonl [--n 80] [--max-new 256]

Greedy, each first turn through the target's chat template, ``--max-new`` tokens or the end of
turn; all questions run at once in one serving engine with the draft (batched speculative steps,
whole blocks, no speculation policy). AL = tokens emitted by speculative steps / steps (includes
the bonus token), pooled over all questions; per-category ALs too.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flm_train.eval_al", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2:135m")
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--questions", type=Path, required=True, help="MT-Bench question.jsonl")
    p.add_argument("--n", type=int, default=80, help="questions (the first n)")
    p.add_argument("--per-category", type=int, default=0, help="instead: the first N questions of each category")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    a = p.parse_args(argv)

    from flm_runtime import Engine, SamplingParams, SpeculativeDecoder, load_model
    from flm_runtime import registry
    from flm_runtime.models.dflash import DFlashDraft

    loaded = load_model(a.target)
    entry = registry.resolve(a.target)
    draft = DFlashDraft.load(a.draft, loaded.model, target_sha256=entry.files[0].sha256 if entry.files else None)
    params = SamplingParams(max_tokens=a.max_new, temperature=0.0)
    tok = loaded.tokenizer
    questions = [json.loads(line) for line in a.questions.read_text().splitlines() if line.strip()]
    if a.per_category:
        kept: dict[str, list[dict]] = defaultdict(list)
        for q in questions:
            if len(kept[q["category"]]) < a.per_category:
                kept[q["category"]].append(q)
        questions = [q for qs in kept.values() for q in qs]
    else:
        questions = questions[: a.n]
    decoder = SpeculativeDecoder(loaded.model, draft, ngram=False)  # the draft's own AL, no prompt lookup
    engine = Engine(loaded.model, tok, name="eval_al", speculative=decoder, max_active=len(questions),
                    max_queue=len(questions))
    t0 = time.time()
    handles = [engine.submit(tok.encode(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}])), params)
               for q in questions]
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # category -> [emitted, steps]
    n_tokens = 0
    for q, handle in zip(questions, handles):
        s = handle.result().stats
        n_tokens += s.generated_tokens
        by_cat[q["category"]][0] += s.spec.emitted
        by_cat[q["category"]][1] += s.spec.steps
        print(f"q{q['question_id']} {q['category']}: {s.generated_tokens} tokens, AL {s.spec.acceptance_length:.2f}",
              flush=True)
    engine.close()
    emitted = sum(v[0] for v in by_cat.values())
    steps = sum(v[1] for v in by_cat.values())
    result = {"acceptance_length": emitted / max(1, steps), "questions": len(questions), "tokens": n_tokens,
              "seconds": round(time.time() - t0, 1), "tokens_per_s": round(n_tokens / (time.time() - t0), 1),
              "per_category": {k: round(v[0] / max(1, v[1]), 3) for k, v in sorted(by_cat.items())},
              "draft": str(a.draft), "max_new": a.max_new}
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
