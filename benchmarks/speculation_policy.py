"""A request whose acceptance collapses: the speculation policy turns DFlash off for it. Its speed
against the baseline tag, and against speculating regardless, measured in the same run.

Three engines over the same SmolLM2 target object, each running the same greedy request (random
digits: no draft predicts them) in interleaved rounds:

- ``baseline``: plain decoding (the ``smollm2:135m`` tag's engine);
- ``policy``: the DFlash draft with a policy table that *does* speculate at every context, with the
  cost ratio (propose + verify of 8 positions, over a decode) measured at the start of this run and
  an expected AL of ``--expected-al`` (what a draft that pays on ordinary chat calibrates to): the
  request's own acceptance estimate must switch it off (``flm_runtime.speculation.policy``);
- ``always``: the same draft speculating at every step (no policy), for comparison.

Prints tokens/s (generated tokens over the request's wall time, prefill included, as a user sees
it), the ratio of each DFlash engine to the baseline per round (median and minimum over rounds),
and the policy request's speculative steps, switches off and AL. The project's bar: the policy
request no more than 10% slower than the baseline (ratio >= 0.90).

    python benchmarks/speculation_policy.py [--draft-tag smollm2-dflash:135m] [--max-tokens 256]
        [--rounds 5] [--expected-al 3.0]
"""

from __future__ import annotations

import argparse
import statistics

from flm_runtime import api, registry
from flm_runtime.speculation import decoders
from flm_bench.calibrate import step_costs
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.engine import Engine
from flm_runtime.speculation.policy import Bucket, PolicyTable
from flm_runtime.speculation.speculative import SpeculativeDecoder

PROMPT = "Write 300 random digits, separated by spaces, with no pattern at all."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-tag", default="smollm2-dflash:135m")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--expected-al", type=float, default=3.0)
    a = p.parse_args()

    import numpy as np

    entry = registry.resolve(a.draft_tag)
    baseline = api.get_engine(entry.base, "cpu")
    model, tok = baseline.model, baseline.tokenizer
    draft = decoders.load_draft(entry.tag, model)
    costs = step_costs(SpeculativeDecoder(model, draft), 64, 5, np.random.default_rng(0))
    ratio = (costs["propose"] + costs["verify"][-1]) / costs["decode"]
    table = PolicyTable(model=entry.tag, backend="cpu", buckets=[Bucket(
        max_context=model.config.max_position_embeddings, speculate=True, draft_length=7,
        cost_ratio=round(ratio, 4), expected_al=a.expected_al)], measured={"note": "benchmarks/speculation_policy.py"})
    print(f"policy table: speculate at every context, cost ratio {ratio:.2f} (measured now), "
          f"expected AL {a.expected_al}")
    engines = {"baseline": baseline,
               "policy": Engine(model, tok, name="policy", speculative=SpeculativeDecoder(model, draft, policy=table)),
               "always": Engine(model, tok, name="always", speculative=SpeculativeDecoder(model, draft))}
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    stats = None
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            done = engines[name].submit(ids, params).result()
            rates[name].append(done.stats.generated_tokens / done.stats.total_s)
            stats = done.stats if name == "policy" else stats
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in engines))
    for name in ("policy", "always"):
        per_round = [x / b for x, b in zip(rates[name], rates["baseline"])]
        print(f"{name} / baseline: median {statistics.median(per_round):.3f}, min {min(per_round):.3f}, "
              f"max {max(per_round):.3f} (per round)")
    print(f"policy request: {stats.spec.steps} speculative steps in {stats.generated_tokens} tokens, "
          f"switched off {stats.spec.switches_off} time(s), AL of its steps {stats.spec.acceptance_length:.2f}")
    for name in ("policy", "always"):
        engines[name].close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
