"""The speculation policy: when a speculative step pays, as data, plus an online check.

The design and its reasons: docs/design.md, "Speculation policy".

A step that drafts K tokens pays when ``AL > cost_ratio = (t_propose + t_verify(K+1)) / t_decode``
(AL bonus included). One interface, ``SpeculationPolicy``: ``plan`` a step, or ``lookup_step`` an
n-gram-only one where the plan is plain, then ``record_step`` or ``record_plain`` what it did.
``PolicyTable`` (per DFlash tag and backend, written by ``litellm-flm calibrate``) holds context
buckets (``Bucket``: speculate or not, K, the gate, ``cost_ratio``, the calibrated AL,
``verify_ratio``) and works with each request's ``AcceptanceTracker`` (its own AL: switches it to
plain decoding, then probes) and ``LookupTracker`` (what its n-gram-only steps kept against their
price). ``ALWAYS_SPECULATE`` is the null policy: whole blocks, no gate, no switch-off, no
n-gram-only step.

The gate verifies the leading drafted tokens whose cumulative confidence (``outputs.Proposal``) is
at least ``min_confidence`` (docs/dflash.md, "Confidence"); none left is a plain step. An
n-gram-only step of ``n`` tokens costs ``verify_ratio[n-1] = t_verify(n+1) / t_decode`` decode
steps for ``1 + E(n)`` tokens (``outputs.expected_accepted``); ``lookup_step`` takes the ``n`` of
the best ``(1 + E(n)) / verify_ratio[n-1]`` where it exceeds ``min_speedup`` (``MIN_SPEEDUP``),
priced against the pass planned so far (``PassLoad``, ``paying_step``).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

FILE_NAME = "policy-{backend}.json"  # in the draft directory (shipped) or the user's policy dir
# The expected speed-up a step must exceed to run: a bucket's speculation (``calibrate``'s default
# ``--min-speedup``) and an n-gram-only step; the margin covers served acceptance falling short of
# the expected (docs/design.md, "Speculation policy").
MIN_SPEEDUP = 1.1


class Plan(NamedTuple):
    """One lane's next step, as the policy plans it.

    Attributes:
        draft_length: K, tokens to draft (0: a plain decode step, the draft does not run).
        min_confidence: the confidence gate (``confident_length``) of the verified prefix; 0
            verifies all K.
    """

    draft_length: int
    min_confidence: float


class LookupStep(NamedTuple):
    """An n-gram-only step of a retrieval proposal, as the policy prices it.

    Attributes:
        length: the proposal's leading tokens to verify (0: none pays, a plain decode step).
        speedup: its expected speed-up of the pass (``paying_step``); for a lane alone, its
            expected tokens per decode step's cost, ``(1 + E(length)) / verify_ratio[length-1]``
            (1.0 for a plain step: one token for one decode).
        gained: ``E(length)``, the expected accepted tokens of its rows (0.0 for a plain step).
    """

    length: int
    speedup: float
    gained: float = 0.0


PLAIN_STEP = LookupStep(0, 1.0)


class PassLoad(NamedTuple):
    """The rows of a batched decoding pass planned so far, and the tokens they are expected to
    give: what one more lane's proposal is priced against (``paying_step``).

    Attributes:
        rows: target rows in the pass (one per decoding lane, plus the verify rows planned).
        tokens: the tokens those rows are expected to give (one per lane, plus the accepted
            ones expected).
    """

    rows: int
    tokens: float


ALONE = PassLoad(1, 1.0)  # a lane alone in its pass


class SpeculationPolicy(Protocol):
    """When and how far a decoder speculates; a request's own state is its ``AcceptanceTracker``.

    ``context`` is the target's KV cache length (tokens) at the step, ``most`` the most tokens
    one step can draft (``block_size - 1``).
    """

    @property
    def drafts(self) -> bool:
        """Whether the plan of some context may run the draft; False: no step ever drafts, so a
        decoder keeps no draft context (no taps, no ``add_context``)."""

    def plan(self, context: int, tracker: AcceptanceTracker, most: int) -> Plan:
        """The plan of a step at ``context`` (K at most ``most``)."""

    def record_step(self, context: int, tracker: AcceptanceTracker, emitted: int) -> None:
        """A speculative step (or a gated one, ``emitted`` = 1) at ``context`` kept ``emitted``
        tokens, the bonus included."""

    def lookup_step(self, context: int, confidence: np.ndarray, load: PassLoad = ALONE) -> LookupStep | None:
        """Where ``plan`` is plain: the leading tokens of a retrieval proposal (or of a grammar's
        forced tokens) with these per-token confidences (``[g]``) that an n-gram-only step at
        ``context`` verifies in a pass of ``load``, and its expected speed-up of that pass
        (``PLAIN_STEP``: none pays, the step decodes plainly); None: n-gram-only steps are off at
        this context."""

    def record_plain(self, tracker: AcceptanceTracker, emitted: int = 1) -> None:
        """A step planned plain (K = 0) generated ``emitted`` tokens: a plain decode step one, an
        n-gram-only step its kept tokens."""

    def record_lookup(self, context: int, lookups: LookupTracker, verified: int, emitted: int) -> None:
        """An n-gram-only step of a retrieval proposal at ``context`` verified ``verified`` tokens
        and kept ``emitted`` (the bonus included): into the request's ``LookupTracker``."""


