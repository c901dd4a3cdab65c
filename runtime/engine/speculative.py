"""DFlash speculative decoding: the verifier (pure functions) and the speculative step.

DFlash: Jian Chen, Yesheng Liang, Zhijian Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036 (2026); the draft model is ``flm_runtime.models.dflash``.

One step (docs/dflash.md, "One speculative step"): the proposer drafts ``d1 .. dK`` (K = 7) from
the anchor; the target runs ``[anchor, d1 .. dK]`` at positions ``start .. start+K`` in one pass
(logits ``[K+1, V]`` and taps); the verifier keeps a prefix of the draft and adds one token of the
target's own; the target KV cache is rolled back (``trim``) past what was kept, and the verify
pass's taps of the kept positions become the draft's pending context.

Batching: the engine advances several sequences ("lanes") per step. ``SpeculativeDecoder.propose``
drafts for all drafting lanes in one draft pass; each lane then contributes its verify rows
``[anchor, d1 .. dk]``, or the single row ``[anchor]`` of a plain decode step when the speculation
policy (``policy.py``: a table of context buckets plus the request's own acceptance estimate) says
a block does not pay, to ONE target pass (``TargetModel.forward_batch``, shared with other
sequences' prefill chunks); ``finish`` then verifies and emits lane by lane. The policy's
confidence gate verifies only the first k <= K drafted tokens, those the draft is sure enough of
(k = 0: the step decodes plainly, "gated"). Plain steps still record taps, so the draft can resume
at any step.

Glossary (after vLLM's rejection sampler, ``vllm/v1/sample/rejection_sampler.py``):

- **drafted** tokens: the K tokens the proposer offers each step;
- **accepted** tokens: drafted tokens the verifier keeps (a prefix of the draft);
- **recovered** token: the target's token at the first rejected position;
- **bonus** token: the target's token after all K were accepted. This module calls the one target
  token of every step (recovered or bonus) the *bonus*, as docs/dflash.md does;
- **AL**, acceptance length: tokens kept per step *including the bonus* (1 <= AL <= K + 1);
  acceptance rate would be accepted / drafted, without it.

Losslessness: greedy keeps the longest prefix that equals the target's argmax, so the output is
the target's greedy output. Sampled decoding uses the rule for a one-hot (argmax) draft: at each
position draw ``t ~ p'`` (the target's warped distribution, ``sampler.warp``, the baseline's) with
the request's own RNG, accept while ``t`` equals the drafted token, emit ``t`` at the first
mismatch. Each emitted token is then distributed exactly as ``p'`` of its position: this is
speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318)
with ``draft_probs`` one-hot, where accepting ``d`` with ``min(1, target_probs(d) / 1)`` and
resampling from the normalized ``max(0, target_probs - one_hot(d))`` is the same as drawing from
``target_probs`` and comparing. One draw per emitted token, in order, as plain decoding does, so a
seeded request gives the same tokens with or without speculation (up to float rounding of logits).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from flm_runtime.backends import prefill_chunks
from flm_runtime.core import KVCache, Proposal
from flm_runtime.engine import sampler
from flm_runtime.engine.policy import AcceptanceTracker, Bucket, PolicyTable, confident_length
from flm_runtime.engine.request import SamplingParams, SpecStats

# Pending taps of plain steps are folded into the draft cache once this many accumulate (while
# the policy keeps a request decoding plainly), so that each step copies a bounded array.
PENDING_FLUSH = 64

# Without a policy table: speculate everywhere, verifying every drafted token.
_NO_POLICY = Bucket(max_context=1, speculate=True)

# proposer(draft_cache, anchor_id, start) -> [K] int64 drafted ids: a stand-in for the draft's
# proposals (tests replay known tokens to force long acceptances).
Proposer = Callable[[KVCache, int, int], np.ndarray]


def verify_greedy(draft_ids: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy verifier: the longest drafted prefix equal to the target's argmax, plus the bonus.

    Args:
        draft_ids: ``[K]`` int drafted tokens ``d1 .. dK``.
        target_logits: ``[K+1, V]`` float target logits of the verify pass; row ``j`` predicts
            the token after block position ``j`` (row 0 follows the anchor).
    Returns:
        ``(n_accepted, bonus_token)``: ``d1 .. d_n`` are kept, then ``bonus = argmax(row n)``
        (lowest id on ties, as ``np.argmax`` and the baseline sampler).
    """
    k = draft_ids.shape[0]
    assert target_logits.shape[0] == k + 1, f"target_logits {target_logits.shape} != [K+1={k + 1}, V]"
    target_ids = np.argmax(target_logits, axis=-1)  # [K+1]
    mismatch = np.flatnonzero(np.asarray(draft_ids) != target_ids[:k])
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(target_ids[n])


