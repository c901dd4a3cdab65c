"""What one DFlash speculative step costs, as ratios to a 1-token decode, all measured in this run.

Per context length, rounds interleave (so that machine noise hits all alike). Medians are
reported, and minima too: on a shared machine the fastest round of each operation is the one least
disturbed by other processes, so the ratio of minima estimates the quiet-machine ratio.

- decode: ``forward([token])`` on the target (the 1-token layer), then rolled back;
- verify: ``forward(8 tokens, all_logits=True, taps=...)`` (the 8-token pass), then rolled back;
- propose: the draft's ``propose`` (its layers over [context ; block] and the target's LM head on 7 rows);
- add_context: the draft projecting one committed token's taps to context K/V.

Speculation pays when ``AL * t_decode > t_propose + t_add + t_verify`` (docs/design.md,
"Speculation policy"), so ``(propose + add + verify) / decode`` is the break-even acceptance
length (AL, bonus included).

    python benchmarks/speculative_costs.py [--tag smollm2:135m] [--draft DIR | --draft-layers 1]
        [--contexts 0,1024] [--rounds 30]

Without ``--draft`` a random draft of the target's geometry is used (costs do not depend on the
weights). On machines that set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (older-CPU workarounds that
slow a current numpy), say so when you quote a figure measured with them unset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flm_runtime.api import load_model
from flm_runtime.backends import forward, prefill
from flm_bench import report
from flm_runtime.models.dflash import DFlashDraft


def random_draft(model, layers: int) -> DFlashDraft:
    """A random draft of ``model``'s geometry, through the file format (tests' writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
    from dflash_files import draft_config_dict, random_draft_weights, write_draft_dir

    cfg = draft_config_dict(model.config, layers=layers, mask_token_id=0)
    with tempfile.TemporaryDirectory() as tmp:
        return DFlashDraft.load(write_draft_dir(Path(tmp), cfg, random_draft_weights(cfg, scale=0.05)), model)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(model, draft, prompt: np.ndarray, rounds: int) -> dict[str, list[float]]:
    """Seconds of each operation at context ``len(prompt)``, one per round."""
    taps = draft.config.target_layer_ids
    cache, dcache = model.new_cache(len(prompt) + 16), draft.new_cache(len(prompt) + 16)
    out = prefill(model, prompt, cache, taps=taps)
    draft.add_context(dcache, out.taps, 0)
    start = cache.length
    block = np.array([int(np.argmax(out.logits))] * 8)
    one_tap = out.taps[-1:]
    times: dict[str, list[float]] = {"decode": [], "verify": [], "propose": [], "add_context": []}
    for _ in range(rounds):
        times["decode"].append(timed(lambda: forward(model, block[:1], cache)))
        cache.trim(start)
        times["verify"].append(timed(lambda: forward(model, block, cache, all_logits=True, taps=taps)))
        cache.trim(start)
        times["propose"].append(timed(lambda: draft.draft_block(dcache, int(block[0]), start)))
        times["add_context"].append(timed(lambda: draft.add_context(dcache, one_tap, start)))
        dcache.trim(start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--draft", type=Path, help="a draft directory (default: random weights)")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the random draft")
    parser.add_argument("--contexts", default="0", help="comma-separated extra context lengths (tokens)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    loaded = load_model(args.tag)
    model, tok = loaded.model, loaded.tokenizer
    draft = DFlashDraft.load(args.draft, model) if args.draft else random_draft(model, args.draft_layers)
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the ocean."}],
                                              add_generation_prompt=True))
    filler = tok.encode(" The sea is wide and the waves are high." * 1000)
    print(f"model {args.tag}; draft: {args.draft or f'random, {args.draft_layers} layer(s)'} "
          f"({draft.config.num_hidden_layers} layers, taps {list(draft.config.target_layer_ids)})")
    print("context |  stat  | decode ms | verify8 ms | propose ms | add ms | verify/decode "
          "| propose/decode | break-even AL")
    for extra in (int(c) for c in args.contexts.split(",")):
        prompt = np.array(filler[:extra] + chat, dtype=np.int64)
        times = measure(model, draft, prompt, args.rounds)
        for stat, agg in (("median", statistics.median), ("min", min)):
            t = {k: agg(v) for k, v in times.items()}
            d = t["decode"]
            print(f"{len(prompt):7d} | {stat:6s} | {d * 1e3:9.1f} | {t['verify'] * 1e3:10.1f} | "
                  f"{t['propose'] * 1e3:10.1f} | {t['add_context'] * 1e3:6.2f} | "
                  f"{t['verify'] / d:13.2f} | {t['propose'] / d:14.2f} | "
                  f"{(t['verify'] + t['propose'] + t['add_context']) / d:13.2f}")
    print(report.run_conditions())


if __name__ == "__main__":
    main()