class AlwaysSpeculate:
    """The null policy: whole blocks at every context, every drafted token verified, never
    switched off, no n-gram-only step; it records nothing."""

    drafts = True

    def plan(self, context: int, tracker: AcceptanceTracker, most: int) -> Plan:
        return Plan(most, 0.0)

    def record_step(self, context: int, tracker: AcceptanceTracker, emitted: int) -> None:
        pass

    def lookup_step(self, context: int, confidence: np.ndarray, load: PassLoad = ALONE) -> LookupStep | None:
        return None

    def record_plain(self, tracker: AcceptanceTracker, emitted: int = 1) -> None:
        pass

    def record_lookup(self, context: int, lookups: LookupTracker, verified: int, emitted: int) -> None:
        pass


ALWAYS_SPECULATE = AlwaysSpeculate()


class Bucket(BaseModel):
    """The policy for contexts (tokens in the target's KV cache) up to ``max_context``.

    Attributes:
        max_context: the bucket covers contexts ``<= max_context`` tokens (above the previous bucket's).
        speculate: whether speculative steps run at all here.
        draft_length: K, tokens drafted per step (1 .. block_size - 1), of which the step verifies
            ``confident_length(confidence, min_confidence)``; None: the whole block (block_size - 1).
        min_confidence: the confidence gate (module docstring), 0 to 1; 0 verifies all K.
        cost_ratio: a step's cost in decode steps, ``(t_propose(K) + t_verify(k+1)) / t_decode``
            (k the verified length; a gated step, k = 0, costs ``(t_propose(K) + t_decode) /
            t_decode``), measured at this context, the mean over calibration's steps: the AL above
            which speculation pays.
        expected_al: calibrated tokens per step (bonus included; a gated step emits one), the mean
            over the same steps: the prior of the online estimate.
        verify_ratio: ``t_verify(n+1) / t_decode`` for ``n = 1 .. block_size - 1``, the largest
            measured at this bucket's edges: the cost of an n-gram-only step of n tokens, in
            decode steps (module docstring); None (tables calibrated before it was recorded):
            no n-gram-only steps here. Its length is checked against the table's ``block_size``.
    """

    model_config = ConfigDict(extra="forbid")

    max_context: int = Field(gt=0)
    speculate: bool
    draft_length: int | None = Field(default=None, ge=1)
    min_confidence: float = Field(default=0.0, ge=0.0, le=1.0)
    cost_ratio: float = Field(default=1.0, gt=0)
    expected_al: float = Field(default=1.0, ge=1.0)
    verify_ratio: list[PositiveFloat] | None = None

    @property
    def expected_speedup(self) -> float:
        """``expected_al / cost_ratio``: the calibrated speed-up of speculation in this bucket."""
        return self.expected_al / self.cost_ratio


def pass_cost(verify_ratio: list[float], rows: int) -> float:
    """A target pass of ``rows`` rows in decode steps: 1.0 for one row, ``verify_ratio[rows-2]``
    up to ``len(verify_ratio) + 1`` rows, and beyond, the curve's last value plus its mean slope
    (``(verify_ratio[-1] - 1) / len(verify_ratio)``) per row: past a few rows a pass is bound by
    the integer work, which grows with the rows."""
    if rows <= 1:
        return 1.0
    k = len(verify_ratio)
    if rows <= k + 1:
        return float(verify_ratio[rows - 2])
    return float(verify_ratio[-1]) + (rows - k - 1) * (float(verify_ratio[-1]) - 1.0) / k