def verify_sampled(draft_ids: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Lossless verifier for a one-hot (argmax) draft (see the module docstring).

    For ``j = 0, 1, ..``: draw ``t ~ warp(row j)`` (``sampler.sample``, which equals
    ``sample_from_probs(warp(row), rng.random())``); if ``j < K`` and ``t == d(j+1)`` accept and
    go on, else stop with ``t`` (recovered at a mismatch, bonus after all K accepted).

    Args:
        draft_ids: ``[K]`` int drafted tokens.
        target_logits: ``[K+1, V]`` float target logits of the verify pass.
        params: the request's sampling parameters (the baseline's warp).
        rng: the request's own generator; consumes one ``rng.random()`` per emitted token
            (none when greedy).
    Returns:
        ``(n_accepted, token)``: ``d1 .. d_n`` are kept, then ``token``.
    """
    k = draft_ids.shape[0]
    assert target_logits.shape[0] == k + 1, f"target_logits {target_logits.shape} != [K+1={k + 1}, V]"
    for j in range(k + 1):
        t = sampler.sample(target_logits[j], params, rng)
        if j == k or t != int(draft_ids[j]):
            return j, t
    raise AssertionError("unreachable")


def verify(draft_ids: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
           rng: np.random.Generator) -> tuple[int, int]:
    """``verify_greedy`` for greedy requests, else ``verify_sampled``."""
    if params.greedy:
        return verify_greedy(draft_ids, target_logits)
    return verify_sampled(draft_ids, target_logits, params, rng)


@dataclass
class SpecState:
    """One sequence's speculative state.

    Invariant (docs/dflash.md): ``draft_cache.length + len(pending) == start``, the anchor's
    position (= the target cache's length between steps).

    Attributes:
        draft_cache: the draft's context K/V.
        pending: ``[P, n*E]`` float32 taps of committed tokens not yet in ``draft_cache``.
        tracker: the request's acceptance estimate and speculate / plain decision (policy.py).
        stats: the request's speculation counters.
        gated_step: the current step is such a step (set by ``propose``, read by ``finish``).
        confidence: ``[K]`` float32, the draft's confidence in the tokens it proposed last (before
            the gate; ``Proposal.confidence``).
    """

    draft_cache: KVCache
    pending: np.ndarray
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    stats: SpecStats = field(default_factory=SpecStats)
    gated_step: bool = False
    confidence: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))

    def report(self) -> SpecStats:
        """The counters with the tracker's figures (``switches_off``, ``al_estimate``), a copy."""
        return dataclasses.replace(self.stats, switches_off=self.tracker.switches, al_estimate=self.tracker.al)


class LaneOutput(NamedTuple):
    """One lane's rows of a (batched) target pass.

    Attributes:
        draft_ids: ``[k]`` int64 drafted tokens to verify (k = 0: a plain decode step).
        logits: ``[k+1, V]`` float32 target logits of ``[anchor, d1 .. dk]``.
        taps: ``[k+1, n*E]`` float32 taps of the same rows.
    """

    draft_ids: np.ndarray
    logits: np.ndarray
    taps: np.ndarray


@dataclass
class Lane:
    """One sequence's part of a (batched) decoding step.

    Attributes:
        anchor_id: the last committed token (not yet in ``cache``).
        cache: the target's KV cache of the sequence.
        state: the sequence's ``SpecState``.
        params, rng: the request's sampling parameters and own generator.
        emit: pushes one token through the sequence's output pipeline (stop checks, delivery) and
            returns True once the sequence is finished; tokens after that are not pushed.
    """

    anchor_id: int
    cache: KVCache
    state: SpecState
    params: SamplingParams
    rng: np.random.Generator
    emit: Callable[[int], bool]


