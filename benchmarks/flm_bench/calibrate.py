"""``litellm-flm calibrate``: measure when DFlash speculation pays, write the policy table.

Two measurements, then one decision per context bucket (``flm_runtime.speculation.policy``):

1. **Acceptance records** per context, greedy: from every speculative step with the whole block,
   the number ``a`` of drafted tokens accepted and the draft's confidence in each drafted token.
   Greedy acceptance of the first ``j`` drafted tokens hardly depends on how many were drafted
   (a block of K < block_size - 1 drafts runs cut to K + 1 rows, which keeps about 1% fewer tokens:
   docs/dflash.md), so with draft length ``K`` and a confidence gate that verifies ``k' <= K`` of them a step
   yields ``min(a, k') + 1`` tokens (the bonus included); ``E_K = 1 + sum_{j=1..K} P(a >= j)``
   is the AL at ``K`` without a gate. Below ``LONG_CONTEXT`` the prompts are
   ``CALIBRATION_PROMPTS`` (our own chat prompts, not MT-Bench, which stays a held-out evaluation
   set); from it on, a long prompt is what fills such a context, so each such context gets its
   own records from a document to summarise (the bench's shipped
   public-domain texts, ``flm_bench.documents``) that fills it with the answer.
2. **Step costs** at each context of ``--contexts`` (a random-token prompt of that length in the
   caches), in interleaved rounds, medians: ``t_decode`` (the 1-token layer), ``t_propose(K)`` (the
   draft catching up one position and drafting a block of K + 1 rows, each time right after a
   target pass, as in serving) and
   ``t_verify(K+1)``, for K = 1 .. block_size - 1 (7 or 15). With ``--spells N`` all of it is measured N times,
   ``--spell-gap`` seconds apart: on a shared machine the one-row decode pass, which streams the
   weights, speeds up and slows down over minutes more than the verify pass does, and that alone
   can flip the decision (docs/benchmarks.md).

Per bucket (contexts above the previous measured one, up to this one): the draft length K and
confidence gate g (``GATES``; ``outputs.confident_length``) maximising ``AL(K, g) / r(K, g)`` over
the bucket's own records, where ``AL`` is the mean tokens per step and the cost ratio ``r`` the
mean of ``(t_propose(K) + t_verify(k'+1)) / t_decode`` (``t_decode`` for ``k' = 0``), the
largest measured at the bucket's edges (the first bucket: its upper edge only) over all spells;
speculation is on when that expected speed-up exceeds ``--min-speedup``
(``MIN_SPEEDUP``, 1.1), i.e. where it paid by that margin in every spell at both edges. The
margin covers the acceptance that serving falls short of calibration's, as it has in every
recorded run (docs/history/benchmarks.md). Both edges count because the ratio is not monotonic
in context: attention adds about as much to both passes, so the ratio falls as the context grows
and a bucket timed at its upper edge only underestimates its lower part. Each request's own
acceptance then moves its decision online.

Per bucket also ``verify_ratio``: ``t_verify(n+1) / t_decode`` for n = 1 .. block_size - 1, each the largest at
the bucket's edges over all spells (as the cost ratio), the cost of an n-gram-only step of n
tokens where the bucket plans plain decoding (``policy.lookup_step``); the table records
``--min-speedup`` as the margin such a step must exceed too.

    litellm-flm calibrate [--tag smollm2-dflash:135m] [--backend cpu] [--contexts 256,1024,4096,8192]
        [--rounds 5] [--spells 1] [--spell-gap 300] [--min-speedup 1.1] [--max-new 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from flm_bench import documents
from flm_bench.options import positive_int
from flm_runtime import SamplingParams, SpeculativeDecoder
from flm_runtime import paths
from flm_runtime.backends import forward
from flm_runtime.cli import Command
from flm_runtime.outputs import confident_length
from flm_runtime.sampling import sampler
from flm_runtime.sampling.picker import Picker
from flm_runtime.scheduling.step import Lane
from flm_runtime.speculation.policy import MIN_SPEEDUP, Bucket, PolicyTable

# Our own prompts, one or two per kind of chat use (writing, roleplay, reasoning, math, coding,
# extraction, STEM, humanities); none is from MT-Bench.
CALIBRATION_PROMPTS = (
    "Write a short thank-you note to a neighbour who watered my plants while I was away.",
    "You are a tour guide in an old harbour town. Welcome a group of visitors in a few sentences.",
    "If a train leaves at 3 pm and the trip takes 2 hours and 45 minutes, when does it arrive? Explain.",
    "What is 15% of 240? Show the steps.",
    "Write a Python function that returns the largest even number in a list, or None if there is none.",
    "List the three colours and two animals mentioned here: 'A red fox and a grey owl watched the blue lake "
    "under a yellow moon.'",
    "Explain in simple terms why the sky looks blue during the day.",
    "Summarise the main causes of the fall of the Western Roman Empire in a short paragraph.",
)
# Contexts (tokens) from which the acceptance records come from a long document instead of chat
# prompts: a chat prompt is tens of tokens, and a draft keeps far fewer tokens a step on long
# summaries than on chat (docs/benchmarks.md).
LONG_CONTEXT = 1024
# The confidence gates tried per bucket (policy.py): 0 (none) and a grid over which the share of
# gated steps goes from few to about half of all steps (docs/benchmarks.md, draft_confidence.py).
GATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


@dataclass(frozen=True)
class Acceptance:
    """Whole-block greedy speculative steps, as calibration records them.

    Attributes:
        confidence: ``[N, K]`` float32, the draft's confidence in each drafted token
            (``Proposal.confidence``).
        accepted: ``[N]`` int64, drafted tokens accepted (0 .. K).
    """

    confidence: np.ndarray
    accepted: np.ndarray

    def at_least(self) -> np.ndarray:
        """``P(a >= j)`` for ``j = 1 .. K``: ``[K]`` float64."""
        k = self.confidence.shape[1]
        return (self.accepted[:, None] >= np.arange(1, k + 1)).mean(axis=0)

    def tokens_and_cost(self, k: int, min_confidence: float, costs: dict) -> tuple[float, float]:
        """Mean tokens per step and mean cost per step (decodes) with draft length ``k`` and the
        confidence gate ``min_confidence``, at the step costs ``costs`` (a ``step_costs`` dict).
        Greedy acceptance of a prefix does not depend on what was drafted after it, so a step that
        verifies ``k' <= K`` tokens keeps ``min(a, k')`` of them, plus the bonus token."""
        kept = confident_length(self.confidence[:, :k], min_confidence)  # [N]
        tokens = np.minimum(self.accepted, kept) + 1
        verify = np.array([costs["decode"], *costs["verify"]])[kept]  # k' = 0: a plain decode pass
        return float(tokens.mean()), float((costs["propose"][k - 1] + verify).mean() / costs["decode"])


def acceptance_records(decoder: SpeculativeDecoder, tokenizer, prompts: list[list[int]], max_new: int,
                       progress: tqdm | None = None) -> Acceptance:
    """The whole-block greedy speculative steps of ``max_new`` tokens per prompt (token ids, chat
    template applied; a step cut short by ``max_new`` or the end of turn is left out).

    Raises:
        ValueError: no step ran (prompts too few or ``max_new`` too small).
    """
    confidence, accepted = [], []
    greedy = SamplingParams(temperature=0.0)
    for prompt in prompts:
        ids = np.asarray(prompt, dtype=np.int64)
        cache = decoder.target.new_cache(len(ids) + max_new + decoder.block_size)
        state = decoder.new_state()
        picker = Picker(greedy, sampler.new_rng(0))
        out = [picker.pick_and_accept(decoder.prefill(ids, cache, state))]
        stop = set(tokenizer.stop_token_ids)

        def emit(token: int) -> bool:
            out.append(token)
            return len(out) >= max_new or token in stop

        while len(out) < max_new and out[-1] not in stop and cache.length + decoder.block_size <= cache.max_length:
            produced = len(out)
            step = decoder.step(Lane(out[-1], cache, state, picker, emit))
            if not step.finished:  # a whole step: accepted = emitted - 1
                confidence.append(step.record.confidence)
                accepted.append(step.accepted)
                assert len(out) - produced == step.accepted + 1
            if progress is not None:
                progress.update(len(out) - produced)
    if not accepted:
        raise ValueError("no speculative step completed: give more prompts or a larger --max-new")
    return Acceptance(np.stack(confidence).astype(np.float32), np.array(accepted, dtype=np.int64))


def step_costs(decoder: SpeculativeDecoder, context: int, rounds: int, rng: np.random.Generator) -> dict:
    """Median seconds of ``decode``, and of ``propose`` and ``verify`` (lists, K = 1 .. block_size - 1), at
    ``context`` tokens, measured in ``rounds`` interleaved rounds on a random-token prompt."""
    target, draft, k = decoder.target, decoder.draft, decoder.block_size - 1
    vocab = target.config.vocab_size
    prompt = rng.integers(0, vocab, context)
    cache, state = target.new_cache(context + decoder.block_size), decoder.new_state(context + decoder.block_size)
    decoder.prefill(prompt, cache, state)
    block = rng.integers(0, vocab, decoder.block_size)
    one_tap = np.zeros((1, len(decoder.taps) * target.config.hidden_size), dtype=np.float32)

    def decode():
        forward(target, block[:1], cache)
        cache.trim(context)

    def propose(n: int):
        draft.add_context(state.draft_cache, one_tap, context)
        draft.draft_blocks([state.draft_cache], [int(block[0])], n)
        state.draft_cache.trim(context)

    def verify(n: int):
        forward(target, block[: n + 1], cache, all_logits=True, taps=decoder.taps)
        cache.trim(context)

    def nothing():
        pass

    # name -> (untimed op run just before, timed op). A proposal comes after a target pass, as in
    # serving: back to back, the draft's weights would stay in cache and time low.
    ops = {"decode": (nothing, decode),
           **{f"propose{n}": (decode, lambda n=n: propose(n)) for n in range(1, k + 1)},
           **{f"verify{n + 1}": (nothing, lambda n=n: verify(n)) for n in range(1, k + 1)}}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for name, (before, op) in ops.items():
            before()
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    return {"decode": med["decode"], "propose": [med[f"propose{n}"] for n in range(1, k + 1)],
            "verify": [med[f"verify{n + 1}"] for n in range(1, k + 1)]}


def choose(edges: list[dict], acceptance: Acceptance, max_context: int, min_speedup: float = MIN_SPEEDUP) -> Bucket:
    """The bucket's decision from the step costs measured at its edges (``step_costs`` dicts) and
    its acceptance records: the draft length K and confidence gate (``GATES``) with the best
    expected speed-up, each pair's cost ratio the largest over the edges (see the module
    docstring); speculation on when that speed-up exceeds ``min_speedup``. Of equal speed-ups the
    first wins: the shorter K, then the lower gate. ``verify_ratio``: per verified length, the
    largest ``t_verify(n+1) / t_decode`` over the edges."""
    best = None
    for k in range(1, acceptance.confidence.shape[1] + 1):
        for gate in GATES:
            al = acceptance.tokens_and_cost(k, gate, edges[0])[0]
            ratio = max(acceptance.tokens_and_cost(k, gate, c)[1] for c in edges)
            if best is None or al / ratio > best[0]:
                best = (al / ratio, k, gate, al, ratio)
    speedup, k, gate, al, ratio = best
    verify_ratio = [round(max(c["verify"][n] / c["decode"] for c in edges), 4) for n in range(len(edges[0]["verify"]))]
    return Bucket(max_context=max_context, speculate=speedup > min_speedup, draft_length=k, min_confidence=gate,
                  cost_ratio=round(ratio, 4), expected_al=round(al, 4), verify_ratio=verify_ratio)


def calibrate(decoder: SpeculativeDecoder, tokenizer, *, tag: str, backend: str, contexts: list[int], rounds: int,
              max_new: int, spells: int = 1, spell_gap: float = 300.0, min_speedup: float = MIN_SPEEDUP,
              prompts=CALIBRATION_PROMPTS, seed: int = 0) -> PolicyTable:
    """Measure and decide (module docstring). ``contexts`` ascending, each at most the context
    length minus a block and one position; the last bucket extends to the context length.
    ``spells``: times the step costs are measured, ``spell_gap`` seconds apart (sleeping).
    ``min_speedup``: the expected speed-up a bucket must exceed to speculate.
    ``prompts``: the chat prompts (text) for the contexts below ``LONG_CONTEXT``.

    Raises:
        ValueError: a context does not fit, or a context's acceptance records are empty.
        InvalidRequestError: a document cannot fill a long context (``documents.summary_prompt``).
    """
    limit = decoder.target.config.max_position_embeddings
    top = limit - decoder.block_size - 1  # a committed position, then a whole block
    if sorted(set(contexts)) != list(contexts) or contexts[-1] > top or contexts[0] < 1:
        raise ValueError(f"contexts must ascend within 1 .. {top} tokens, got {contexts}")
    chat = [documents.chat_ids(tokenizer, p) for p in prompts]
    docs = documents.load_documents()
    long_prompts = {ctx: [list(documents.summary_prompt(tokenizer, docs[i % len(docs)], ctx - max_new).ids)]
                    for i, ctx in enumerate(c for c in contexts if c >= LONG_CONTEXT)}
    chat_contexts = [ctx for ctx in contexts if ctx not in long_prompts]
    records = {}
    with tqdm(total=(len(chat) * bool(chat_contexts) + len(long_prompts)) * max_new, desc="calibrate: acceptance",
              unit="tok") as bar:
        if chat_contexts:
            records |= dict.fromkeys(chat_contexts, acceptance_records(decoder, tokenizer, chat, max_new, bar))
        for ctx, prompt in long_prompts.items():
            records[ctx] = acceptance_records(decoder, tokenizer, prompt, max_new, bar)
    rng = np.random.default_rng(seed)
    costs_at = []  # [spell][context]: step_costs
    with tqdm(total=spells * len(contexts), desc="calibrate: step costs", unit="context") as bar:
        for spell in range(spells):
            if spell:
                bar.set_postfix_str(f"waiting {spell_gap:.0f} s for spell {spell + 1} of {spells}", refresh=True)
                time.sleep(spell_gap)
                bar.set_postfix_str("")
            costs_at.append([])
            for ctx in contexts:
                costs_at[-1].append(step_costs(decoder, ctx, rounds, rng))
                bar.update(1)
    buckets, measured = [], {}
    for i, ctx in enumerate(contexts):
        edges = [c for spell in costs_at for c in spell[max(0, i - 1) : i + 1]]
        buckets.append(choose(edges, records[ctx], limit if i == len(contexts) - 1 else ctx, min_speedup))
        measured[str(ctx)] = {"step_costs": [{"decode_ms": round(1e3 * spell[i]["decode"], 3),
                                              "propose_ms": [round(1e3 * t, 3) for t in spell[i]["propose"]],
                                              "verify_ms": [round(1e3 * t, 3) for t in spell[i]["verify"]]}
                                             for spell in costs_at],
                              "acceptance_at_least": [round(float(p), 4) for p in records[ctx].at_least()],
                              "acceptance_steps": len(records[ctx].accepted),
                              "acceptance_prompts": "document" if ctx in long_prompts else "chat"}
    return PolicyTable(model=tag, backend=backend, buckets=buckets, block_size=decoder.block_size,
                       min_speedup=min_speedup, measured={
        "by_context": measured,
        "command": f"litellm-flm calibrate --tag {tag} --backend {backend} --contexts {','.join(map(str, contexts))} "
                   f"--rounds {rounds} --spells {spells} --spell-gap {spell_gap:g} --max-new {max_new} "
                   f"--min-speedup {min_speedup:g}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "date": datetime.date.today().isoformat(),
    })


def _number_at_least(minimum: float, what: str):
    """An argparse type: a float of at least ``minimum`` (NaN refused), ``what`` naming the bound."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= minimum:  # NaN too
            raise argparse.ArgumentTypeError(f"must be at least {what}, got {text}")
        return value

    return parse


