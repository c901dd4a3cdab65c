"""Where a served speculative step's time goes, against the baseline engine's step, same run.

``benchmarks/speculative_costs.py`` and ``litellm-flm calibrate`` time the passes of a step alone.
This script times them where they run when serving: inside the engine threads of the baseline tag
and of its DFlash tag, on the same chat prompts (``documents.short_prompts``), greedy,
``--max-tokens`` tokens each (end of turn ignored), the two engines alternating request by
request with the order flipped every round. The DFlash engine is given a one-bucket policy table
that drafts ``--k`` tokens at every step (no switch-off), so every step is a speculative one; or,
with ``--policy FILE``, that table as served (its buckets and the per-request acceptance tracker),
to see where a served run's time goes against what calibration expected.

Per engine, over all its steps (the engine's ``on_step`` hook, ``StepTiming``): milliseconds per
step of the whole step, of the target pass, of the draft's work (``SpeculativeDecoder.prepare``:
catching up on the pending taps, then proposing) and of the commit (verify, KV roll-back,
sampling, emitting); decode tokens/s and AL from the engines' own stats.
The DFlash engine's steps are also split by the tokens they verify, K (K = 0: a plain step; "K = 0
gated": the confidence gate left nothing to verify), with their count and ms per step. Then
``step / baseline step`` is the served cost of a speculative step in decodes: speculation pays
where AL exceeds it (docs/design.md, "Speculation policy"). Forced, the same passes are then
timed alone in the main thread by calibration's own measurement (``calibrate.step_costs``, 9
interleaved rounds, medians).

    python benchmarks/served_step_cost.py [--k 1 | --policy FILE] [--max-tokens 256] [--prompts 3] [--rounds 2]

Timing is the engines' own (``time.perf_counter``, per step).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from flm_bench import calibrate
from flm_bench.documents import chat_ids, short_prompts
from flm_bench.engines import load_engines, run_request
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.engine import StepTiming
from flm_runtime.speculation.policy import Bucket, PolicyTable
from flm_runtime.speculation.speculative import SpeculativeDecoder


class StepRecorder:
    """An engine's ``on_step``: the seconds of its steps, summed per phase and per step label."""

    PHASES = {"step": "total_s", "target pass": "forward_s", "draft (catch-up + propose)": "propose_s",
              "commit (verify, roll back, sample, emit)": "commit_s"}

    def __init__(self):
        self.steps = 0
        self.seconds: collections.Counter = collections.Counter()  # phase -> seconds
        self.by_label: collections.Counter = collections.Counter()  # step label -> seconds
        self.label_steps: collections.Counter = collections.Counter()

    def __call__(self, timing: StepTiming) -> None:
        self.steps += 1
        for phase, field in self.PHASES.items():
            self.seconds[phase] += getattr(timing, field)
        label = step_label(timing)
        self.by_label[label] += timing.total_s
        self.label_steps[label] += 1

    def per_step_ms(self) -> dict[str, float]:
        return {phase: 1e3 * s / self.steps for phase, s in self.seconds.items()}

    def by_k(self) -> list[tuple[str, int, float]]:
        """(label ``K=k``, steps, ms per step) of the steps split by the tokens they verify."""
        return sorted((label, n, 1e3 * self.by_label[label] / n) for label, n in self.label_steps.items())


def step_label(timing: StepTiming) -> str:
    """``K=k``, the tokens the (one) decoding lane's step verifies (``K=0 gated`` for a step the
    confidence gate left plain, after the draft ran; ``K=none`` for a step without decoding lanes:
    the prefill)."""
    if not timing.records:
        return "K=none"
    draft = timing.records[0]
    return f"K={len(draft.ids)}{' gated' if draft.gated else ''}"


def forced_policy(k: int) -> PolicyTable:
    """Speculate with draft length ``k`` at every context, never switching off."""
    return PolicyTable(model="forced", backend="cpu", buckets=[
        Bucket(max_context=1 << 20, speculate=True, draft_length=k, cost_ratio=1e-3, expected_al=1.0)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", default="smollm2:135m", help="the baseline tag (its DFlash tag is compared)")
    p.add_argument("--k", type=int, default=1, help="drafted tokens per step (1-7)")
    p.add_argument("--policy", type=Path, default=None,
                   help="serve with this policy table (and its acceptance tracker) instead of forcing --k")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()

    engines = load_engines(a.tag)
    base, spec = engines.baseline, engines.dflash
    # A decoder of its own for the policy: it asks the target for the draft's taps only where the
    # policy drafts, which is fixed when it is built (the shipped table never drafts).
    served = spec.speculative
    decoder = spec.speculative = SpeculativeDecoder(
        served.target, served.draft, policy=forced_policy(a.k) if a.policy is None else PolicyTable.load(a.policy),
        ngram=served.ngram, suffix=served.suffix)
    prompts = [chat_ids(base.tokenizer, text) for _, text in short_prompts(n=a.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for engine in (base, spec):  # warm-up: compiled kernels, first allocations
        run_request(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=16))
    recorders = {engine.name: StepRecorder() for engine in (base, spec)}
    for engine in (base, spec):
        engine.on_step = recorders[engine.name]
    runs = {base.name: [], spec.name: []}
    for r in range(a.rounds):
        for prompt in prompts:
            for engine in ((base, spec) if r % 2 == 0 else (spec, base)):
                runs[engine.name].append(run_request(engine, prompt, params))

    step_ms = {}
    for engine in (base, spec):
        done = runs[engine.name]
        tokens, seconds = sum(r.generated_tokens - 1 for r in done), sum(r.decode_s for r in done)
        steps = sum(r.spec_steps for r in done)
        al = f", AL {sum(r.acceptance_length * r.spec_steps for r in done) / steps:.2f}" if steps else ""
        print(f"{engine.name}: {tokens / seconds:.1f} decode tokens/s{al}")
        parts = recorders[engine.name].per_step_ms()
        step_ms[engine.name] = parts["step"]
        for label, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"    {label:40s} {ms:7.2f} ms/step")
    for label, steps, ms in recorders[spec.name].by_k():
        print(f"    steps with {label:23s} {steps:6d} steps {ms:7.2f} ms/step = {ms / step_ms[base.name]:.3f} decodes")
    switches = sum(r.spec_switches_off for r in runs[spec.name])
    print(f"    acceptance tracker switched speculation off {switches} times")
    if a.policy is not None:
        return 0
    print(f"served speculative step (K={a.k}) / baseline step: {step_ms[spec.name] / step_ms[base.name]:.3f} decodes")
    context = len(prompts[0]) + a.max_tokens // 2
    costs = calibrate.step_costs(decoder, context, rounds=9, rng=np.random.default_rng(0))
    alone = {"decode": costs["decode"], "verify": costs["verify"][a.k - 1], "propose": costs["propose"][a.k - 1]}
    print(f"alone at context {context} (calibrate's step costs): "
          + ", ".join(f"{n} {1e3 * sec:.2f} ms" for n, sec in alone.items())
          + f"; (propose + verify) / decode = {(alone['propose'] + alone['verify']) / alone['decode']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