class SpeculativeDecoder:
    """Drives a target and a DFlash draft through prefill and (batched) decoding steps.

    Args:
        target: a ``TargetModel``: ``forward_batch(rows, caches, taps=)``, ``prefill_chunk``,
            ``config``.
        draft: ``DFlashDraft``-like: ``config`` (``target_layer_ids``, ``block_size``),
            ``new_cache``, ``add_context``, ``propose_batch``.
        policy: the speculation policy table of this tag and backend; None speculates at every
            context with the whole block (K = block_size - 1) and never switches off.
        proposer: replaces the draft's proposals (tests), called per sequence as
            ``proposer(draft_cache, anchor_id, start)``; the draft still keeps its context cache.
    """

    def __init__(self, target, draft, *, policy: PolicyTable | None = None, proposer: Proposer | None = None):
        self.target = target
        self.draft = draft
        self.taps = tuple(draft.config.target_layer_ids)
        self.block_size = int(draft.config.block_size)
        self.policy = policy
        self.proposer = proposer
        self._tap_width = len(self.taps) * int(target.config.hidden_size)

    def new_state(self, capacity: int = 0) -> SpecState:
        """Fresh state for one sequence (``capacity``: a hint in tokens)."""
        return SpecState(self.draft.new_cache(capacity), self._no_taps())

    def prefill(self, prompt_ids: np.ndarray, cache: KVCache, state: SpecState) -> np.ndarray:
        """Chunked target prefill whose taps go into the draft cache chunk by chunk.

        Returns:
            ``[V]`` float32 logits of the last prompt position.
        """
        assert cache.length == state.draft_cache.length == 0 and len(state.pending) == 0
        for out in prefill_chunks(self.target, prompt_ids, cache, taps=self.taps):
            self.add_prompt(cache, state, out.taps)
        return out.logits[0]

    def add_prompt(self, cache: KVCache, state: SpecState, taps: np.ndarray) -> None:
        """A prompt chunk the target ``cache`` now holds: its taps ``[T, n*E]`` go into the draft
        cache (its context K/V), which restores the invariant."""
        assert len(state.pending) == 0, "a prompt chunk after decoding started"
        self.draft.add_context(state.draft_cache, taps, state.draft_cache.length)
        self._check(cache, state)

    def draft_length(self, lane: Lane) -> int:
        """K for ``lane``'s next step: the policy's (bucket of its context, its own acceptance);
        0 means a plain decode step, as near the context end where a whole block (the draft
        always runs all ``block_size`` positions) does not fit."""
        cache = lane.cache
        if cache.length + self.block_size > cache.max_length:
            return 0
        if self.policy is None:
            return self.block_size - 1
        return min(lane.state.tracker.draft_length(self.policy.bucket(cache.length)), self.block_size - 1)

    def step(self, lane: Lane) -> bool:
        """One decoding step of one lane (``propose``, a target pass of its rows, ``finish``);
        True if it finished the sequence."""
        draft_ids = self.propose([lane])[0]
        out = self.target.forward_batch([self.rows(lane, draft_ids)], [lane.cache], taps=self.taps)
        return self.finish(lane, LaneOutput(draft_ids, out.logits, out.taps))

    def propose(self, lanes: list[Lane]) -> list[np.ndarray]:
        """The draft side of one decoding step of every lane: one batched draft pass.

        Per lane, from ``anchor_id`` at position ``start = cache.length``: with ``K =
        draft_length(lane) > 0`` the draft catches up on the pending taps and proposes
        ``d1 .. dK``, of which the lane keeps the first ``k = confident_length(confidence,
        min_confidence)`` (the bucket's gate; k = 0 makes the step a gated plain step); ``K = 0``
        is a plain decode step. The caller runs ``rows(lane, d)`` of every lane through the
        target (with ``taps=self.taps``) and ``finish``es each lane.

        Returns:
            per lane, its drafted ids to verify ``[k]`` int64. Whatever follows, every lane's invariant
            holds (the catch-up only moved taps from pending into the draft cache): a target pass
            that raises may be retried.
        """
        for lane in lanes:
            self._check(lane.cache, lane.state)
        ks = [self.draft_length(lane) for lane in lanes]
        drafting = [lane for lane, k in zip(lanes, ks) if k]
        for lane in drafting:
            state = lane.state
            self.draft.add_context(state.draft_cache, state.pending, state.draft_cache.length)
            state.pending = self._no_taps()
        proposal = self._propose([lane.state.draft_cache for lane in drafting],
                                 [lane.anchor_id for lane in drafting], max(ks)) if drafting else None  # [S, max K]
        rows = iter(range(len(drafting)))  # the proposal's row of each drafting lane, in order
        drafts = []
        for lane, k in zip(lanes, ks):
            ids = np.zeros(0, dtype=np.int64)
            if k:
                row = next(rows)
                lane.state.confidence = proposal.confidence[row, :k]
                ids = proposal.ids[row, : confident_length(lane.state.confidence,
                                                            self._bucket(lane.cache.length).min_confidence)]
            lane.state.gated_step = bool(k) and not len(ids)
            drafts.append(ids)
        return drafts

    @staticmethod
    def rows(lane: Lane, draft_ids: np.ndarray) -> np.ndarray:
        """The lane's target rows ``[K+1]`` int64: ``[anchor, d1 .. dK]`` (K = 0: the plain decode row)."""
        return np.concatenate([[lane.anchor_id], draft_ids]).astype(np.int64)

    def finish(self, lane: Lane, output: LaneOutput) -> bool:
        """Complete one lane's step from its rows of the target pass: verify (or sample the
        plain step's token), roll the cache back past what was kept, make the kept positions'
        taps pending, update the stats and the acceptance tracker, and emit the kept tokens one
        by one through ``lane.emit``.

        Returns:
            True if ``emit`` finished the sequence.
        """
        draft_ids, logits, taps = output
        cache, state = lane.cache, lane.state
        start = cache.length - len(logits)
        if not len(draft_ids):  # a plain decode step
            state.pending = np.concatenate([state.pending, taps])
            if len(state.pending) >= PENDING_FLUSH:  # bounded: no copy that grows with the output
                self.draft.add_context(state.draft_cache, state.pending, state.draft_cache.length)
                state.pending = self._no_taps()
            state.stats.record_plain(state.gated_step)
            if state.gated_step:  # speculating, but the gate verified nothing: a 1-token step
                state.tracker.record_step(self._bucket(start), 1)
            elif self.policy is not None:
                state.tracker.record_plain()
            self._check(cache, state)
            return lane.emit(sampler.sample(logits[0], lane.params, lane.rng))
        n_accepted, bonus = verify(draft_ids, logits, lane.params, lane.rng)
        cache.trim(start + n_accepted + 1)  # roll back the rejected positions
        state.pending = taps[: n_accepted + 1]
        if self.policy is not None:
            state.tracker.record_step(self._bucket(start), n_accepted + 1)
        self._check(cache, state)
        emitted, finished = 0, False
        for token in [*draft_ids[:n_accepted].tolist(), bonus]:
            emitted += 1
            if finished := lane.emit(int(token)):
                break
        state.stats.record_step(len(draft_ids), min(emitted, n_accepted), emitted)
        return finished

    def _propose(self, caches: list[KVCache], anchor_ids: list[int], n_drafts: int) -> Proposal:
        """The first ``n_drafts`` drafted tokens of ``S`` sequences (``[S, n_drafts]``): one
        batched draft pass (``draft.propose_batch``, whose LM head runs on those rows only), or
        the stand-in ``proposer`` sequence by sequence (confidence 1: never gated)."""
        if self.proposer is None:
            out = self.draft.propose_batch(caches, anchor_ids, n_drafts)
        else:
            ids = np.stack([np.asarray(self.proposer(c, a, c.length), dtype=np.int64)[:n_drafts]
                            for c, a in zip(caches, anchor_ids)])
            out = Proposal(ids, np.ones(ids.shape, dtype=np.float32))
        assert out.ids.shape == out.confidence.shape == (len(caches), n_drafts), f"proposals {out.ids.shape}"
        return out

    def _bucket(self, context: int) -> Bucket:
        """The policy's bucket of ``context`` tokens; without a policy, whole blocks, no gate."""
        return self.policy.bucket(context) if self.policy is not None else _NO_POLICY

    def _no_taps(self) -> np.ndarray:
        return np.zeros((0, self._tap_width), dtype=np.float32)  # [0, n*E]

    @staticmethod
    def _check(cache: KVCache, state: SpecState) -> None:
        assert state.draft_cache.length + len(state.pending) == cache.length, (
            f"draft cache {state.draft_cache.length} + pending {len(state.pending)} != anchor position {cache.length}")
