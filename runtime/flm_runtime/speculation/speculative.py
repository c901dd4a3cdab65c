"""DFlash speculative decoding: the verifier (pure functions) and the speculative step.

DFlash: Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv:2602.06036 (2026); the draft model is ``flm_runtime.models.dflash``.

One step (docs/dflash.md, "One speculative step"): the proposer drafts ``d1 .. dK`` from the
anchor; the target runs ``[anchor, d1 .. dK]`` at ``start .. start+K`` in one pass (logits
``[K+1, V]`` and taps); ``verify`` keeps a prefix of the draft plus one target token (the bonus:
docs/dflash.md, "Vocabulary"); the target KV cache is trimmed past what was kept, and the kept
positions' taps become the draft's pending context. Batched: ``prepare`` plans every lane and
drafts for all drafting lanes in one draft pass (a ``StepRecord`` each), the engine runs every
lane's ``StepRecord.rows`` in ONE target pass, ``complete`` verifies and commits lane by lane;
``step`` does the three for one lane. Beside the draft, the retrieval proposers (``retrieval.py``)
and a grammar's forced tokens (``constrain``); ``choose`` picks the proposal a step verifies
(docs/dflash.md, "Serving: batched steps and the speculation policy" and the sections after it).

Lossless (docs/design.md, "DFlash"): every position's token is taken by the request's ``Picker``
as in plain decoding, row ``j`` processed with the state after the ``j`` tokens kept before it.
Greedy output is plain greedy decoding's; sampled, each emitted token is distributed as the
target's processed and warped ``p'`` (speculative sampling with a one-hot draft: Leviathan et al.
2023, arXiv:2211.17192), one draw per emitted token with the request's RNG, so a seeded request
gives the same tokens with or without speculation (up to float rounding of logits).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from flm_runtime.backends import prefill_chunks
from flm_runtime.kv_cache import KVCache
from flm_runtime.outputs import Proposal, confident_length, expected_accepted
from flm_runtime.request import ProposerCounts, SpecStats
from flm_runtime.sampling.grammar import GrammarProcessor
from flm_runtime.sampling.picker import Picker
from flm_runtime.scheduling.step import NO_CONFIDENCE, NO_FORCED, PLAIN, Lane, StepRecord
from flm_runtime.speculation.ngram import PromptLookup
from flm_runtime.speculation.policy import (ALWAYS_SPECULATE, PLAIN_STEP, AcceptanceTracker, LookupTracker, PassLoad,
                                            Plan, SpeculationPolicy)
from flm_runtime.speculation.prediction import PredictionLookup
from flm_runtime.speculation.retrieval import Lookup, Retrieval
from flm_runtime.speculation.suffix import SuffixIndex, SuffixProposer

# Pending taps of plain and n-gram-only steps are folded into the draft cache once this many
# accumulate (while the policy keeps the draft from running), so that each step copies a bounded
# array.
PENDING_FLUSH = 64

# proposer(draft_cache, anchor_id, start) -> [K] int64 drafted ids: a stand-in for the draft's
# proposals (tests replay known tokens to force long acceptances).
DraftStandIn = Callable[[KVCache, int, int], np.ndarray]

DRAFT = "draft"      # the draft's proposal among a step's candidates (``StepRecord.proposer`` None)
GRAMMAR = "grammar"  # ``StepRecord.proposer`` of a step whose tokens a grammar forced, all of them


def verify(draft_ids: np.ndarray, target_logits: np.ndarray, picker: Picker) -> tuple[int, int]:
    """Lossless verifier for a one-hot (argmax) draft (see the module docstring).

    For ``j = 0, 1, ..``: ``t = picker.pick_and_accept(row j)`` (row ``j`` processed with the
    state after the ``j`` tokens kept before it, then warped and drawn as plain decoding would);
    if ``j < K`` and ``t == d(j+1)`` accept and go on, else stop with ``t`` (recovered at a mismatch, bonus after
    all K accepted). Greedy, ``t`` is the processed row's argmax (lowest id on ties), so the kept
    prefix is the longest one equal to the target's greedy tokens; a drafted token a processor
    forbids (a grammar mask, a bias of -100) can never equal ``t`` and ends the prefix.

    Args:
        draft_ids: ``[K]`` int drafted tokens ``d1 .. dK``.
        target_logits: ``[K+1, V]`` float32 target logits of the verify pass; row ``j`` predicts
            the token after block position ``j`` (row 0 follows the anchor).
        picker: the request's picker; takes (picks and accepts) exactly the emitted tokens, so it
            consumes one ``rng.random()`` per emitted token (none when greedy).
    Returns:
        ``(n_accepted, token)``: ``d1 .. d_n`` are kept, then ``token``.
    """
    k = draft_ids.shape[0]
    assert target_logits.shape[0] == k + 1, f"target_logits {target_logits.shape} != [K+1={k + 1}, V]"
    for j in range(k + 1):
        t = picker.pick_and_accept(target_logits[j])
        if j == k or t != int(draft_ids[j]):
            return j, t
    raise AssertionError("unreachable")


@dataclass
class SpecState:
    """One sequence's speculative state.

    Invariant (docs/dflash.md): ``draft_cache.length + len(pending) == start``, the anchor's
    position (= the target cache's length between steps), where the policy may draft (both stay
    empty where it never does: ``SpeculativeDecoder.taps``), and ``len(proposer) == start`` for
    each retrieval proposer.

    Attributes:
        draft_cache: the draft's context K/V; None in a decoder without a draft.
        pending: ``[P, n*E]`` float32 taps of committed tokens not yet in ``draft_cache``.
        tracker: the request's acceptance estimate and speculate / plain decision (policy.py).
        stats: the request's speculation counters.
        proposers: the retrieval proposers over the tokens of the target cache, in the order
            that breaks ties between their proposals (the earlier wins); empty: the draft alone.
        lookups: the request's payoff of its n-gram-only steps of retrieval proposals (policy.py).
        speculate: False: the request asked for plain decoding (``SamplingParams.speculation``),
            every step is a plain one.
    """

    draft_cache: KVCache | None
    pending: np.ndarray
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    stats: SpecStats = field(default_factory=SpecStats)
    proposers: tuple[Retrieval, ...] = ()
    lookups: LookupTracker = field(default_factory=LookupTracker)
    speculate: bool = True

    def copy(self) -> SpecState:
        """An independent state with the same draft context, pending taps, trackers, counters and
        proposers (the engine's ``n`` > 1: each choice continues from a copy of the prompt's
        state)."""
        return SpecState(None if self.draft_cache is None else self.draft_cache.copy(), self.pending.copy(),
                         copy.deepcopy(self.tracker), self.stats.copy(), tuple(p.copy() for p in self.proposers),
                         copy.deepcopy(self.lookups), self.speculate)

    def report(self) -> SpecStats:
        """The counters with the tracker's figures (``switches_off``, ``al_estimate``), a copy."""
        return dataclasses.replace(self.stats.copy(), switches_off=self.tracker.switches, al_estimate=self.tracker.al)