def paying_step(confidence: np.ndarray, verify_ratio: list[float], min_speedup: float,
                load: PassLoad = ALONE) -> LookupStep:
    """The n-gram-only step of one lane in a pass of ``load``: the ``n`` in ``1 .. min(g,
    len(verify_ratio))`` with the best expected speed-up of the pass, ``(load.tokens + E(n)) /
    load.tokens * pass_cost(load.rows) / pass_cost(load.rows + n)`` (``E(n) =
    expected_accepted(confidence[:n])``; the shortest of equal ones), if that exceeds
    ``min_speedup``; else ``PLAIN_STEP``. Alone (``ALONE``) that is ``(1 + E(n)) /
    verify_ratio[n-1]``; in a batch the rows slow every lane of the pass, so a proposal pays
    less the fuller the pass, and not at all once rows cost as much as the tokens they add.

    Args:
        confidence: ``[g]`` per-token confidence of the proposal (``Lookup.confidence``).
        verify_ratio: the bucket's ``verify_ratio``.
        min_speedup: the speed-up to exceed (``PolicyTable.min_speedup``).
        load: the pass planned so far, this lane's own row included.
    """
    n = min(len(confidence), len(verify_ratio))
    if not n:
        return PLAIN_STEP
    gained = np.cumsum(np.cumprod(confidence[:n], dtype=np.float64))  # [n]: E(1 .. n)
    cost = np.array([pass_cost(verify_ratio, load.rows + i) for i in range(1, n + 1)]) / pass_cost(verify_ratio,
                                                                                                 load.rows)
    speedup = (load.tokens + gained) / load.tokens / cost
    best = int(np.argmax(speedup))
    if speedup[best] <= min_speedup:
        return PLAIN_STEP
    return LookupStep(best + 1, float(speedup[best]), float(gained[best]))


@dataclass
class LookupTracker:
    """One request's realised payoff of its n-gram-only steps of retrieval proposals, and the bar
    it raises for them when they fall short (docs/design.md, "Speculation policy").

    A step of n tokens costs ``verify_ratio[n-1]`` decode steps, was priced at a speed-up ``s``
    (``LookupStep.speedup``) and keeps ``emitted`` tokens (bonus included). Once a full ``window``
    realises ``sum(emitted) / sum(cost)`` no more than ``min_speedup``, the request backs off for
    its next ``wait`` chances (steps planned plain where a retrieval proposal priced to pay): a step
    must be priced above ``bar = min_speedup * expected / kept`` (the window's tokens). A window
    after a back-off that does not pay either doubles the wait (up to ``max_wait``), one that pays
    resets it. Steps of a grammar's forced tokens alone are neither judged nor declined.

    Attributes:
        window: n-gram-only steps judged together.
        first_wait, max_wait: chances of a first back-off, and the cap of the doubling.
        wait: chances of the next back-off.
        declining: chances of the back-off still to come (0: none).
        bar: the priced speed-up a step must exceed while backing off.
        after_backoff: the window follows a back-off and has not yet paid.
        backoffs: times the request backed off.
        priced: the priced speed-up of the step taken, until ``record`` judges it.
    """

    window: int = 8
    first_wait: int = 16
    max_wait: int = 256
    wait: int = field(init=False)
    declining: int = 0
    bar: float = 0.0
    after_backoff: bool = False
    backoffs: int = 0
    priced: float = 0.0
    _steps: deque = field(init=False, repr=False)  # (emitted, cost, expected tokens) of the last steps

    def __post_init__(self) -> None:
        self.wait = self.first_wait
        self._steps = deque(maxlen=self.window)

    @property
    def speedup(self) -> float | None:
        """The realised speed-up of the steps in the window; None without one."""
        if not self._steps:
            return None
        return sum(e for e, _, _ in self._steps) / sum(c for _, c, _ in self._steps)

    def chance(self) -> float:
        """A chance of an n-gram-only step: the priced speed-up a step must exceed now, besides
        the table's ``min_speedup`` (0.0, or ``bar`` while backing off, which counts the chance)."""
        if not self.declining:
            return 0.0
        self.declining -= 1
        return self.bar

    def take(self, speedup: float) -> None:
        """The request takes an n-gram-only step priced at ``speedup``."""
        self.priced = speedup

    def record(self, emitted: int, cost: float, min_speedup: float) -> None:
        """The step taken last, which cost ``cost`` decode steps, kept ``emitted`` tokens; a full
        window that realises ``min_speedup`` or less backs off."""
        self._steps.append((emitted, cost, self.priced * cost))
        if len(self._steps) < self.window:
            return
        if self.speedup <= min_speedup:
            if self.after_backoff:
                self.wait = min(2 * self.wait, self.max_wait)
            kept, expected = sum(e for e, _, _ in self._steps), sum(x for _, _, x in self._steps)
            self.declining, self.bar, self.after_backoff = self.wait, min_speedup * expected / kept, True
            self.backoffs += 1
            self._steps.clear()
        elif self.after_backoff:  # a window after a back-off that paid
            self.after_backoff, self.wait = False, self.first_wait


