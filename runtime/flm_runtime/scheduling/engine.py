"""The engine: a background thread that runs requests on one model and streams their tokens.

A caller ``submit``s prompt ids and ``SamplingParams`` (``submit_choices``: ``n`` choices, one
prefill) and gets a ``RequestHandle`` (``handle.py``) per choice; iteration, ``aiter()``,
``result()`` and ``aresult()`` consume the same ``StreamEvent``s, so streamed and non-streamed
outputs are the same. Each step is ONE batched forward pass (``_step``): prompt chunks within a
per-step token budget, and every decoding sequence's rows; what runs, and what a pass does to the
queue and the KV blocks, is the ``Scheduler``'s (``scheduler.py``). A ``Sequence`` holds all
per-request state, so a request's output depends only on its own inputs and seed
(docs/design.md, "Contract", item 6). Stats: ``stats()``; per request ``Completion.stats``.

Refused at submit: a full queue (``EngineOverloadedError``), a request that cannot fit in the KV
pool even alone (``KVBudgetError``), a draining engine (``EngineDrainingError``). A request whose
part of a step raises fails alone (``EngineFaultError``, chained; ``_pass``); a fault of no single
request fails every request. ``drain`` stops admitting and lets the running finish within a bound.
KV pool, admission, preemption, prefix caching, faults: docs/design.md, "The KV pool".

Decoding is plain, or through a ``Stepper`` (``step.py``; ``api`` passes the
``SpeculativeDecoder`` of ``flm_runtime.speculation.decoders``, a package this one never imports):
prepare -> one batched target pass -> complete. ``on_step`` hands each ``StepTiming`` to benchmarks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flm_runtime.errors import (BackendUnavailableError, EngineDrainingError, EngineFaultError, EngineOverloadedError,
                                FlmError, InvalidRequestError, RequestTimeoutError)
from flm_runtime.kv_cache import KVPool
from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.sampling.processors import LogitsProcessor, request_processors
from flm_runtime.scheduling import admission
from flm_runtime.scheduling.handle import RequestCancelledError, RequestHandle
from flm_runtime.scheduling.scheduler import Scheduler
from flm_runtime.scheduling.sequence import Sequence
from flm_runtime.scheduling.step import PLAIN, Stepper, StepRecord

log = logging.getLogger(__name__)

class _Part(NamedTuple):
    """One sequence's rows in a step's batched forward pass.

    Attributes:
        seq: the sequence.
        ids: ``[T]`` int64 token ids appended to its cache: a prompt chunk, or its decode rows
            (``record.rows``: ``[last_token]``, or a speculative step's ``[anchor, d1 .. dk]``).
        n_logits: trailing rows whose logits it needs (0: a prompt chunk before the last one).
        record: a decoding step's ``StepRecord`` (``PLAIN`` in an engine without a stepper); None
            for a prompt chunk.
    """

    seq: Sequence
    ids: np.ndarray
    n_logits: int
    record: StepRecord | None = None


@dataclass(frozen=True)
class StepTiming:
    """One engine step that ran a forward pass: seconds (``time.perf_counter``) of its phases.

    Attributes:
        propose_s: the decoding sequences' records and rows (with a stepper, its ``prepare``:
            catch-up and draft pass).
        forward_s: the batched target pass (verify rows, decode rows and prompt chunks).
        commit_s: what the sequences did with their rows (verify, roll back, sample, emit).
        total_s: the whole step, from the cancellation checks to the last commit.
        records: the ``StepRecord`` of each decoding sequence, in the pass's order (``PLAIN`` in
            an engine without a stepper); empty for a step of prompt chunks only.
    """

    propose_s: float
    forward_s: float
    commit_s: float
    total_s: float
    records: tuple[StepRecord, ...]


class Engine:
    """Runs requests on one model in a background daemon thread.

    Args:
        model: implements ``config`` (``max_position_embeddings``, ``vocab_size``),
            ``new_pool(positions)`` (a ``kv_cache.BlockPool``), ``new_cache(pool=) -> cache``
            (a ``kv_cache.BlockTable`` into the pool; ``cache.length``: tokens held),
            ``prefill_chunk`` (most rows of one sequence per pass), ``batch_invariant`` and
            ``forward_batch(rows, caches, taps=, logit_rows=)`` (``backends.TargetModel``; when it
            raises, every cache's length is as it was, whatever it wrote past it: ``_pass``).
        tokenizer: implements ``token_bytes(id) -> bytes``, ``stop_token_ids`` and
            ``special_token_ids``.
        name: the model's name (thread name, stats, messages).
        default_sampling: the model entry's default sampler, applied by ``sampling_params``;
            None -> ``sampler.FALLBACK_SAMPLING``.
        max_queue: requests waiting for admission at most; one more -> ``EngineOverloadedError``.
        max_active: sequences running at once; the others wait in the queue.
        kv_budget: bytes of the engine's KV pool (see ``admission``); None:
            ``admission.default_kv_budget`` (4 full contexts).
        speculative: decode with this ``Stepper`` (a ``SpeculativeDecoder``; its target must be
            ``model``);
            None decodes plainly.
        on_step: called on the engine thread after every step that ran a forward pass, with its
            ``StepTiming`` (benchmarks); an attribute, so it may be set later.
        prefill_tokens: prompt tokens one step prefills at most, over all sequences (chunked
            prefill; vLLM calls its analogue ``max_num_batched_tokens``): it bounds how long a
            step, so the gap between two tokens of a decoding stream, grows while prompts
            arrive. None: the model's ``prefill_chunk``.
        context_length: positions a sequence may take (prompt and completion), at most the model's
            ``max_position_embeddings`` (its RoPE tables end there); None: that. ``Runtime.get_engine``
            gives the tag's ``context_length``, as llama-server's ``-c``.
        prefix_cache: keep full blocks for later prompts with the same prefix (``prefix_cache``).
            Only where it changes no bit: plain decoding, on a model whose rows are
            ``batch_invariant`` (a cached prefix was computed with other rows beside it than a
            cold one) and whose pool stores the KV (a ``kv_cache.KVPool``).

    Raises:
        InvalidRequestError: ``max_queue``, ``max_active``, ``kv_budget``, ``prefill_tokens`` or
            ``context_length`` not a positive integer, or ``context_length`` over the model's.
    """

    def __init__(self, model, tokenizer, *, name: str, default_sampling: sampler.SamplingDefaults | None = None,
                 max_queue: int = 64, max_active: int = 64, kv_budget: int | None = None,
                 speculative: Stepper | None = None, prefill_tokens: int | None = None,
                 on_step: Callable[[StepTiming], None] | None = None, prefix_cache: bool = True,
                 context_length: int | None = None):
        assert speculative is None or speculative.target is model, "the decoder's target must be the model"
        self.model = model
        self.speculative = speculative
        self.tokenizer = tokenizer
        self.on_step = on_step
        self.name = name
        self.default_sampling = sampler.default_sampling(default_sampling)
        self.max_queue = admission.positive_int(max_queue, "max_queue")
        self.max_active = admission.positive_int(max_active, "max_active")
        self.prefill_tokens = admission.positive_int(
            model.prefill_chunk if prefill_tokens is None else prefill_tokens, "prefill_tokens")
        own = int(model.config.max_position_embeddings)
        self.context_length = (own if context_length is None
                               else admission.positive_int(context_length, "context_length"))
        if self.context_length > own:
            raise InvalidRequestError(f"context_length={context_length} is more than the model's {own} positions",
                                      param="context_length")
        draft = speculative.draft if speculative is not None else None
        draft_config = draft.config if draft is not None else None
        self.kv = admission.KVBudget(name, self.context_length,
                                     admission.kv_bytes_per_token(model.config, draft_config,
                                                                  np.dtype(model.kv_dtype).itemsize),
                                     speculative.block_size - 1 if speculative is not None else 0, kv_budget)
        self.pool = model.new_pool(self.kv.positions)
        self.block_bytes = self.pool.block_tokens * self.kv.bytes_per_token
        # A cached prefix has no draft context: prefix caching only where no draft runs.
        self.prefix = (prefix_cache and model.batch_invariant and (speculative is None or not speculative.taps)
                       and isinstance(self.pool, KVPool))
        self.scheduler = Scheduler(self.pool, lambda: model.new_cache(pool=self.pool), max_active=self.max_active,
                                   prefill_tokens=self.prefill_tokens, prefill_chunk=model.prefill_chunk,
                                   decode_rows=speculative.block_size if speculative is not None else 1,
                                   prefix=self.prefix)
        self._cv = threading.Condition()      # guards scheduler (its queue, sequences, pool), _counts, _closed
        self._counts = collections.Counter()
        self._closed = False
        self._stepping = False                # the engine thread is inside a step (``idle``)
        self._draining: float | None = None   # the drain's bound (s) once ``drain`` was called
        self._thread = threading.Thread(target=self._run, name=f"flm-engine-{name}", daemon=True)
        self._thread.start()

    # ---- caller side ------------------------------------------------------------------------

    def sampling_params(self, **given) -> SamplingParams:
        """``SamplingParams`` with this model's default sampler for the fields given as None."""
        return self.default_sampling.resolve(**given)

    def submit(self, prompt_ids, params: SamplingParams, *, timeout: float | None = None,
               processors: Iterable[LogitsProcessor] = ()) -> RequestHandle:
        """Queue a request: ``submit_choices`` with one choice (``processors``: its own logits
        processors, fresh), its handle."""
        given = list(processors)
        return self.submit_choices(prompt_ids, params, 1, timeout=timeout, processors=lambda: given)[0]

    def submit_choices(self, prompt_ids, params: SamplingParams, n: int, *, timeout: float | None = None,
                       processors: Callable[[], Iterable[LogitsProcessor]] = tuple) -> list[RequestHandle]:
        """Queue a request for ``n`` choices (OpenAI's ``n``): one prefill of the prompt, whose KV
        cache each choice then decodes on a copy of, all in the same batch.

        Choice ``i`` samples with ``params`` seeded ``sampler.choice_seed(params.seed, i)``, so it
        gives what a one-choice request with that seed gives (choice 0: ``params.seed`` itself).

        Args:
            prompt_ids: the rendered prompt's token ids (non-empty sequence of ints < vocab).
            params: sampling parameters; ``max_tokens`` None means up to the context length.
            n: choices, 1 to ``max_active``.
            timeout: seconds from now after which the engine cancels the request and its stream
                raises ``RequestTimeoutError``; None for no limit.
            processors: called once per choice, returns the logits processors the caller builds
                for that choice alone (its grammar, ``grammar.GrammarProcessor``), fresh: their
                state follows the choice's own tokens. They apply after those ``params`` asks for
                (``processors.request_processors``), to every position the choice picks.

        Returns:
            the choices' handles, in choice order; each can be consumed and cancelled alone.

        Raises:
            InvalidRequestError: empty or out-of-vocabulary prompt (param "messages"), a bad
                timeout (param "timeout"), params not a ``SamplingParams`` (param "params"), ``n``
                not an integer in 1 .. ``max_active`` (param "n"), a ``logit_bias`` id outside the
                vocabulary (param "logit_bias").
            ContextLengthError: prompt tokens + ``max_tokens`` over the context length.
            KVBudgetError: the ``n`` sequences' KV caches could outgrow ``kv_budget`` even alone.
            EngineOverloadedError: ``max_queue`` requests are already waiting.
            EngineDrainingError: the engine is draining (``drain``).
            BackendUnavailableError: the engine is closed.
        """
        prompt = self._check_prompt(prompt_ids)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}",
                                      param="params")
        n = admission.positive_int(n, "n")
        if n > self.max_active:
            raise InvalidRequestError(f"n={n} choices are more than engine {self.name!r} runs at once "
                                      f"(max_active={self.max_active})", param="n")
        budget = self.kv.generated_tokens(len(prompt), params.max_tokens, self.pool.block_tokens, n)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}",
                                      param="timeout")
        vocab = int(self.model.config.vocab_size)
        # Each choice has its own seed and its own processors (their state follows its own tokens):
        # those its params ask for (bias, penalties), then the caller's (a grammar's mask).
        choices = [dataclasses.replace(params, seed=sampler.choice_seed(params.seed, i)) for i in range(n)]
        seq, *followers = [Sequence(RequestHandle(timeout), prompt, p, budget, self.tokenizer,
                                    [*request_processors(p, prompt, vocab), *processors()]) for p in choices]
        seq.followers = followers
        for follower in followers:
            follower.leader = seq
        scheduler = self.scheduler
        with self._cv:
            if self._closed:
                raise BackendUnavailableError(f"engine {self.name!r} is closed")
            if self._draining is not None:
                raise EngineDrainingError(f"engine {self.name!r} is shutting down and takes no new request; "
                                          "retry on another deployment")
            # Only requests that must wait count: those the engine thread would admit at its next
            # step (free slots and KV blocks) fill no queue place, so a burst uses every free slot.
            backlog = len(scheduler.waiting) - scheduler.admittable()
            if backlog >= self.max_queue:
                raise EngineOverloadedError(
                    f"engine {self.name!r} is full: {backlog} requests waiting (max_queue="
                    f"{self.max_queue}), {len(scheduler.active)} running (max_active={self.max_active}), "
                    f"{self.pool.used} of {self.pool.n_blocks} KV blocks in use; retry later")
            scheduler.add(seq)
            self._cv.notify()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request queued; engine stats %s", json.dumps(self.stats()))
        return [s.handle for s in seq.group]

    def stats(self) -> dict:
        """Engine-wide counters, one consistent snapshot:

        - ``active``: sequences running; ``queued``: sequences waiting for admission (a request
          of ``n`` choices is ``n`` sequences);
        - ``kv_tokens``: KV positions the running sequences hold; ``kv_blocks``: the pool's
          blocks of ``kv_block_tokens`` positions, ``kv_blocks_used`` those sequences hold (a
          block shared by several counts once), ``kv_bytes`` their bytes (each block's share of
          the budget: ``kv_block_tokens * kv.bytes_per_token``); ``kv_budget_bytes``:
          ``kv.budget``. All 0 but the pool's size when nothing runs;
        - ``kv_cached_bytes``: the unreferenced blocks kept for their tokens (``prefix_cache``);
        - ``finished`` (ended with a finish reason), ``failed``, ``cancelled``, ``timed_out``:
          requests so far; ``preempted``: sequences preempted so far (each resumed later);
        - ``draining``: ``drain`` was called (``submit`` refuses).
        """
        with self._cv:
            active = self.scheduler.active
            return {"name": self.name, "active": len(active), "queued": len(self.scheduler.queued()),
                    "kv_tokens": sum(s.kv_tokens for s in active), "kv_block_tokens": self.pool.block_tokens,
                    "kv_blocks": self.pool.n_blocks, "kv_blocks_used": self.pool.used,
                    "kv_bytes": self.pool.used * self.block_bytes, "kv_budget_bytes": self.kv.budget,
                    "kv_cached_bytes": self.pool.cached * self.block_bytes,
                    **{k: self._counts[k] for k in ("finished", "failed", "cancelled", "timed_out", "preempted")},
                    "draining": self._draining is not None}

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread has nothing running or queued and has finished its last
        step: what follows a request's end on that thread (the step's ``on_step``, the suffix
        index taking the finished request) is done. Returns False if ``timeout`` (s) passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or not (self._stepping or self.scheduler.busy), timeout)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the engine thread back between steps for the block (re-entrant): the requests
        submitted inside all join its next step, as one batch (benchmarks, tests)."""
        with self._cv:
            yield

    def drain(self, timeout: float) -> bool:
        """Shut down gracefully: from now on ``submit`` refuses (``EngineDrainingError``); the
        requests already submitted, running or queued, go on for up to ``timeout`` seconds; then
        the engine closes (``close``): those left end with ``EngineDrainingError``, and every block
        of the KV pool is free, the prefix cache's too. Called again, it waits again.

        Returns:
            True when every request finished within ``timeout``.
        """
        with self._cv:
            if self._draining is None:
                self._draining = timeout
            running, queued = len(self.scheduler.active), len(self.scheduler.queued())
            log.info("engine %r draining: %d sequences running, %d queued; up to %s s", self.name, running, queued,
                     timeout)
            finished = self._cv.wait_for(lambda: not self.scheduler.busy, timeout)
        self.close()
        log.info("engine %r drained: %s; engine stats %s", self.name,
                 "every request finished" if finished else f"the bound of {timeout} s cut the requests left",
                 json.dumps(self.stats()))
        return finished

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread (waits up to ``timeout`` s for the current step); requests still
        waiting or running fail with ``BackendUnavailableError`` (``EngineDrainingError`` after
        ``drain``), and the KV pool's blocks are all free."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_prompt(self, prompt_ids) -> np.ndarray:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidRequestError("the prompt is empty: it must hold at least one token", param="messages")
        vocab = int(self.model.config.vocab_size)
        if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="messages")
        return ids.astype(np.int64)

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self.scheduler.busy):
                    self._cv.wait()
                if self._closed:
                    break
                self._drop_waiting()
                self._admit()
                self._stepping = True
            try:
                self._step()
            except Exception as e:               # noqa: BLE001 - an engine bug: fail, don't hang
                self._fail_all(self._fault(e, every=True))
            with self._cv:
                self._stepping = False
                self._cv.notify_all()  # ``idle`` waits for the step's end
        if self._draining is None:
            self._fail_all(BackendUnavailableError(f"engine {self.name!r} was closed"))
        else:
            self._fail_all(EngineDrainingError(f"engine {self.name!r} shut down before the request finished: "
                                               f"it drained for {self._draining} s"))
        with self._cv:
            self.pool.clear_cached()  # every block is free: nothing will take a cached prefix again

    def _drop_waiting(self) -> None:
        """Queued requests (each choice of them) cancelled or past their deadline leave the queue."""
        now = time.monotonic()
        for seq in self.scheduler.queued():
            self._abort_if_needed(seq, now)

    def _admit(self) -> None:
        """Admit the queued requests that fit (``Scheduler.admit``) and start them: their caches
        (``Scheduler.allocate``), then their stepper states. A request whose start raises fails
        alone."""
        for group in self.scheduler.admit():
            t_admit = time.perf_counter()
            for seq in group:
                seq.t_admit = seq.t_admit or t_admit  # a preempted sequence keeps its first admission
            try:
                for seq in self.scheduler.allocate(group):
                    self._start(seq)
            except Exception as e:       # noqa: BLE001 - one request's failure, not the engine's
                for seq in reversed(group):  # followers first: nothing is handed over
                    self._end(seq, error=self._fault(e))

    def _start(self, seq: Sequence) -> None:
        """A sequence given a cache gets its stepper state, which learns the tokens of the cached
        prefix the cache starts from (for the retrieval proposers)."""
        if self.speculative is None:
            return
        params = seq.params
        seq.spec = self.speculative.new_state(len(seq.prefill_ids), speculate=params.speculation,
                                              prediction=params.prediction)
        if seq.cache.length:
            self.speculative.add_prompt(seq.cache, seq.spec, seq.prefill_ids[: seq.cache.length], None)

    def _step(self) -> None:
        """Advance every active sequence with ONE batched forward pass: the scheduler's plan, the
        decoding sequences' records, the pass, then each sequence completes its step with its
        rows.

        Sequences still prefilling contribute their next prompt chunk, in admission order, while
        the step's ``prefill_tokens`` last (``Scheduler.schedule``); every decoding sequence
        contributes its decode rows: one row, or with a ``SpeculativeDecoder`` the verify rows of
        a drafted block (all drafting sequences share one draft pass) or the single plain row
        where its policy says a block does not pay. All rows share one matrix product per weight
        matrix; the LM head runs only on the rows that need logits. New requests join and
        finished or cancelled ones leave between steps. ``on_step`` then gets the step's timing.
        """
        t0 = time.perf_counter()
        now = time.monotonic()
        for seq in list(self.scheduler.active):
            self._abort_if_needed(seq, now)
        with self._cv:
            plan = self.scheduler.schedule()
            for seq in plan.preempted:
                self._counts["preempted"] += 1
                log.debug("preempted a sequence of %d tokens; engine stats %s", len(seq.prefill_ids),
                          json.dumps(self.stats()))
        t_propose = time.perf_counter()
        decode = self._decode_parts(list(plan.decode))
        t_forward = time.perf_counter()
        parts = [_Part(c.seq, c.ids, c.n_logits) for c in plan.prefill] + decode
        if not parts:
            return
        outputs = self._pass(parts)
        t_commit = time.perf_counter()
        for part, logits, taps in outputs:
            self._advance(part.seq, lambda p=part, lg=logits, tp=taps: self._complete(p, lg, tp))
        if self.on_step is not None:
            t_end = time.perf_counter()
            self.on_step(StepTiming(t_forward - t_propose, t_commit - t_forward, t_end - t_commit, t_end - t0,
                                    tuple(p.record for p in decode)))

    def _decode_parts(self, decoding: list[Sequence]) -> list[_Part]:
        """Each decoding sequence's rows, from its ``StepRecord``: with a stepper, from its
        ``prepare`` for all of them (if it raises, sequence by sequence, so that only the culprit
        fails, with ``_fault``'s error); without, ``PLAIN``."""
        spec = self.speculative
        if spec is None or not decoding:
            records = [PLAIN] * len(decoding)
        else:
            try:
                records = spec.prepare([s.lane() for s in decoding])
            except Exception as e:          # noqa: BLE001 - maybe one sequence's fault: isolate it
                if len(decoding) == 1:
                    self._end(decoding[0], error=self._fault(e))
                    return []
                return [p for s in decoding for p in self._decode_parts([s])]
        return [_Part(s, r.rows(s.last_token), len(r.ids) + 1, r) for s, r in zip(decoding, records)]

    def _pass(self, parts: list[_Part]) -> list[tuple[_Part, np.ndarray, np.ndarray | None]]:
        """One batched forward pass of ``parts``: each part with its logits ``[n_logits, V]`` and
        taps ``[T, n*E]`` (None without a decoder).

        Fault isolation: if the pass raises, the parts run again one at a time; a part that raises
        alone fails its sequence (``_fault``'s error; ``_end`` gives its blocks back and drops its
        draft state and processors), and the others go on with their rows' outputs alone, so each
        emits what it emits alone. If every part raises alone, the fault is not one request's: it
        propagates, and ``_run`` fails every request.

        What a pass that raised leaves behind: no cache's length has changed (``forward_batch``'s
        contract: the model commits the new positions last), so no later pass reads what it wrote;
        it may have written keys and values at positions past a cache's length, in the blocks
        reserved for them. Those blocks are the cache's own: a block shared between caches (a
        prefix-cache block, a forked choice's prompt) is full, every position of it below the
        length. The retry writes the same positions again, and a failed sequence's blocks go back
        to the pool unregistered, so nothing a raised pass wrote is ever read.
        """
        try:
            return self._forward(parts)
        except Exception as e:          # noqa: BLE001 - maybe one sequence's fault: isolate it
            if len(parts) == 1:
                self._end(parts[0].seq, error=self._fault(e))
                return []
            outputs, failed = [], []
            for part in parts:
                try:
                    outputs += self._forward([part])
                except Exception as alone:  # noqa: BLE001 - this sequence's fault
                    failed.append((part, alone))
            if len(failed) == len(parts):
                raise
            for part, alone in failed:
                self._end(part.seq, error=self._fault(alone))
            return outputs

    def _forward(self, parts: list[_Part]) -> list[tuple[_Part, np.ndarray, np.ndarray | None]]:
        """The model's pass over ``parts``, its outputs split by part (``_pass``)."""
        spec = self.speculative
        taps = spec.taps if spec is not None else ()
        logits, tapped = self.model.forward_batch([p.ids for p in parts], [p.seq.cache for p in parts], taps=taps,
                                                  logit_rows=[p.n_logits for p in parts])  # [sum n_logits, V], [R, n*E]
        logit_end, row_end = np.cumsum([p.n_logits for p in parts]), np.cumsum([len(p.ids) for p in parts])
        return [(p, logits[le - p.n_logits : le], tapped[re - len(p.ids) : re] if taps else None)
                for p, le, re in zip(parts, logit_end, row_end)]

    def _complete(self, part: _Part, logits: np.ndarray, taps: np.ndarray | None) -> None:
        """``part.seq`` completes its step with its rows' outputs: a decoding step through the
        stepper (verify and emit, or a plain step's token), or, without one, its token
        (``Lane.decode_plain``); a prompt chunk's taps go to the draft, the scheduler takes the
        chunk (``Scheduler.prompt_written``), and the last chunk's logits give the first token, of
        each choice of the request it forked."""
        seq, spec = part.seq, self.speculative
        if part.record is not None:
            if spec is not None:
                spec.complete(seq.lane(), part.record, logits, taps)
            else:
                seq.lane().decode_plain(logits[0])
            return
        if spec is not None:
            spec.add_prompt(seq.cache, seq.spec, part.ids, taps)
        with self._cv:
            forked = self.scheduler.prompt_written(seq)
        if part.n_logits:
            for choice in forked:
                self._advance(choice, lambda c=choice: c.lane().decode_plain(logits[0]))
            seq.lane().decode_plain(logits[0])

    def _advance(self, seq: Sequence, step) -> None:
        """Run ``step()`` for ``seq``; retire it when it finished, fail it alone when it raised
        (``_fault``'s error)."""
        try:
            step()
            if seq.final is not None:
                self._end(seq)
        except Exception as e:           # noqa: BLE001 - fail this request, keep serving others
            self._end(seq, error=self._fault(e))

    def _abort_if_needed(self, seq: Sequence, now: float) -> bool:
        """End ``seq`` if its caller cancelled it or its deadline passed; True if it ended."""
        handle = seq.handle
        if handle.cancel_requested:
            self._end(seq, error=RequestCancelledError("the request was cancelled"), count="cancelled")
        elif handle.deadline is not None and now >= handle.deadline:
            error = RequestTimeoutError(f"the request ran past its timeout of {handle.timeout} s")
            self._end(seq, error=error, count="timed_out")
        else:
            return False
        return True

    def _end(self, seq: Sequence, *, error: BaseException | None = None, count: str = "failed") -> None:
        """Forget ``seq`` and free its cache, then tell its caller. Under the lock, so that a
        caller who sees the end of its stream also sees it gone from ``stats()``.

        Logs ``request <outcome>; engine stats {...}`` (the ``stats()`` JSON after it) at INFO, as
        ``submit`` logs ``request queued; ...`` at DEBUG: the way to watch an engine that runs in
        another process, such as a LiteLLM proxy's.
        """
        with self._cv:
            self.scheduler.finish(seq, keep=error is None or count in ("cancelled", "timed_out"))
            if error is None:
                done = seq.completion()       # before freeing seq.spec: it holds the spec stats
                seq.handle.end(dataclasses.replace(seq.final, stats=done.stats), done, None)
                self._counts["finished"] += 1
            else:
                seq.handle.end(None, None, error)
                self._counts[count] += 1
            seq.spec = None
            self._cv.notify_all()  # ``drain`` waits for the last one
            if log.isEnabledFor(logging.INFO):
                log.info("request %s; engine stats %s", "finished" if error is None else count,
                         json.dumps(self.stats()))
        if error is None and self.speculative is not None:  # after the caller was told: it need not wait
            self.speculative.finish(seq.prompt_ids, np.asarray(seq.generated_ids, dtype=np.int64))

    def _fault(self, error: Exception, every: bool = False) -> FlmError:
        """The error a request the engine failed on ends with: a typed one as it is; anything else
        (a kernel's error, a bug) as an ``EngineFaultError`` naming it, chained to it. ``every``:
        the fault was not one request's (``_pass``), so every request ends with it."""
        if isinstance(error, FlmError):
            return error
        what = f"{type(error).__name__}: {error}"
        fault = EngineFaultError(
            f"engine {self.name!r} failed in a step, on no single request of it, and ends every request ({what})"
            if every else f"engine {self.name!r} failed on this request ({what}); it goes on serving the others")
        fault.__cause__ = error
        return fault

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            for seq in self.scheduler.queued() + list(self.scheduler.active):
                self._end(seq, error=error)