class LaneStep(NamedTuple):
    """One lane's committed step.

    Attributes:
        record: what the step ran.
        accepted: drafted tokens the verifier kept (0 on a plain step), including any after a
            stop that cut the step short.
        finished: the lane's output pipeline finished the sequence.
    """

    record: StepRecord
    accepted: int
    finished: bool


class SpeculativeDecoder:
    """Drives a target, with or without a DFlash draft, through prefill and (batched) decoding
    steps.

    Args:
        target: a ``TargetModel``: ``forward_batch(rows, caches, taps=)``, ``prefill_chunk``,
            ``config``.
        draft: ``DFlashDraft``-like: ``config`` (``target_layer_ids``, ``block_size``),
            ``new_cache``, ``add_context``, ``draft_blocks``; None: the retrieval proposers and a
            grammar's forced tokens alone, in n-gram-only steps (a tag without a draft), which
            takes a ``policy`` that never drafts and a ``block_size``.
        policy: the speculation policy of this tag and backend (a ``PolicyTable``); the default
            ``ALWAYS_SPECULATE`` drafts the whole block (K = block_size - 1) at every context,
            verifies all of it and never switches off.
        block_size: the rows of a whole step without a draft (the anchor and up to
            ``block_size - 1`` proposed tokens); with a draft, the draft's.
        proposer: replaces the draft's proposals (tests), called per sequence as
            ``proposer(draft_cache, anchor_id, start)``; the draft still keeps its context cache.
        ngram: prompt lookup beside the draft (``ngram.py``; module docstring); False: not
            (calibration, measuring the draft).
        suffix: the engine's index of its finished requests (``suffix.py``), which this decoder
            keeps (``finish``) and each sequence's suffix proposer reads; None: no suffix
            proposer. With neither, the draft's proposals alone.

    Attributes:
        taps: the target layers whose taps its passes return (``forward_batch(taps=)``); empty
            where ``policy.drafts`` is False: a decoder whose draft never runs keeps no draft
            context, so its plain and n-gram-only steps cost what they cost without a draft.
    """

    def __init__(self, target, draft, *, policy: SpeculationPolicy = ALWAYS_SPECULATE,
                 proposer: DraftStandIn | None = None, ngram: bool = True, suffix: SuffixIndex | None = None,
                 block_size: int | None = None):
        assert (draft is None) == (block_size is not None), "a block size without a draft, the draft's with one"
        assert draft is not None or not policy.drafts, "a policy that drafts needs a draft"
        self.target = target
        self.draft = draft
        self.taps = tuple(draft.config.target_layer_ids) if draft is not None and policy.drafts else ()
        self.block_size = int(draft.config.block_size) if draft is not None else block_size
        self._policy = policy
        self.proposer = proposer
        self.ngram = ngram
        self.suffix = suffix
        self._tap_width = 0 if draft is None else len(draft.config.target_layer_ids) * int(target.config.hidden_size)

    @property
    def policy(self) -> SpeculationPolicy:
        """The policy it was built with, fixed: ``taps`` and every sequence's draft context follow
        from it (a decoder for another policy is a new ``SpeculativeDecoder``)."""
        return self._policy

    def new_state(self, capacity: int = 0, *, speculate: bool = True, prediction: tuple[int, ...] = ()) -> SpecState:
        """Fresh state for one sequence (``capacity``: a hint in tokens; no room is reserved in a
        draft cache that stays empty, without ``self.taps``). ``speculate`` False: every step of
        the sequence is plain; ``prediction``: the request's predicted output's ids, proposed by
        a ``PredictionLookup`` ahead of the other retrieval proposers (it wins their ties)."""
        proposers = [PredictionLookup(prediction)] if prediction else []
        if self.ngram:
            proposers.append(PromptLookup())
        if self.suffix is not None:
            proposers.append(SuffixProposer(self.suffix))
        draft_cache = None if self.draft is None else self.draft.new_cache(capacity if self.taps else 0)
        state = SpecState(draft_cache, self._no_taps(), proposers=tuple(proposers), speculate=speculate)
        if prediction:  # counted from the start: a prediction never verified reports its zeros
            state.stats.proposers["prediction"] = ProposerCounts()
        return state

    def finish(self, prompt_ids: np.ndarray, generated_ids: np.ndarray) -> None:
        """A finished request's generated tokens ``[G]``, after the last ``depth - 1`` of its
        prompt's ``[T]`` (the context they continued), join the suffix index, if the decoder keeps
        one. The rest of the prompt is left out: SuffixDecoding's global index holds outputs (a
        request's own prompt is prompt lookup's), and indexing costs the engine thread tens of
        microseconds a token."""
        if self.suffix is not None:
            context = prompt_ids[max(len(prompt_ids) - self.suffix.depth + 1, 0):]
            self.suffix.add(np.concatenate([context, generated_ids]))

    def prefill(self, prompt_ids: np.ndarray, cache: KVCache, state: SpecState) -> np.ndarray:
        """Chunked target prefill whose taps go into the draft cache chunk by chunk.

        Returns:
            ``[V]`` float32 logits of the last prompt position.
        """
        assert cache.length == 0 and (state.draft_cache is None or state.draft_cache.length == 0)
        assert len(state.pending) == 0
        start = 0
        for out in prefill_chunks(self.target, prompt_ids, cache, taps=self.taps):
            self.add_prompt(cache, state, prompt_ids[start : cache.length], out.taps)
            start = cache.length
        return out.logits[0]

    def add_prompt(self, cache: KVCache, state: SpecState, ids: np.ndarray, taps: np.ndarray | None) -> None:
        """A prompt chunk the target ``cache`` now holds: its ids ``[T]`` go into the retrieval
        proposers and its taps ``[T, n*E]`` (None without ``self.taps``) into the draft cache
        (its context K/V), which restores the invariant."""
        assert len(state.pending) == 0, "a prompt chunk after decoding started"
        if self.taps:
            self.draft.add_context(state.draft_cache, taps, state.draft_cache.length)
        for p in state.proposers:
            p.extend(ids)
        self._check(cache, state)

    def step(self, lane: Lane) -> LaneStep:
        """One decoding step of one lane: prepare, one target pass of its rows, verify and
        complete."""
        record = self.prepare([lane])[0]
        out = self.target.forward_batch([record.rows(lane.anchor_id)], [lane.cache], taps=self.taps)  # the verify pass
        return self.complete(lane, record, out.logits, out.taps)

    def prepare(self, lanes: list[Lane]) -> list[StepRecord]:
        """The draft side of one decoding step of every lane: its plan, then one batched draft
        pass for the lanes that draft.

        Per lane, from ``anchor_id`` at position ``start = cache.length``: the policy plans K (0
        also near the context end, where a whole block, which the draft always runs, does not
        fit) and the gate; with ``K > 0`` the draft catches up on the pending taps and proposes
        ``d1 .. dK``, of which the lane keeps the first ``k = confident_length(confidence,
        min_confidence)`` (k = 0 makes the step a gated plain step), or a retrieval proposer's
        proposal when ``choose`` prefers it, under a grammar each as it lets the step verify it
        (``constrain``: up to ``block_size - 1`` tokens with the forced ones); with ``K = 0``, a
        plain step or an n-gram-only one (``_lookup_only``). The caller runs
        ``record.rows(lane.anchor_id)`` of every lane through the target (with ``taps=self.taps``)
        and ``complete``s each lane.

        Returns:
            per lane, its ``StepRecord``. Whatever follows, every lane's invariant holds (the catch-up
            only moved taps from pending into the draft cache): a target pass that raises may be
            retried.
        """
        for lane in lanes:
            self._check(lane.cache, lane.state)
        grammars = [_grammar(lane.picker) for lane in lanes]
        plans = [self._plan(lane) for lane in lanes]
        drafting = [lane for lane, plan in zip(lanes, plans) if plan.draft_length]
        for lane in drafting:
            state = lane.state
            self.draft.add_context(state.draft_cache, state.pending, state.draft_cache.length)
            state.pending = self._no_taps()
        proposal = self._draft_pass([lane.state.draft_cache for lane in drafting],
                                    [lane.anchor_id for lane in drafting],
                                    max(plan.draft_length for plan in plans)) if drafting else None  # [S, max K]
        rows = iter(range(len(drafting)))  # the proposal's row of each drafting lane, in order
        load = PassLoad(len(lanes), float(len(lanes)))  # a row and a token per lane, then what each adds
        records = []
        for lane, grammar, (k, min_confidence) in zip(lanes, grammars, plans):
            if not k:
                record, gained = self._lookup_only(lane, grammar, load)
            else:
                row = next(rows)
                draft = StepRecord(proposal.ids[row, :k], k, proposal.confidence[row, :k])
                lookups = {p.name: p.find(lane.anchor_id, k, min_confidence) for p in lane.state.proposers}
                record = choose(draft, lookups, grammar, min_confidence, self.block_size - 1)
                gained = expected_accepted(record.confidence[: len(record.ids)])
            load = PassLoad(load.rows + len(record.ids), load.tokens + gained)
            records.append(record)
        return records

    def complete(self, lane: Lane, record: StepRecord, logits: np.ndarray, taps: np.ndarray) -> LaneStep:
        """Complete one lane's step from its rows of the target pass.

        A speculative step verifies ``record.ids`` (``verify``), rolls the cache back past what was
        kept, makes the kept positions' taps pending, records the step (policy, stats) and emits
        the kept tokens one by one through ``lane.emit``; an n-gram-only step is one too, but
        the policy records it as a plain one, and the policy's tracker does not credit the draft
        with a drafting step's forced tokens (``record.forced``). A plain step (``record.ids``
        empty) makes its row's taps pending, records it, and takes its token as an engine
        without a draft does (the request's picker, then ``lane.emit``).

        Args:
            lane: the lane, as given to ``prepare``.
            record: its ``StepRecord`` from ``prepare``.
            logits: ``[k+1, V]`` float32 target logits of ``record.rows``.
            taps: ``[k+1, n*E]`` float32 taps of the same rows (None without ``self.taps``).
        Returns:
            the lane's ``LaneStep`` (``finished``: ``emit`` finished the sequence).
        """
        cache, state = lane.cache, lane.state
        start = cache.length - len(logits)
        if not len(record.ids):
            token = lane.picker.pick_and_accept(logits[0])
            self._complete_plain(lane, record, start, taps, token)
            return LaneStep(record, 0, lane.emit(token))
        n_accepted, bonus = verify(record.ids, logits, lane.picker)
        cache.trim(start + n_accepted + 1)  # roll back the rejected positions
        self._add_pending(state, taps if taps is None else taps[: n_accepted + 1])
        kept = [*record.ids[:n_accepted].tolist(), bonus]
        fed = record.rows(lane.anchor_id)[: n_accepted + 1]  # the anchor and the accepted tokens
        for p in state.proposers:
            p.extend(fed)
            p.observe(record.lookups.get(p.name), kept)
        if record.planned:  # the tracker judges the draft's pass: forced tokens come without it
            forced = int(np.count_nonzero(record.forced[:n_accepted]))
            self.policy.record_step(start, state.tracker, n_accepted + 1 - forced)
        else:  # n-gram-only: the tracker's AL asks whether the draft's pass pays, which this step did not run
            self.policy.record_plain(state.tracker, n_accepted + 1)
            if record.proposer != GRAMMAR:  # forced tokens alone are exact: nothing to judge
                self.policy.record_lookup(start, state.lookups, len(record.ids), n_accepted + 1)
        self._check(cache, state)
        emitted, finished = 0, False
        for token in kept:
            emitted += 1
            if finished := lane.emit(int(token)):
                break
        accepted = min(emitted, n_accepted)
        state.stats.record_step(len(record.ids), accepted, emitted, proposer=record.proposer or DRAFT,
                                forced=int(np.count_nonzero(record.forced)),
                                forced_accepted=int(np.count_nonzero(record.forced[:accepted])))
        return LaneStep(record, n_accepted, finished)

    def _plan(self, lane: Lane) -> Plan:
        """The policy's plan for ``lane``'s next step; plain near the context end and for a
        request that asked for plain decoding."""
        cache = lane.cache
        if cache.length + self.block_size > cache.max_length or not lane.state.speculate:
            return Plan(0, 0.0)
        return self.policy.plan(cache.length, lane.state.tracker, self.block_size - 1)

    def _lookup_only(self, lane: Lane, grammar: GrammarProcessor | None, load: PassLoad) -> tuple[StepRecord, float]:
        """A lane planned plain: an n-gram-only step of the first ``n`` tokens of a retrieval
        proposal, or of the tokens the request's ``grammar`` forces (each as the grammar lets the
        step verify it, ``constrain``; at most ``block_size - 1``, and the rows must fit in the
        context), ``n`` from ``policy.lookup_step`` in a pass of ``load``, of the proposal with the
        best expected speed-up (the earlier proposer on a tie, the grammar's last), a retrieval
        proposal only above the bar of the request's ``LookupTracker``; else a plain step, which
        carries the proposals for ``complete`` to score, unless there were none, n-gram-only steps
        are off at this context or the request asked for plain decoding (``PLAIN``, as without
        retrieval proposers and grammar). The draft does not run.

        Returns:
            the record, and the accepted tokens it expects (``LookupStep.gained``).
        """
        proposers, cache = lane.state.proposers, lane.cache
        if not proposers and grammar is None or not lane.state.speculate:
            return PLAIN, 0.0
        most = min(self.block_size - 1, cache.max_length - cache.length - 1)  # positions after the anchor's
        lookups = {p.name: p.find(lane.anchor_id, most, 0.0) for p in proposers}
        candidates = {name: constrain(Candidate(lookup.ids, lookup.confidence), grammar, most)
                      for name, lookup in lookups.items()}
        if grammar is not None:
            candidates[GRAMMAR] = constrain(NO_CANDIDATE, grammar, most)
        steps = {name: self.policy.lookup_step(cache.length, c.confidence, load) for name, c in candidates.items()}
        proposed = any(lookup.match for lookup in lookups.values()) or any(len(c.ids) for c in candidates.values())
        if None in steps.values() or not proposed:
            return PLAIN, 0.0
        paying = [name for name, step in steps.items() if step.length and name != GRAMMAR]
        if paying:  # while the request backs off, a retrieval proposal must clear its bar
            bar = lane.state.lookups.chance()
            steps |= {name: PLAIN_STEP for name in paying if steps[name].speedup <= bar}
        best = max(steps, key=lambda name: steps[name].speedup)  # the first of equal ones
        if best != GRAMMAR and steps[best].length:
            lane.state.lookups.take(steps[best].speedup)
        record = _proposed(dataclasses.replace(PLAIN, lookups=lookups), best, candidates[best].cut(steps[best].length))
        return record, steps[best].gained

    def _complete_plain(self, lane: Lane, record: StepRecord, start: int, taps: np.ndarray, token: int) -> None:
        """A plain step's row (at position ``start``), which gave ``token``: its taps become
        pending, the retrieval proposers score the step's proposals if it had any, the step is
        recorded (a gated one as a 1-token speculative step)."""
        state = lane.state
        self._add_pending(state, taps)
        for p in state.proposers:
            p.extend([lane.anchor_id])
            p.observe(record.lookups.get(p.name), [token])
        if record.gated:
            self.policy.record_step(start, state.tracker, 1)
        else:
            self.policy.record_plain(state.tracker)
        state.stats.record_plain(record.gated)
        self._check(lane.cache, state)

    def _add_pending(self, state: SpecState, taps: np.ndarray | None) -> None:
        """The taps ``[T, n*E]`` of committed positions join the pending ones, which are folded
        into the draft cache once ``PENDING_FLUSH`` accumulate (the draft catches up on the rest
        before it next drafts); nothing without ``self.taps`` (None)."""
        if not self.taps:
            return
        state.pending = np.concatenate([state.pending, taps])
        if len(state.pending) >= PENDING_FLUSH:  # bounded: no copy that grows with the output
            self.draft.add_context(state.draft_cache, state.pending, state.draft_cache.length)
            state.pending = self._no_taps()

    def _draft_pass(self, caches: list[KVCache], anchor_ids: list[int], n_drafts: int) -> Proposal:
        """The first ``n_drafts`` drafted tokens of ``S`` sequences (``[S, n_drafts]``): one
        batched draft pass (``draft.draft_blocks``, whose LM head runs on those rows only), or
        the stand-in ``proposer`` sequence by sequence (confidence 1: never gated)."""
        if self.proposer is None:
            out = self.draft.draft_blocks(caches, anchor_ids, n_drafts)
        else:
            ids = np.stack([np.asarray(self.proposer(c, a, c.length), dtype=np.int64)[:n_drafts]
                            for c, a in zip(caches, anchor_ids)])
            out = Proposal(ids, np.ones(ids.shape, dtype=np.float32))
        assert out.ids.shape == out.confidence.shape == (len(caches), n_drafts), f"proposals {out.ids.shape}"
        return out

    def _no_taps(self) -> np.ndarray:
        return np.zeros((0, self._tap_width), dtype=np.float32)  # [0, n*E]

    def _check(self, cache: KVCache, state: SpecState) -> None:
        drafted_over = cache.length if self.taps else 0  # the context the draft holds or will
        held = 0 if state.draft_cache is None else state.draft_cache.length
        assert held + len(state.pending) == drafted_over, (
            f"draft cache {held} + pending {len(state.pending)} != {drafted_over}")
        for p in state.proposers:
            assert len(p) == cache.length, f"{p.name} proposer {len(p)} != anchor position {cache.length}"


