"""What a caller hands the engine (``SamplingParams``) and what it gets back (``StreamEvent``,
``Completion``, with the request's ``RequestStats``).

Vocabulary: *prompt tokens* are the rendered chat prompt; *completion tokens* are tokens the
engine delivered to the caller (a stop string's tokens and an end-of-turn token are not
delivered, so they are not counted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from flm_runtime.errors import InvalidRequestError

FinishReason = Literal["stop", "length"]

MAX_TOP_LOGPROBS = 20   # OpenAI's limit on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Range [0, 2].
        top_k: keep the k most likely tokens; 0 disables. Range >= 0.
        top_p: nucleus mass to keep, (0, 1]; 1 disables.
        min_p: drop tokens whose probability is below ``min_p * p(top-1)``; [0, 1); 0 disables.
        seed: seed of the request's own RNG (numpy PCG64); None draws one from the OS.
        max_tokens: completion tokens at most; None means up to the context length (the engine's
            own rule; served requests get the default output limit instead,
            ``flm_runtime.api.with_output_limit``).
        stop: strings that end the output; the stop string itself is not delivered.
        ignore_eos: keep generating past EOS / end-of-turn tokens (benchmarks).
        presence_penalty: subtracted once from the logit of every token generated so far
            (OpenAI's definition); [-2, 2]; 0 disables.
        frequency_penalty: subtracted from the logit of every generated token once per time it
            was generated (OpenAI's); [-2, 2]; 0 disables.
        repetition_penalty: CTRL's penalty (Keskar et al. 2019, arXiv:1909.05858, as HF's
            ``RepetitionPenaltyLogitsProcessor``) over the prompt and the generated tokens: a
            positive logit is divided by it, a negative one multiplied; > 0; 1 disables.
        logit_bias: token id -> value in [-100, 100] added to that token's logit (OpenAI's);
            ids are checked against the vocabulary at submit (``processors.request_processors``).
        logprobs: record each emitted token's log-probability (``TokenLogprob``).
        top_logprobs: also this many of the most likely tokens at each position; [0, 20], > 0 only
            with ``logprobs``.
        speculation: let the engine take speculative steps where its policy expects them to pay
            (the default); False decodes one token per step. Either way the tokens are the same:
            speculation is exact (greedy) and lossless (sampled).
        prediction: token ids of a predicted output (OpenAI's predicted outputs: the text the
            answer is expected to repeat, such as a file being edited), which the ``prediction``
            proposer offers for verification; never trusted, each token verified as any other
            proposal's. Empty: none.

    The order these apply in, and what the log-probabilities are: ``processors.request_processors``
    and ``sampler.sample_with_logprob``.

    Raises:
        InvalidRequestError: a value out of range, naming the parameter.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    speculation: bool = True
    prediction: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.temperature, "temperature", 0.0, 2.0)
        _check(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        _check(self.min_p, "min_p", 0.0, 1.0, high_open=True)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", param="top_k")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be an integer >= 0, got {self.seed!r}", param="seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop must hold non-empty strings, got {self.stop!r}", param="stop")
        _check(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check(self.repetition_penalty, "repetition_penalty", 0.0, math.inf, low_open=True, high_open=True)
        self._check_logit_bias()
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError(f"logprobs must be a boolean, got {self.logprobs!r}", param="logprobs")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                                      f"{self.top_logprobs!r}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if not isinstance(self.speculation, bool):
            raise InvalidRequestError(f"speculation must be a boolean, got {self.speculation!r}", param="speculation")
        if not isinstance(self.prediction, tuple) or not all(_is_int(t) and t >= 0 for t in self.prediction):
            raise InvalidRequestError("prediction must be a tuple of token ids (integers >= 0)", param="prediction")

    def _check_logit_bias(self) -> None:
        """A ``Mapping`` of integer ids >= 0 to values in [-100, 100]; kept as a copy."""
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}",
                                      param="logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                                          param="logit_bias")
            if not (_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(f"logit_bias values must lie in [-100, 100], got {bias!r} for token "
                                          f"{token}", param="logit_bias")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # the caller's dict may change later

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(value, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    ok = _is_number(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise InvalidRequestError(f"{name} must lie in {lo}{low}, {high}{hi}, got {value!r}", param=name)


# The proposers a speculative step verifies the tokens of: the DFlash draft, the retrieval
# proposers (a predicted output, prompt lookup, the suffix proposer) and a grammar's forced tokens
# alone, as ``StepRecord.proposer`` names them.
PROPOSERS = ("draft", "prediction", "ngram", "suffix", "grammar")


@dataclass
class ProposerCounts:
    """The speculative steps that verified one proposer's tokens (``SpecStats``' counts).

    Attributes:
        steps, drafted, accepted, emitted: as ``SpecStats``' totals, over these steps.
        forced, forced_accepted: of the drafted and the accepted tokens, those a grammar forced
            (all of them in the ``"grammar"`` proposer's steps).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    forced: int = 0
    forced_accepted: int = 0

    def record(self, drafted: int, accepted: int, emitted: int, forced: int = 0, forced_accepted: int = 0) -> None:
        """One step of ``drafted`` verified tokens, ``accepted`` of them kept, ``emitted`` pushed;
        ``forced`` of the drafted and ``forced_accepted`` of the accepted were forced by a grammar."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.forced += forced
        self.forced_accepted += forced_accepted

    @property
    def acceptance_length(self) -> float:
        """AL of these steps (bonus included); 0.0 before one."""
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class SpecStats:
    """One request's speculation counters.

    Attributes:
        proposers: per proposer whose tokens speculative steps verified (a name of ``PROPOSERS``:
            the draft, a predicted output ``"prediction"`` (present from the start where the
            request gave one), prompt lookup ``"ngram"``, the suffix proposer ``"suffix"``, a
            grammar's forced tokens alone ``"grammar"``), the counts of those steps (``counts``); the totals
            (``steps``, ``drafted``, ``accepted``, ``emitted``, ``forced``, ``forced_accepted``)
            are their sums.
        gated: plain steps the confidence gate made (the draft ran, nothing was verified).
        switches_off: times the request's acceptance tracker turned speculation off, and
        al_estimate: its final AL estimate (None before a step): the policy's figures
            (``policy.AcceptanceTracker``, over the steps the draft ran: n-gram-only steps do
            not feed it), copied in when the request ends.
    """

    proposers: dict[str, ProposerCounts] = field(default_factory=dict)
    gated: int = 0
    switches_off: int = 0
    al_estimate: float | None = None

    def record_step(self, drafted: int, accepted: int, emitted: int, *, proposer: str = "draft", forced: int = 0,
                    forced_accepted: int = 0) -> None:
        """A speculative step verified ``drafted`` tokens of ``proposer`` (a name of
        ``PROPOSERS``) and pushed ``emitted`` tokens, of which ``accepted`` were drafted ones;
        ``forced`` of the drafted and ``forced_accepted`` of the accepted were forced by a grammar."""
        assert proposer in PROPOSERS, f"unknown proposer {proposer!r}"
        self.proposers.setdefault(proposer, ProposerCounts()).record(drafted, accepted, emitted, forced,
                                                                     forced_accepted)

    def record_plain(self, gated: bool) -> None:
        """A plain decode step; ``gated``: the confidence gate made it one."""
        self.gated += gated

    def counts(self, proposer: str) -> ProposerCounts:
        """The counts of the steps that verified ``proposer``'s tokens (zeros without one), a
        copy."""
        return dataclasses.replace(self.proposers.get(proposer, ProposerCounts()))

    def copy(self) -> SpecStats:
        """An independent copy (its per-proposer counts too)."""
        return dataclasses.replace(self, proposers={k: dataclasses.replace(v) for k, v in self.proposers.items()})

    @property
    def steps(self) -> int:
        """Speculative steps run: steps that verified proposed tokens, the draft's or a retrieval
        proposer's (n-gram-only steps included: those the policy planned plain, where the draft
        did not run)."""
        return sum(c.steps for c in self.proposers.values())

    @property
    def drafted(self) -> int:
        """Proposed tokens verified (k per step, after the confidence gate)."""
        return sum(c.drafted for c in self.proposers.values())

    @property
    def accepted(self) -> int:
        """Drafted tokens kept and pushed into the output pipeline."""
        return sum(c.accepted for c in self.proposers.values())

    @property
    def emitted(self) -> int:
        """Tokens pushed by speculative steps (accepted + one bonus per step; a step cut short by
        EOS / stop / max_tokens counts only the tokens pushed before the cut)."""
        return sum(c.emitted for c in self.proposers.values())

    @property
    def forced(self) -> int:
        """Verified tokens a grammar forced (no proposer had to guess them), in every proposer's steps."""
        return sum(c.forced for c in self.proposers.values())

    @property
    def forced_accepted(self) -> int:
        """Forced tokens kept and pushed into the output pipeline."""
        return sum(c.forced_accepted for c in self.proposers.values())

    @property
    def acceptance_length(self) -> float:
        """AL: tokens per speculative step INCLUDING the bonus token; 0.0 before a step."""
        steps = self.steps
        return self.emitted / steps if steps else 0.0

    def figures(self) -> dict[str, int | float | None]:
        """The per-proposer figures, keys ``SPEC_FIGURE_KEYS`` in order: ``forced_tokens`` and
        ``forced_accepted_tokens`` (the drafted and accepted tokens a grammar forced, in any
        proposer's steps), ``draft_acceptance_length`` (the draft's steps), then per other
        proposer ``P`` (``prediction``: a predicted output; ``ngram``: prompt lookup; ``suffix``;
        ``grammar``: forced tokens alone)
        ``P_steps``, ``P_drafted_tokens``, ``P_accepted_tokens``, ``P_acceptance_length`` (its
        steps, n-gram-only ones included). An AL over no step is None: AL counts the bonus token,
        so a number is at least 1."""
        draft = self.counts("draft")
        out = {"forced_tokens": self.forced, "forced_accepted_tokens": self.forced_accepted,
               "draft_acceptance_length": draft.acceptance_length if draft.steps else None}
        for name in PROPOSERS[1:]:
            c = self.counts(name)
            out |= {f"{name}_steps": c.steps, f"{name}_drafted_tokens": c.drafted,
                    f"{name}_accepted_tokens": c.accepted,
                    f"{name}_acceptance_length": c.acceptance_length if c.steps else None}
        return out


# The keys of ``SpecStats.figures``, in order: the one list of per-proposer figures that every
# report of them follows (``RequestStats.as_dict``, the bench's speed.csv).
SPEC_FIGURE_KEYS = tuple(SpecStats().figures())


@dataclass(frozen=True)
class RequestStats:
    """One finished request's figures (times from ``time.perf_counter``, seconds).

    Attributes:
        prompt_tokens: prompt length.
        completion_tokens: tokens delivered (see ``stop.py``).
        generated_tokens: tokens generated, an end-of-turn token or stop-string tokens included.
        queue_s: submit to admission; None if never admitted.
        ttft_s: submit to the first generated token; None before one.
        decode_s: the first generated token to the last (0.0 with one token or none).
        total_s: submit to the end.
        spec: the speculation counters; None without speculative decoding.
        cached_tokens: prompt tokens taken from the prefix cache instead of computed.
        max_gap_s: the longest time between two generated tokens (a step's tokens come at once):
            what a client that does not stream cannot see of its request's progress.
    """

    prompt_tokens: int
    completion_tokens: int
    generated_tokens: int
    queue_s: float | None
    ttft_s: float | None
    decode_s: float
    total_s: float
    spec: SpecStats | None = None
    cached_tokens: int = 0
    max_gap_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second after the first; 0.0 with a single token."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        """The flat JSON form (LiteLLM's ``_hidden_params["flm_stats"]``): ``prompt_tokens``,
        ``cached_tokens``, ``completion_tokens``, ``generated_tokens``, ``queue_s``, ``ttft_s``,
        ``max_gap_s``, ``decode_tokens_per_s``, ``total_s``; with ``spec`` also ``spec_steps``,
        ``drafted_tokens``, ``accepted_tokens``, ``acceptance_length`` (all proposers together,
        n-gram-only steps included; None over no step), ``gated_steps``, ``spec_switches_off``
        and ``al_estimate`` (the tracker's, ``SpecStats``), then ``SpecStats.figures`` (the forced
        tokens and each proposer's figures)."""
        out = {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
               "completion_tokens": self.completion_tokens,
               "generated_tokens": self.generated_tokens, "queue_s": self.queue_s, "ttft_s": self.ttft_s,
               "max_gap_s": self.max_gap_s, "decode_tokens_per_s": self.decode_tokens_per_s, "total_s": self.total_s}
        if self.spec is not None:
            s = self.spec
            out |= {"spec_steps": s.steps, "drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
                    "acceptance_length": s.acceptance_length if s.steps else None, "gated_steps": s.gated,
                    "spec_switches_off": s.switches_off, "al_estimate": s.al_estimate, **s.figures()}
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability, and the most likely tokens at its position.

    Attributes:
        token_id: the token.
        logprob: its natural log-probability (``sampler.sample_with_logprob`` says of which
            distribution); finite.
        top: ``top_logprobs`` pairs ``(token id, logprob)``, most likely first (lowest id first
            among equals); ``-inf`` for a token the request's filters left no probability.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamEvent:
    """One delivery to a streaming caller.

    Attributes:
        text: new text, whole UTF-8 characters only (may be "" on the final event).
        token_ids: the completion tokens this event delivers.
        finish_reason: None until the last event; then "stop" (EOS, end-of-turn, stop string) or
            "length" (``max_tokens`` or the context length reached).
        prompt_tokens: prompt length (tokens).
        completion_tokens: completion tokens delivered so far, this event included.
        stats: on the final event only, the request's stats (``Completion.stats``); else None.
        logprobs: with ``SamplingParams.logprobs``, one ``TokenLogprob`` per token of
            ``token_ids``, in order; else None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request: the join of its stream events, with its stats (``logprobs``: the join
    of the events' ``logprobs``, one per token of ``token_ids``; None when not asked for)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats
    logprobs: tuple[TokenLogprob, ...] | None = None