class PolicyTable(BaseModel):
    """Context buckets for one DFlash tag on one backend (the JSON file ``calibrate`` writes).

    Attributes:
        model: the DFlash tag (e.g. ``"smollm2-dflash:135m"``).
        backend: ``"cpu"`` or ``"npu"``.
        buckets: ascending ``max_context``; a context above the last bucket uses the last one.
        block_size: the draft's block size the table was calibrated with (the anchor and up to
            ``block_size - 1`` drafted tokens); required where a bucket has ``verify_ratio``,
            which then holds ``block_size - 1`` values, and no bucket's ``draft_length`` may exceed
            ``block_size - 1``; None in tables without them.
        min_speedup: the expected speed-up an n-gram-only step must exceed (``lookup_step``);
            ``calibrate`` writes its ``--min-speedup``.
        measured: provenance (command, machine, per-bucket timings, acceptance profile); free-form.

    Raises:
        pydantic.ValidationError: buckets not ascending, a bucket out of range, a
            ``verify_ratio`` whose length is not ``block_size - 1`` or a ``draft_length`` above it
            (naming the bucket).
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    backend: str
    buckets: list[Bucket] = Field(min_length=1)
    block_size: int | None = Field(default=None, ge=2)
    min_speedup: float = Field(default=MIN_SPEEDUP, ge=1.0)
    measured: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ascending(self) -> PolicyTable:
        edges = [b.max_context for b in self.buckets]
        if edges != sorted(set(edges)):
            raise ValueError(f"buckets must have strictly ascending max_context, got {edges}")
        return self

    @model_validator(mode="after")
    def _draft_length_within_the_block(self) -> PolicyTable:
        for b in self.buckets:
            if self.block_size is not None and b.draft_length is not None and b.draft_length > self.block_size - 1:
                raise ValueError(f"bucket up to {b.max_context}: draft_length {b.draft_length} is beyond "
                                 f"block_size - 1 = {self.block_size - 1}")
        return self

    @model_validator(mode="after")
    def _verify_ratio_per_drafted_token(self) -> PolicyTable:
        for b in self.buckets:
            if b.verify_ratio is None:
                continue
            if self.block_size is None:
                raise ValueError(f"bucket up to {b.max_context}: verify_ratio needs the table's block_size")
            if len(b.verify_ratio) != self.block_size - 1:
                raise ValueError(f"bucket up to {b.max_context}: verify_ratio has {len(b.verify_ratio)} values, "
                                 f"block_size - 1 = {self.block_size - 1} expected")
        return self

    def bucket(self, context: int) -> Bucket:
        """The bucket of a context of ``context`` tokens."""
        for b in self.buckets:
            if context <= b.max_context:
                return b
        return self.buckets[-1]

    def on_host(self, verify_ratio: list[float], context: int) -> PolicyTable:
        """This table with another host's verify costs (``speculation.costs``): each bucket's
        ``verify_ratio`` times the host's curve measured at ``context`` tokens over this table's
        own at that context, value by value; the table keeps its profile across contexts
        (attention's share grows with them on any host) and takes the host's level. The draft's
        K, gate and ``cost_ratio`` stay the table's: choosing them takes the draft's acceptance
        records, which ``litellm-flm calibrate`` measures on the host (a table of its own).
        A table without ``verify_ratio`` at ``context``, or of another length, is returned as it is.
        """
        own = self.bucket(context).verify_ratio
        if own is None or len(own) != len(verify_ratio):
            return self
        scale = [host / mine for host, mine in zip(verify_ratio, own)]
        buckets = [b if b.verify_ratio is None else
                   b.model_copy(update={"verify_ratio": [round(v * s, 4) for v, s in zip(b.verify_ratio, scale)]})
                   for b in self.buckets]
        return self.model_copy(update={"buckets": buckets, "measured": {
            **self.measured, "host_verify_ratio": {"context": context, "verify_ratio": list(verify_ratio)}}})

    @property
    def drafts(self) -> bool:
        """``SpeculationPolicy.drafts``: some bucket speculates."""
        return any(b.speculate for b in self.buckets)

    def plan(self, context: int, tracker: AcceptanceTracker, most: int) -> Plan:
        """``SpeculationPolicy.plan``: the bucket's K as the request's tracker allows it (at most
        ``most``), and the bucket's gate."""
        bucket = self.bucket(context)
        k = tracker.draft_length(bucket)
        return Plan(most if k is None else min(k, most), bucket.min_confidence)

    def record_step(self, context: int, tracker: AcceptanceTracker, emitted: int) -> None:
        """``SpeculationPolicy.record_step``: into the request's tracker, against the bucket."""
        tracker.record_step(self.bucket(context), emitted)

    def lookup_step(self, context: int, confidence: np.ndarray, load: PassLoad = ALONE) -> LookupStep | None:
        """``SpeculationPolicy.lookup_step``: ``paying_step`` with the bucket's ``verify_ratio``
        and the table's ``min_speedup``; None where the bucket has none."""
        ratio = self.bucket(context).verify_ratio
        return None if ratio is None else paying_step(confidence, ratio, self.min_speedup, load)

    def record_plain(self, tracker: AcceptanceTracker, emitted: int = 1) -> None:
        """``SpeculationPolicy.record_plain``: into the request's tracker."""
        tracker.record_plain(emitted)

    def record_lookup(self, context: int, lookups: LookupTracker, verified: int, emitted: int) -> None:
        """``SpeculationPolicy.record_lookup``: the step cost the bucket's ``verify_ratio[verified-1]``
        decode steps; its payoff is judged against the table's ``min_speedup``."""
        lookups.record(emitted, self.bucket(context).verify_ratio[verified - 1], self.min_speedup)

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
    """One request's online acceptance estimate and its speculate / plain decision
    (docs/design.md, "Speculation policy").

    The estimate is the mean AL over the request's last ``window`` speculative steps (a step the
    confidence gate left plain counts, with its one token); each time speculation (re)starts, the
    window starts full of the bucket's ``expected_al``. When the estimate drops below the bucket's
    ``cost_ratio`` the request decodes plainly for ``probe_after`` tokens, then probes: speculation
    restarts with a fresh window. A probe switched off again within ``window`` steps doubles the
    wait (up to ``max_probe_after``); one that lasts ``window`` steps resets it.

    Attributes:
        window: speculative steps the estimate averages (and steps a probe must last).
        first_probe_after, max_probe_after: tokens of plain decoding before the first probe, and
            the cap of its doubling.
        al: the estimate (mean AL over the window, tokens per speculative step, bonus included);
            None until speculation first starts; after a switch-off, the estimate that caused it.
        tokens: tokens this request generated through the tracker (plain and speculative).
        plain_until: ``tokens`` value before which the request decodes plainly (0: speculating).
        probe_after: tokens of plain decoding before the next probe.
        probing: speculation restarted after a switch-off and has not yet lasted ``window`` steps.
        switches: times the tracker turned speculation off (failed probes included).
    """

    window: int = 16
    first_probe_after: int = 16
    max_probe_after: int = 512
    al: float | None = None
    tokens: int = 0
    plain_until: int = 0
    probe_after: int = 16
    probing: bool = False
    switches: int = 0
    _recent: deque = field(init=False, repr=False)  # the window: emitted tokens of the last steps
    _steps: int = field(default=0, init=False, repr=False)  # speculative steps since the (re)start

    def __post_init__(self) -> None:
        self.probe_after = self.first_probe_after
        self._recent = deque(maxlen=self.window)

    def draft_length(self, bucket: Bucket) -> int | None:
        """K for the next step in ``bucket``: 0 means a plain decode step, None the whole block."""
        if not bucket.speculate or self.tokens < self.plain_until:
            return 0
        if not self._recent:  # (re)starting: the prior fills the window
            self._recent.extend([bucket.expected_al] * self.window)
            self._steps, self.probing, self.plain_until = 0, self.plain_until > 0, 0
        return bucket.draft_length

    def record_plain(self, emitted: int = 1) -> None:
        """A step planned plain generated ``emitted`` tokens (a plain decode step one, an
        n-gram-only step its kept tokens): they count towards the probe, not the estimate."""
        self.tokens += emitted

    def record_step(self, bucket: Bucket, emitted: int) -> None:
        """A speculative step in ``bucket`` emitted ``emitted`` tokens (accepted + bonus)."""
        self._recent.append(emitted)
        self._steps += 1
        self.tokens += emitted
        self.al = sum(self._recent) / len(self._recent)
        if self.al < bucket.cost_ratio:  # speculation does not pay for this request (now)
            if self.probing:
                self.probe_after = min(2 * self.probe_after, self.max_probe_after)
            self.switches += 1
            self.plain_until = self.tokens + self.probe_after
            self._recent.clear()
        elif self._steps == self.window:  # lasted a whole window: a probe that paid
            self.probing, self.probe_after = False, self.first_probe_after