class Candidate(NamedTuple):
    """One proposal a step may verify, as ``choose`` and ``_lookup_only`` compare them.

    Attributes:
        ids: ``[g]`` int64 tokens after the anchor.
        confidence: ``[g]`` float32, the chance that each is accepted once those before it were
            (a forced token's: 1.0).
        forced: ``[g]`` bool, True where the request's grammar forced the token; ``[0]``: none was.
    """

    ids: np.ndarray
    confidence: np.ndarray
    forced: np.ndarray = NO_FORCED

    @property
    def expected(self) -> float:
        """Its expected accepted tokens (``outputs.expected_accepted``)."""
        return expected_accepted(self.confidence)

    def cut(self, n: int) -> Candidate:
        """Its first ``n`` tokens (itself when that is all of them)."""
        return self if n == len(self.ids) else Candidate(self.ids[:n], self.confidence[:n], self.forced[:n])


NO_CANDIDATE = Candidate(PLAIN.ids, NO_CONFIDENCE)


def constrain(candidate: Candidate, grammar: GrammarProcessor | None, most: int) -> Candidate:
    """``candidate`` as the request's ``grammar`` lets a step verify it
    (``GrammarProcessor.speculate``: cut at the first token the grammar forbids, the tokens it
    forces in their places, at most ``most``), a forced token's confidence 1.0: it is the only
    token the mask leaves the target there, so the verifier keeps it whatever the logits (a
    draw of probability 1 when sampled). Without a grammar, ``candidate`` itself."""
    if grammar is None:
        return candidate
    ids, forced = grammar.speculate(candidate.ids, most)
    confidence = np.ones(len(ids), dtype=np.float32)
    own = np.flatnonzero(~forced)  # the candidate's own tokens, at their own positions
    confidence[own] = candidate.confidence[own]
    return Candidate(ids, confidence, forced)


