"""The scheduler: which sequences an engine runs, and what each step's forward pass does for each
(vLLM v1's ``Scheduler.schedule`` and ``update_from_output``; docs/design.md, "The KV pool").

It holds the engine's queue (``waiting``: the head sequence of each queued request, its choices in
its ``group``), its running set (``active``, oldest first) and their KV blocks in the engine's
pool, and moves each sequence's ``Status`` (``sequence.py``). No thread and no model: the engine
calls it with its lock held. One engine step:

1. ``admit``: queued requests, in arrival order, become running while slots are free for all
   their choices and their prompts' blocks fit (``admittable``: what the pool has available less
   a block per running sequence; the head of the queue is never overtaken); ``allocate`` gives
   each its caches.
2. ``schedule``: a ``StepPlan``. Each decoding sequence, oldest first, gets the blocks of its
   step's rows; when none is left the youngest running sequence is preempted (recompute: its
   blocks go back, it waits at the head of the queue), or the one asking, if it is the youngest.
   Then the prefilling sequences' next prompt chunks, within the step's token budget.
3. After the pass: ``prompt_written`` for each prompt chunk (at the prompt's end its full blocks
   are registered for prefix caching when ``prefix``, the sequence decodes, its choices fork);
   ``finish`` for each sequence that ended. Full blocks are also registered at preemption and end.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flm_runtime.kv_cache import BlockPool, BlockTable
from flm_runtime.scheduling import prefix_cache
from flm_runtime.scheduling.sequence import Sequence, Status


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class PromptChunk:
    """A prefilling sequence's rows in a step.

    Attributes:
        seq: the sequence.
        ids: ``[T]`` int64, ``seq.prefill_ids`` from its cache's length on.
        n_logits: 1 for the prompt's last chunk, whose last row's logits give the first token; 0
            before it, and for the last chunk of a sequence preempted after its first token
            (``Sequence.resumed``).
    """

    seq: Sequence
    ids: np.ndarray
    n_logits: int


@dataclass(frozen=True)
class StepPlan:
    """What one step runs (``Scheduler.schedule``).

    Attributes:
        prefill: the next prompt chunk of each prefilling sequence the budget takes, in admission
            order.
        decode: the decoding sequences, oldest first; each holds the blocks of its step's rows.
        preempted: the sequences preempted to make that room, in order (now ``WAITING``).
    """

    prefill: tuple[PromptChunk, ...]
    decode: tuple[Sequence, ...]
    preempted: tuple[Sequence, ...]


class Scheduler:
    """Admission, KV blocks, preemption and the plan of each step (module docstring).

    Args:
        pool: the engine's block pool, a fixed size.
        new_cache: an empty cache taking its blocks from ``pool``.
        max_active: sequences running at once at most.
        prefill_tokens: prompt tokens one step prefills at most, over all sequences.
        prefill_chunk: rows of one sequence one pass takes at most (the model's).
        decode_rows: the most rows a decoding sequence's step writes (1; a speculative block).
        prefix: prefix caching.
    """

    def __init__(self, pool: BlockPool, new_cache: Callable[[], BlockTable], *, max_active: int,
                 prefill_tokens: int, prefill_chunk: int, decode_rows: int, prefix: bool):
        self.pool = pool
        self.new_cache = new_cache
        self.max_active = max_active
        self.prefill_tokens = prefill_tokens
        self.chunk = min(prefill_tokens, prefill_chunk)
        self.decode_rows = decode_rows
        self.prefix = prefix
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []

    # ---- the queue --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request: ``seq``, ``WAITING``, with its choices in ``seq.followers``."""
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        """Some sequence waits or runs."""
        return bool(self.waiting or self.active)

    def queued(self) -> list[Sequence]:
        """Every waiting sequence (each choice of each queued request), in queue order."""
        return [s for head in self.waiting for s in head.group]

    def admittable(self) -> int:
        """How many queued requests, from the head of the queue, fit now: slots free for all their
        choices, and the blocks of their prompts (and of each further choice's copy of the last
        one) within what the pool has available, less a block for each running sequence."""
        available, active, fit = self.pool.available, len(self.active), 0
        for head in self.waiting:
            group = head.group
            need = self.pool.blocks_for(len(head.prefill_ids)) + len(group) - 1
            if active + len(group) > self.max_active or need > available - active:
                break
            available, active, fit = available - need, active + len(group), fit + 1
        return fit

    def admit(self) -> list[list[Sequence]]:
        """Move the ``admittable`` requests into the running set, in arrival order: each head
        ``PREFILLING``, its choices ``FOLLOWING``. Returns their groups, each to ``allocate``."""
        groups = [self.waiting.popleft().group for _ in range(self.admittable())]
        for group in groups:
            group[0].status = Status.PREFILLING
            for seq in group[1:]:
                seq.status = Status.FOLLOWING
            self.active += group
        return groups

    def allocate(self, group: list[Sequence]) -> list[Sequence]:
        """Caches for an admitted request: the head's, and where that cannot be copied
        (``BlockTable.copy`` None) each choice's, on its own and ``PREFILLING`` now. Each cache
        holds the blocks of its whole prompt, so that its prefill never waits for one: the
        registered blocks of its longest cached prefix, then new ones. Returns the sequences given
        a cache.

        Raises:
            what ``new_cache`` raises (a backend's fault), or ``KVPoolExhausted`` for a choice's
            own prompt blocks (``admittable`` counts a block per choice, a copy's): the caller
            ends the request.
        """
        head = group[0]
        self._allocate(head)
        if len(group) == 1 or head.cache.copy is not None:
            return [head]
        head.followers = []
        for seq in group[1:]:
            seq.leader, seq.status = None, Status.PREFILLING
            self._allocate(seq)
        return group

    def _allocate(self, seq: Sequence) -> None:
        seq.cache = self.new_cache()
        if self.prefix:
            blocks, cached = prefix_cache.take(self.pool, seq.prefill_ids)
            seq.cache.adopt(blocks, cached)
            if not seq.preemptions:
                seq.cached_tokens = cached
        seq.cache.reserve(len(seq.prefill_ids) - seq.cache.length)

    # ---- a step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """This step's plan: room for every decoding sequence's rows (preempting), then the prompt
        chunks (module docstring). ``FOLLOWING`` sequences have no part in it."""
        decoding = [s for s in self.active if s.status is Status.DECODING]
        preempted = []
        for seq in decoding:
            while seq.status is Status.DECODING:  # not preempted (for an older one, or itself)
                rows = min(self.decode_rows, seq.cache.max_length - seq.cache.length)
                if seq.cache.fits(rows):
                    seq.cache.reserve(rows)
                    break
                youngest = next(s for s in reversed(self.active) if s.status is not Status.FOLLOWING)
                self._preempt(youngest)
                preempted.append(youngest)
        return StepPlan(self._prompt_chunks(), tuple(s for s in decoding if s.status is Status.DECODING),
                        tuple(preempted))

    def _preempt(self, seq: Sequence) -> None:
        """``seq`` and its choices waiting for its prompt go back to the head of the queue: its
        full blocks stay registered for its return (prefix caching), the rest go back to the pool
        (``Sequence.preempt``)."""
        group = seq.group
        if self.prefix:
            prefix_cache.keep(seq.cache, seq.context_ids())
        seq.preempt().release()
        for s in group:
            self.active.remove(s)
        self.waiting.appendleft(seq)

    def _prompt_chunks(self) -> tuple[PromptChunk, ...]:
        """The next prompt chunk of each prefilling sequence, in admission order, each whose chunk
        fits in what the step's budget leaves (the first always runs). A sequence's chunks are
        always ``[k*C, (k+1)*C)`` past what its cache held when admitted (``C``: ``chunk``),
        whatever runs beside it, so its prefill does not depend on other requests."""
        chunks, budget = [], self.prefill_tokens
        for seq in self.active:
            if seq.status is not Status.PREFILLING:
                continue
            done = seq.cache.length
            ids = seq.prefill_ids[done : done + self.chunk]
            if chunks and len(ids) > budget:
                continue
            budget -= len(ids)
            last = done + len(ids) == len(seq.prefill_ids)
            chunks.append(PromptChunk(seq, ids, int(last and not seq.resumed)))
        return tuple(chunks)

    # ---- a step's outcome -------------------------------------------------------------------

    def prompt_written(self, seq: Sequence) -> list[Sequence]:
        """``seq``'s cache took a prompt chunk. Once it holds all of ``prefill_ids``: its full
        blocks are registered (prefix caching, for requests beside it), it is ``DECODING``, and
        its choices get copies of its cache (``Sequence.fork``); those with no block left for one
        go back to the head of the queue, to prefill the prompt themselves.

        Returns:
            the forked choices, ``DECODING``, each to take its first token from the logits
            ``seq`` takes its own from.
        """
        if seq.cache.length < len(seq.prefill_ids):
            return []
        if self.prefix:
            prefix_cache.keep(seq.cache, seq.prefill_ids)
        seq.status = Status.DECODING
        forked, alone = seq.fork()
        for choice in alone:
            self.active.remove(choice)
            self.waiting.appendleft(choice)
        return forked

    def finish(self, seq: Sequence, *, keep: bool) -> None:
        """Forget ``seq`` (whatever its status), ``FINISHED`` now. A head that ends before its
        prompt KV was shared hands its place, cache and choices on (``Sequence.pass_prefill``);
        otherwise its blocks go back to the pool, its full ones registered first when ``keep``
        (prefix caching: a request that ended between steps, or inside a speculative block's
        accepted tokens, whose rest its cache is trimmed of)."""
        queued = seq.status is Status.WAITING and seq.leader is None
        running = seq.status in (Status.FOLLOWING, Status.PREFILLING, Status.DECODING)
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
            seq.leader = None
        heir = seq.pass_prefill()
        if queued:
            if heir is None:
                self.waiting.remove(seq)
            else:
                self.waiting[self.waiting.index(seq)] = heir
        elif running:
            self.active.remove(seq)
            if heir is None and seq.cache is not None:
                if self.prefix and keep:
                    context = seq.context_ids()
                    seq.cache.trim(len(context))
                    prefix_cache.keep(seq.cache, context)
                seq.cache.release()
        seq.cache = None
        seq.status = Status.FINISHED
