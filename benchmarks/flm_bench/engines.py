"""The engines a benchmark compares, the context lengths it visits, and one timed request.

The baseline is the plain tag's engine (``get_engine``); the DFlash engine is the DFlash tag's
(``X-dflash:size``), or, with a draft directory, an engine built here around that draft over the
*same* target object (the process holds one copy of the weights either way, as ``flm_runtime.api``
does for the two tags).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from flm_runtime import Completion, Engine, InvalidRequestError, SamplingParams, SpeculativeDecoder, get_engine
from flm_runtime import registry
from flm_runtime.backends import Backend
from flm_runtime.models.dflash import DFlashDraft

SHORT = "short"
SHORT_LABEL = "short"


@dataclass(frozen=True)
class Engines:
    """The engines of one benchmark run.

    Attributes:
        base_tag: the plain tag (the baseline every speed-up is measured against).
        dflash_tag: the DFlash tag, or None with ``baseline_only``.
        baseline: the plain tag's engine.
        dflash: the DFlash engine (same target object as ``baseline``), or None.
        draft: where the draft comes from: the DFlash tag's own, or a directory.
    """

    base_tag: str
    dflash_tag: str | None
    baseline: Engine
    dflash: Engine | None
    draft: str = ""

    @property
    def hardware(self) -> str:
        """The backend that runs the target, for report tables ("cpu (numpy)" or "npu")."""
        return "npu (XDNA2)" if self.baseline.model.backend is Backend.NPU else "cpu (numpy)"

    def pairs(self) -> list[tuple[str, Engine]]:
        """(tag, engine) of the baseline, then of the DFlash engine when there is one."""
        out = [(self.base_tag, self.baseline)]
        if self.dflash is not None:
            out.append((self.dflash_tag, self.dflash))
        return out


def load_engines(tag: str, *, draft: str | Path | None = None, baseline_only: bool = False,
                 ngram: bool = True) -> Engines:
    """The baseline engine of ``tag`` and, unless ``baseline_only``, its DFlash engine.

    Args:
        tag: a plain tag (its DFlash tag is ``family-dflash:size``) or a DFlash tag (its base is
            the baseline).
        draft: a draft directory to decode with instead of the DFlash tag's own draft.
        baseline_only: load no draft (the DFlash columns are left empty).
        ngram: prompt lookup beside the draft (``SpeculativeDecoder``'s ``ngram``); False builds
            the DFlash engine around the draft alone (the tag's own draft keeps its policy).

    Raises:
        the errors of ``get_engine`` (a DFlash tag whose draft files are missing raises
        ``ModelFilesMissingError``), ``ModelFormatError`` for a draft that does not fit.
    """
    entry = registry.resolve(tag)
    base_tag = entry.base or entry.tag
    dflash_tag = entry.tag if entry.is_dflash else registry.dflash_tag(base_tag)
    baseline = get_engine(base_tag)
    if baseline_only:
        return Engines(base_tag, None, baseline, None)
    alone = "" if ngram else ", without prompt lookup"
    if draft is None and ngram:
        return Engines(base_tag, dflash_tag, baseline, get_engine(dflash_tag), f"{dflash_tag}'s own")
    target = baseline.model
    if draft is None:
        own = get_engine(dflash_tag).speculative
        decoder = SpeculativeDecoder(target, own.draft, policy=own.policy, ngram=False)
        name, label = f"{dflash_tag}-no-ngram", f"{dflash_tag}'s own{alone}"
    else:
        decoder = SpeculativeDecoder(target, DFlashDraft.load(Path(draft), target), ngram=ngram)
        name, label = f"{dflash_tag}+{Path(draft).name}", f"{draft}{alone}"
    engine = Engine(target, baseline.tokenizer, name=name, speculative=decoder,
                    default_sampling=baseline.default_sampling)
    return Engines(base_tag, dflash_tag, baseline, engine, label)


@dataclass(frozen=True)
class Context:
    """A prompt length to measure at.

    Attributes:
        label: as reports show it ("~30 tokens", "1k", "max (7680)").
        tokens: prompt tokens; None for the short chat prompts.
    """

    label: str
    tokens: int | None


def parse_contexts(spec: str, context_length: int, max_tokens: int, *, fill: int | None = None
                   ) -> tuple[list[Context], list[str]]:
    """Context lengths from a comma-separated ``spec``: ``short``, ``max``, ``N``, ``Nk`` (N x 1024).

    A prompt must leave room for ``max_tokens``: a length over ``context_length - max_tokens`` but
    within the context is clipped to it ("8k (8160)"); one over the context is dropped. ``max`` is
    the largest prompt the model allows, and no longer than ``fill``, the longest prompt the
    documents fill (``documents.longest_summary``; None: no such bound).

    Returns:
        the contexts in the order given, and one note per clipped or dropped length.

    Raises:
        InvalidRequestError: an entry that is none of the forms above, naming it.
    """
    room = context_length - max_tokens
    contexts, notes = [], []
    for item in (s.strip().lower() for s in spec.split(",") if s.strip()):
        if item == SHORT:
            contexts.append(Context(SHORT_LABEL, None))
            continue
        if item == "max":
            largest = room if fill is None else min(room, fill)
            if largest < room:
                notes.append(f"max is {largest} prompt tokens, not {room}: the longest prompt the documents fill")
            contexts.append(Context(f"max ({largest})", largest))
            continue
        m = re.fullmatch(r"(\d+)(k?)", item)
        if not m:
            raise InvalidRequestError(f"context {item!r}: expected short, max, a number of tokens or Nk",
                                      param="--contexts")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n > context_length:
            notes.append(f"{item} ({n} tokens) is over the model's context of {context_length}: skipped")
        elif n > room:
            notes.append(f"{item} clipped to {room} prompt tokens: the context of {context_length} "
                         f"holds {max_tokens} generated tokens after it")
            contexts.append(Context(f"{item} ({room})", room))
        else:
            contexts.append(Context(item, n))
    return contexts, notes


@dataclass(frozen=True)
class Run:
    """One finished request's figures.

    Attributes:
        prompt_tokens, generated_tokens: tokens in and out (generated includes an end-of-turn).
        ttft_s: submit to first token (queue + prefill + first sample), seconds.
        decode_s: first to last token, seconds (``generated_tokens - 1`` tokens decoded in it).
        spec_steps: speculative (verify) steps, n-gram-only ones included; 0 for plain decoding.
        acceptance_length: tokens kept per step, bonus included (0.0 without speculation).
        spec_switches_off: times the request's acceptance tracker turned speculation off.
        figures: the per-proposer figures (``SpecStats.figures``, keys ``SPEC_FIGURE_KEYS``:
            the forced tokens, each proposer's steps and AL, None over no step); empty without
            speculation.
    """

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_s: float
    spec_steps: int = 0
    acceptance_length: float = 0.0
    spec_switches_off: int = 0
    figures: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @classmethod
    def from_completion(cls, done: Completion) -> Run:
        s, spec = done.stats, done.stats.spec
        if spec is None:
            return cls(s.prompt_tokens, s.generated_tokens, s.ttft_s, s.decode_s)
        return cls(s.prompt_tokens, s.generated_tokens, s.ttft_s, s.decode_s, spec.steps, spec.acceptance_length,
                   spec.switches_off, spec.figures())


def run_request(engine: Engine, prompt_ids, params: SamplingParams, timeout: float = 3600.0) -> Run:
    """Submit one request, wait for it, return its figures (the engine's own timing)."""
    return Run.from_completion(engine.submit(list(prompt_ids), params, timeout=timeout).result())


def warm_up(engines: Engines, prompt_ids) -> None:
    """One short untimed request per engine: first-call costs (allocations, BLAS threads) are not
    the model's speed."""
    for _, engine in engines.pairs():
        params = engine.sampling_params(temperature=0.0, max_tokens=9, ignore_eos=True)
        run_request(engine, prompt_ids, params)


def sampling(engine: Engine, mode: str, *, max_tokens: int, seed: int, ignore_eos: bool,
             sampler: dict | None = None) -> SamplingParams:
    """``greedy`` (temperature 0) or ``sampled`` parameters: the model's default sampler, with the
    fields of ``sampler`` (``temperature``, ``top_k``, ``top_p``; None: the default's) over it.

    Raises:
        InvalidRequestError: a sampler value out of range, naming it.
    """
    assert mode in ("greedy", "sampled"), mode
    given = {"temperature": 0.0} if mode == "greedy" else dict(sampler or {})
    return engine.sampling_params(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos, **given)