def choose(record: StepRecord, lookups: dict[str, Lookup], grammar: GrammarProcessor | None = None,
           min_confidence: float = 0.0, most: int = 0) -> StepRecord:
    """The step's proposal among the draft's (``record.ids``, with the first ``len(record.ids)``
    of ``record.confidence``) and the retrieval proposals ``lookups``, each as the request's
    ``grammar`` lets the step verify it (``constrain``, at most ``most`` tokens; as it is without
    one) and cut by the confidence gate (``confident_length(confidence, min_confidence)``): the
    one of the most expected accepted tokens (``Candidate.expected``), the draft's on a tie, then
    the earlier in ``lookups``. Either way the ``StepRecord`` carries ``lookups`` (proposer name
    -> proposal, as proposed), so that ``complete`` scores them."""
    proposals = {DRAFT: Candidate(record.ids, record.confidence[: len(record.ids)]),
                 **{name: Candidate(lookup.ids, lookup.confidence) for name, lookup in lookups.items()}}
    candidates = {}
    for name, proposal in proposals.items():
        c = constrain(proposal, grammar, most)
        candidates[name] = c.cut(confident_length(c.confidence, min_confidence))
    best = max(candidates, key=lambda name: candidates[name].expected)  # the first of equal ones
    return _proposed(dataclasses.replace(record, lookups=lookups), best, candidates[best])


def _proposed(record: StepRecord, name: str, candidate: Candidate) -> StepRecord:
    """``record`` verifying ``candidate``, ``name``'s proposal: its ``proposer`` is ``name``
    (None for the draft's, or without tokens), or ``GRAMMAR`` where a grammar forced them all."""
    forced = np.count_nonzero(candidate.forced)
    proposer = None if name == DRAFT or not len(candidate.ids) else name
    return dataclasses.replace(record, ids=candidate.ids, forced=candidate.forced,
                               proposer=GRAMMAR if forced and forced == len(candidate.ids) else proposer)


def _grammar(picker: Picker) -> GrammarProcessor | None:
    """The request's grammar among its picker's processors; None without one."""
    return next((p for p in picker.processors if isinstance(p, GrammarProcessor)), None)
