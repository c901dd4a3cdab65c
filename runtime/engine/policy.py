"""The speculation policy (DESIGN §7): when a speculative step pays, as data, plus an online check.

A speculative step costs ``t_propose + t_verify(K+1)`` and yields AL tokens (acceptance length,
bonus included); plain decoding costs ``t_decode`` per token. Speculation pays when
``AL * t_decode > t_propose + t_verify(K+1)`` (DESIGN §7), i.e. when ``AL > cost_ratio`` with
``cost_ratio = (t_propose + t_verify(K+1)) / t_decode``. Both sides move: the verify pass grows
with context (attention over the cache: the card's engine turns speculation off at 32k), and AL
depends on the draft, the text, and the request.

So the rule is data: a ``PolicyTable`` per (DFlash tag, backend) of context buckets, each with
whether to speculate, the draft length K, the measured ``cost_ratio`` and the calibrated AL at K,
written by ``litellm-flm calibrate`` (``flm_runtime.bench.calibrate``) and shipped for the
embedded model. The card's rule is one bucket: ``{"max_context": 32768, "speculate": false}``.

Then, per request, an ``AcceptanceTracker`` follows that request's own AL (an exponential moving
average seeded with the table's AL). When ``AL_estimate / cost_ratio`` drops below 1 the request
decodes plainly for ``probe_after`` tokens, then probes with one speculative step; every probe
that does not pay doubles the wait (up to ``max_probe_after``), one that pays resumes speculation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

FILE_NAME = "policy-{backend}.json"  # in the draft directory (shipped) or the user's policy dir


class Bucket(BaseModel):
    """The policy for contexts (tokens in the target's KV cache) up to ``max_context``.

    Attributes:
        max_context: the bucket covers contexts ``<= max_context`` tokens (above the previous bucket's).
        speculate: whether speculative steps run at all here.
        draft_length: K, drafted tokens verified per step (1 .. block_size - 1).
        cost_ratio: ``(t_propose + t_verify(K+1)) / t_decode`` measured at this context: the AL
            above which a step pays.
        expected_al: calibrated AL at draft length K (bonus included): the prior of the online estimate.
    """

    model_config = ConfigDict(extra="forbid")

    max_context: int = Field(gt=0)
    speculate: bool
    draft_length: int = Field(default=7, ge=1)
    cost_ratio: float = Field(default=1.0, gt=0)
    expected_al: float = Field(default=1.0, ge=1.0)

    @property
    def expected_speedup(self) -> float:
        """``expected_al / cost_ratio``: the calibrated speed-up of speculation in this bucket."""
        return self.expected_al / self.cost_ratio


class PolicyTable(BaseModel):
    """Context buckets for one DFlash tag on one backend (the JSON file ``calibrate`` writes).

    Attributes:
        model: the DFlash tag (e.g. ``"smollm2-dflash:135m"``).
        backend: ``"cpu"`` or ``"npu"``.
        buckets: ascending ``max_context``; a context above the last bucket uses the last one.
        measured: provenance (command, machine, per-bucket timings, acceptance profile); free-form.

    Raises:
        pydantic.ValidationError: buckets not ascending, or a bucket out of range (naming it).
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    backend: str
    buckets: list[Bucket] = Field(min_length=1)
    measured: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ascending(self) -> PolicyTable:
        edges = [b.max_context for b in self.buckets]
        if edges != sorted(set(edges)):
            raise ValueError(f"buckets must have strictly ascending max_context, got {edges}")
        return self

    def bucket(self, context: int) -> Bucket:
        """The bucket of a context of ``context`` tokens."""
        for b in self.buckets:
            if context <= b.max_context:
                return b
        return self.buckets[-1]

    @classmethod
    def load(cls, path: Path) -> PolicyTable:
        """Read a table file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON or not a valid table, naming the file.
        """
        text = Path(path).read_text(encoding="utf-8")
        try:
            return cls.model_validate(json.loads(text))
        except ValueError as e:  # json.JSONDecodeError and pydantic.ValidationError are ValueErrors
            raise ValueError(f"{path}: not a valid speculation policy table: {e}") from e

    def save(self, path: Path) -> Path:
        """Write the table as JSON (to a temporary name, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path


@dataclass
class AcceptanceTracker:
    """One request's online acceptance estimate and its speculate / plain decision.

    Attributes:
        alpha: weight of the newest step in the moving average (a probe weighs 0.5).
        first_probe_after, max_probe_after: tokens of plain decoding before the first probe, and
            the cap of its doubling. These three are our own choices (a few steps to react, a
            probe costing a few percent at most), not tuned values from a paper.
        al: moving-average AL (tokens per speculative step, bonus included); None until the first
            decision seeds it with the bucket's ``expected_al``.
        tokens: tokens this request generated through the tracker (plain and speculative).
        plain_until: ``tokens`` value before which the request decodes plainly (0: speculating).
        probe_after: tokens of plain decoding before the next probe.
        switches: times the tracker turned speculation off.
    """

    alpha: float = 0.25
    first_probe_after: int = 16
    max_probe_after: int = 512
    al: float | None = None
    tokens: int = 0
    plain_until: int = 0
    probe_after: int = 16
    switches: int = 0

    def __post_init__(self) -> None:
        self.probe_after = self.first_probe_after

    def draft_length(self, bucket: Bucket) -> int:
        """K for the next step in ``bucket``: 0 means a plain decode step."""
        if not bucket.speculate or self.tokens < self.plain_until:
            return 0
        if self.al is None:
            self.al = bucket.expected_al
        return bucket.draft_length

    def record_plain(self) -> None:
        """A plain decode step generated one token."""
        self.tokens += 1

    def record_step(self, bucket: Bucket, emitted: int) -> None:
        """A speculative step in ``bucket`` emitted ``emitted`` tokens (accepted + bonus).

        A probe (the first step after plain decoding) weighs its own AL as much as the history.
        """
        probe = self.plain_until > 0
        a = 0.5 if probe else self.alpha
        self.al = (1 - a) * (bucket.expected_al if self.al is None else self.al) + a * emitted
        self.tokens += emitted
        if self.al < bucket.cost_ratio:        # speculation does not pay for this request (now)
            if probe:
                self.probe_after = min(2 * self.probe_after, self.max_probe_after)
            else:
                self.switches += 1
            self.plain_until = self.tokens + self.probe_after
        else:
            self.plain_until, self.probe_after = 0, self.first_probe_after

    def stats(self) -> dict:
        """``spec_switches_off`` and the final ``al_estimate``."""
        return {"spec_switches_off": self.switches, "al_estimate": self.al}
