"""DFlash speculative decoding: the verifier (pure functions) and the speculative step.

DFlash: Jian Chen, Yesheng Liang, Zhijian Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036 (2026); the draft model is ``flm_runtime.models.dflash``.

One step (docs/dflash.md, "One speculative step"): the proposer drafts ``d1 .. dK`` (K = 7) from
the anchor; the target runs ``[anchor, d1 .. dK]`` at positions ``start .. start+K`` in one pass
(logits ``[K+1, V]`` and taps); the verifier keeps a prefix of the draft and adds one token of the
target's own; the target KV cache is rolled back (``trim``) past what was kept, and the verify
pass's taps of the kept positions become the draft's pending context.

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
from dataclasses import dataclass

import numpy as np

from flm_runtime.engine import sampler
from flm_runtime.engine.kv_cache import KVCache
from flm_runtime.engine.request import SamplingParams

# proposer(draft_cache, anchor_id, start) -> [K] int64 drafted ids; the draft's own ``propose`` or
# a stand-in (tests replay known tokens to force long acceptances).
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
        steps: speculative steps run.
        drafted: tokens drafted (K per step).
        accepted: drafted tokens kept and pushed into the output pipeline.
        emitted: tokens pushed by speculative steps (accepted + one bonus per step; a step cut
            short by EOS / stop / max_tokens counts only the tokens pushed before the cut).
    """

    draft_cache: KVCache
    pending: np.ndarray
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def stats(self) -> dict:
        """Per-request speculation stats: ``spec_steps``, ``drafted_tokens``, ``accepted_tokens``
        and ``acceptance_length`` (tokens per step INCLUDING the bonus token; 0.0 before a step)."""
        return {"spec_steps": self.steps, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_length": self.emitted / self.steps if self.steps else 0.0}


class SpeculativeDecoder:
    """Drives a target and a DFlash draft through prefill, plain and speculative steps.

    Args:
        target: ``LlamaModel``-like: ``forward(ids, cache, all_logits=, taps=)``,
            ``prefill_chunks(ids, cache, taps=)``, ``new_cache``, ``config``.
        draft: ``DFlashDraft``-like: ``config`` (``target_layer_ids``, ``block_size``),
            ``new_cache``, ``add_context``, ``propose``.
        proposer: replaces ``draft.propose`` (tests); the draft still keeps its context cache.
    """

    def __init__(self, target, draft, *, proposer: Proposer | None = None):
        self.target = target
        self.draft = draft
        self.taps = tuple(draft.config.target_layer_ids)
        self.block_size = int(draft.config.block_size)
        self.proposer: Proposer = proposer or draft.propose
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
        for out in self.target.prefill_chunks(prompt_ids, cache, taps=self.taps):
            self.draft.add_context(state.draft_cache, out.taps, state.draft_cache.length)
        self._check(cache, state)
        return out.logits[0]

    def decode(self, token_id: int, cache: KVCache, state: SpecState) -> np.ndarray:
        """A plain 1-token target step that keeps the draft in sync (its taps become pending).

        Returns:
            ``[V]`` float32 logits of the new position.
        """
        self._check(cache, state)
        out = self.target.forward(np.array([token_id]), cache, taps=self.taps)
        state.pending = np.concatenate([state.pending, out.taps])
        return out.logits[0]

    def can_speculate(self, cache: KVCache) -> bool:
        """Whether a whole block fits in the context (else the caller decodes plainly)."""
        return cache.length + self.block_size <= cache.max_length

    def step(self, anchor_id: int, cache: KVCache, state: SpecState, params: SamplingParams,
             rng: np.random.Generator, emit: Callable[[int], bool]) -> bool:
        """One speculative step from ``anchor_id`` at position ``cache.length``.

        Args:
            anchor_id: the last committed token (not yet in ``cache``).
            cache: the target's KV cache of the sequence.
            state: the sequence's ``SpecState``.
            params, rng: the request's sampling parameters and own generator.
            emit: pushes one token through the sequence's output pipeline (stop checks,
                delivery) and returns True once the sequence is finished; tokens after that are
                not pushed.
        Returns:
            True if ``emit`` finished the sequence.
        """
        start = cache.length
        self._check(cache, state)
        assert self.can_speculate(cache), "no room for a block: decode plainly near the context end"
        self.draft.add_context(state.draft_cache, state.pending, state.draft_cache.length)
        state.pending = self._no_taps()
        draft_ids = np.asarray(self.proposer(state.draft_cache, anchor_id, start), dtype=np.int64)  # [K]
        assert draft_ids.shape == (self.block_size - 1,), f"proposer gave {draft_ids.shape}"
        block = np.concatenate([[anchor_id], draft_ids])  # [B]
        out = self.target.forward(block, cache, all_logits=True, taps=self.taps)  # [B, V], [B, n*E]
        n_accepted, bonus = verify(draft_ids, out.logits, params, rng)
        cache.trim(start + n_accepted + 1)  # roll back the rejected positions
        state.pending = out.taps[: n_accepted + 1]
        state.steps += 1
        state.drafted += len(draft_ids)
        self._check(cache, state)
        for j, token in enumerate([*draft_ids[:n_accepted].tolist(), bonus]):
            state.emitted += 1
            state.accepted += j < n_accepted
            if emit(int(token)):
                return True
        return False

    def _no_taps(self) -> np.ndarray:
        return np.zeros((0, self._tap_width), dtype=np.float32)  # [0, n*E]

    @staticmethod
    def _check(cache: KVCache, state: SpecState) -> None:
        assert state.draft_cache.length + len(state.pending) == cache.length, (
            f"draft cache {state.draft_cache.length} + pending {len(state.pending)} != anchor position {cache.length}")
