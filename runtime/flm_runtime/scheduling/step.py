"""One decoding step of one sequence, as the engine sees it: its ``Lane``, the ``StepRecord`` of what
the step runs, and the ``Stepper`` interface through which an engine takes multi-token steps.

A plain engine decodes one token per step: its record is ``PLAIN`` (the single row ``[anchor]``)
and ``Lane.decode_plain`` takes the token. An engine given a ``Stepper`` (the speculative decoder,
``flm_runtime.speculation``) asks it for every decoding sequence's record (``Stepper.prepare``),
runs the records' rows in the step's one batched target pass, and hands each sequence its rows'
logits and taps (``Stepper.complete``). The engine itself never imports the speculation package:
``flm_runtime.api`` wires a decoder in (``flm_runtime.speculation.setup``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from flm_runtime.kv_cache import KVCache
from flm_runtime.request import SpecStats
from flm_runtime.sampling.picker import Picker

NO_CONFIDENCE = np.zeros(0, dtype=np.float32)  # [0]: the draft did not run
NO_FORCED = np.zeros(0, dtype=bool)  # [0]: no token of the step was forced by a grammar


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class StepRecord:
    """What one decoding step runs for one sequence (``Stepper.prepare``; ``PLAIN`` in an engine
    without a stepper).

    Attributes:
        ids: ``[k]`` int64 drafted tokens to verify after the anchor, after the confidence gate
            (k = 0: a plain decode step): the draft's, or ``proposer``'s, with the tokens a
            grammar forces in their places (``forced``).
        planned: K, the tokens the speculation policy planned to draft (0: the draft did not run:
            a plain step, or with ``proposer`` an n-gram-only step).
        confidence: ``[K]`` float32, the draft's confidence in each of its K tokens, before the
            gate (``Proposal.confidence``).
        lookups: the step's retrieval proposals (``speculation.retrieval.Lookup``) by proposer
            name, verified or not, which the decoder scores against the kept tokens; empty: there
            were none.
        proposer: the name of the retrieval proposer whose tokens ``ids`` are
            (``lookups[proposer].ids``, or their first ones on an n-gram-only step): ``"ngram"``,
            ``"suffix"``; ``"grammar"``: a grammar forced them all; None: the draft's, or a plain
            step.
        forced: ``[k]`` bool, True where the request's grammar forced the token (llguidance's
            fast-forward tokens: no proposer guessed it); ``[0]``: none was.
    """

    ids: np.ndarray
    planned: int = 0
    confidence: np.ndarray = field(default_factory=lambda: NO_CONFIDENCE)
    lookups: Mapping[str, Any] = field(default_factory=dict)
    proposer: str | None = None
    forced: np.ndarray = field(default_factory=lambda: NO_FORCED)

    @property
    def gated(self) -> bool:
        """The draft ran but the gate left nothing to verify: a plain step."""
        return self.planned > 0 and not len(self.ids)

    def rows(self, anchor_id: int) -> np.ndarray:
        """The sequence's target rows ``[k+1]`` int64: ``[anchor, d1 .. dk]`` (k = 0: the plain
        decode row)."""
        return np.concatenate([[anchor_id], self.ids]).astype(np.int64)


# A plain decode step's record: nothing planned, nothing drafted.
PLAIN = StepRecord(np.zeros(0, dtype=np.int64))


class StepperState(Protocol):
    """A stepper's per-sequence state (``Stepper.new_state``), held by the ``Sequence``."""

    def copy(self) -> StepperState:
        """An independent copy (each choice of a request continues from the prompt's)."""

    def report(self) -> SpecStats:
        """The request's speculation counters, a copy."""


@dataclass
class Lane:
    """One sequence's part of a (batched) decoding step.

    Attributes:
        anchor_id: the last committed token (not yet in ``cache``); None before the first (the
            prompt's last chunk gives it, through ``decode_plain``).
        cache: the target's KV cache of the sequence.
        state: the sequence's ``StepperState``; None in an engine without a stepper.
        picker: the request's ``Picker`` (processors, sampling parameters, own generator).
        emit: pushes one token through the sequence's output pipeline (stop checks, delivery) and
            returns True once the sequence is finished; tokens after that are not pushed.
    """

    anchor_id: int | None
    cache: KVCache
    state: Any
    picker: Picker
    emit: Callable[[int], bool]

    def decode_plain(self, logits: np.ndarray) -> bool:
        """A plain step's token: taken from ``logits`` ``[V]`` by the request's picker (its own
        processors, params and RNG, so the token does not depend on other sequences), pushed
        through ``emit``; True once the sequence is finished."""
        return self.emit(self.picker.pick_and_accept(logits))


class Stepper(Protocol):
    """Multi-token decoding steps for an engine (``speculation.speculative.SpeculativeDecoder``).

    Attributes:
        target: the target model (the engine's ``model``).
        draft: the draft model, whose ``config`` sizes the KV bytes per token (``admission``);
            None: the stepper runs no draft.
        taps: the target layers whose hidden states each pass records for the stepper; empty:
            none, so a prompt's cached prefix needs no pass (the engine's prefix caching).
        block_size: rows of a whole speculative block (the anchor and K drafted tokens); a
            sequence reserves KV for K positions past its budget.
    """

    target: Any
    draft: Any
    taps: tuple[int, ...]
    block_size: int

    def new_state(self, capacity: int = 0, *, speculate: bool = True, prediction: tuple[int, ...] = ()) -> StepperState:
        """Fresh state for one sequence (``capacity``: a hint in tokens; ``speculate`` and
        ``prediction``: the request's ``SamplingParams.speculation`` and ``prediction``)."""

    def add_prompt(self, cache: KVCache, state: StepperState, ids: np.ndarray, taps: np.ndarray | None) -> None:
        """A prompt chunk ``ids`` ``[T]`` the target ``cache`` now holds, with its taps (None
        for a prefix adopted from the prefix cache, without ``taps``)."""

    def prepare(self, lanes: list[Lane]) -> list[StepRecord]:
        """Every lane's record for this step; the engine runs ``record.rows(lane.anchor_id)`` of
        each through the target. If it raises, every lane's state is still consistent."""

    def complete(self, lane: Lane, record: StepRecord, logits: np.ndarray, taps: np.ndarray) -> Any:
        """Finish one lane's step from its rows' logits ``[k+1, V]`` and taps: the tokens it keeps
        go through ``lane.emit``."""

    def finish(self, prompt_ids: np.ndarray, generated_ids: np.ndarray) -> None:
        """A request finished: its prompt ``[T]`` and generated tokens ``[G]`` (int64), which the
        stepper may keep for later requests (the suffix proposer's index)."""