_seconds = _number_at_least(0.0, "0 seconds")
_speedup = _number_at_least(1.0, "1 (a speed-up)")


def _contexts(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tag", default="smollm2-dflash:135m", help="the DFlash tag to calibrate (default: %(default)s)")
    p.add_argument("--backend", default=None, help="auto, cpu or npu (default: $FLM_BACKEND or auto)")
    p.add_argument("--contexts", type=_contexts, default="256,1024,4096,8192",
                   help="comma-separated contexts (tokens) to time; each ends a bucket, the last one extends to "
                        "the context length (default: %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="timed rounds per operation and context (default: %(default)s)")
    p.add_argument("--spells", type=positive_int, default=1,
                   help="times the step costs are measured; a bucket speculates only where it paid in every one "
                        "(default: %(default)s)")
    p.add_argument("--spell-gap", type=_seconds, default=300.0,
                   help="seconds between spells (default: %(default)s)")
    p.add_argument("--min-speedup", type=_speedup, default=MIN_SPEEDUP,
                   help="the expected speed-up a bucket must exceed to speculate, a margin for served acceptance "
                        "below calibration's (default: %(default)s)")
    p.add_argument("--max-new", type=positive_int, default=128,
                   help="tokens per calibration prompt, for the acceptance records (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="table file (default: ~/.config/litellm-flm/policy/<family>/<size>-<backend>.json, which "
                        "the engine reads before the table shipped in the draft directory)")


def main(args: argparse.Namespace) -> int:
    from flm_runtime import InvalidRequestError, get_engine
    from flm_runtime import registry

    entry = registry.resolve(args.tag)
    if not entry.is_dflash:
        raise InvalidRequestError(f"{args.tag!r} is not a DFlash tag: nothing to calibrate")
    engine = get_engine(entry.tag, args.backend)
    backend = engine.model.backend.value
    spec = engine.speculative
    # ALWAYS_SPECULATE: whole blocks, always; the draft alone: the table is about its proposals
    decoder = SpeculativeDecoder(spec.target, spec.draft, ngram=False)
    top = spec.target.config.max_position_embeddings - decoder.block_size - 1
    contexts = sorted({min(c, top) for c in args.contexts})  # the last: at most the context end
    table = calibrate(decoder, engine.tokenizer, tag=entry.tag, backend=backend, contexts=contexts,
                      rounds=args.rounds, max_new=args.max_new, spells=args.spells, spell_gap=args.spell_gap,
                      min_speedup=args.min_speedup)
    out = table.save(args.out or paths.policy_file(entry.tag, backend))
    print("| contexts up to | speculate | draft length K | confidence gate | expected AL | cost ratio | "
          "expected speed-up |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for b in table.buckets:
        print(f"| {b.max_context} | {'yes' if b.speculate else 'no'} | {b.draft_length} | {b.min_confidence:g} | "
              f"{b.expected_al:.2f} | {b.cost_ratio:.2f} | {b.expected_speedup:.2f}x |")
    print(f"\nwrote {out}")
    return 0


# The subcommand ``litellm-flm calibrate`` (entry point of the group ``litellm_flm.commands``).
COMMAND = Command("calibrate", "measure when DFlash speculation pays per context (step costs, acceptance) and write "
                  "the speculation policy table the engine reads", main, calibrate_arguments)
