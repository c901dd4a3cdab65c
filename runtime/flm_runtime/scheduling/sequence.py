"""``Sequence``: one admitted request inside the engine, with everything that is per request (prompt,
KV caches, picker (logits processors and RNG), stop checker, delivered text and tokens, timing,
speculation state and stats).

Each engine step gives it rows of one batched forward pass: its next prompt chunk until the prompt
is in the cache (the last chunk's logits give the first token), then decoding steps of its
``lane``: plain 1-token steps (``Lane.decode_plain``, with or without a ``SpeculativeDecoder``) or
speculative steps whose kept tokens go through ``accept`` one by one (so EOS, stop strings and
``max_tokens`` cut a block exactly); near the context end (no room for a block) decoding is plain.

The ``n`` choices of one request are ``n`` sequences: the first (the *leader*) prefills the prompt,
the others (its *followers*) wait, and when the prompt is in the leader's cache each follower takes
a copy of it (``fork``) and all ``n`` pick their first token from the same logits, each with its
own picker (processors and RNG). A leader that ends before that hands its cache to the next
follower (``pass_prefill``).

A sequence the engine preempts (its pool ran out of blocks) gives its cache back and waits to be
admitted again; then it prefills its context again, the prompt and the tokens it generated but the
last (``prefill_ids``), with no token picked at the end, and goes on decoding from ``last_token``
with its picker, stop checker and output as they were: it emits what it would have emitted.

Where a sequence stands is its ``status`` (``Status``); the scheduler (``scheduler.py``) moves it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

import numpy as np

from flm_runtime.request import Completion, RequestStats, SamplingParams, StreamEvent, TokenLogprob
from flm_runtime.sampling import sampler
from flm_runtime.sampling.picker import Picker
from flm_runtime.sampling.processors import LogitsProcessor
from flm_runtime.scheduling.handle import RequestHandle
from flm_runtime.scheduling.step import Lane, StepperState
from flm_runtime.text.detokenizer import Detokenizer
from flm_runtime.text.stop import StopChecker


class Status(enum.Enum):
    """Where a sequence stands; the scheduler moves it along
    ``WAITING -> PREFILLING -> DECODING -> FINISHED`` (a choice: ``WAITING -> FOLLOWING ->
    DECODING``).

    - ``WAITING``: in the queue, holding no cache (new, preempted, or a choice that found no block
      for its copy of the prompt); a queued request's choices wait with their leader.
    - ``FOLLOWING``: admitted, a choice waiting for its leader's prompt KV (``fork``); no part in a
      step, no cache.
    - ``PREFILLING``: admitted; its next step runs a chunk of ``prefill_ids``.
    - ``DECODING``: ``prefill_ids`` is in its cache; its steps decode from ``last_token``.
    - ``FINISHED``: ended (with its final event or an error); it holds no cache.
    """

    WAITING = "waiting"
    FOLLOWING = "following"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class Sequence:
    """One admitted request: its prompt, KV cache, picker, output pipeline and timing.

    Args:
        handle: where its events go.
        prompt_ids: ``[T]`` int64 prompt token ids.
        params: sampling parameters.
        budget: generated tokens at most (``max_tokens`` folded with the context length).
        tokenizer: for ``token_bytes`` and ``stop_token_ids``.
        processors: the request's logits processors, in the order they apply (``Picker``).
    """

    def __init__(self, handle: RequestHandle, prompt_ids: np.ndarray, params: SamplingParams,
                 budget: int, tokenizer, processors: Iterable[LogitsProcessor] = ()):
        self.handle = handle
        self.status = Status.WAITING
        self.prompt_ids = prompt_ids
        self.prefill_ids = prompt_ids         # what the cache must hold before decoding (preemption: more)
        self.preemptions = 0
        self.params = params
        self.budget = budget
        self.cache = None                      # allocated at admission
        self.spec: StepperState | None = None  # the stepper's state, allocated at admission
        self.picker = Picker(params, sampler.new_rng(params.seed), processors)
        stop_ids = frozenset(tokenizer.stop_token_ids)
        # Special tokens are markers, not text (as decode(skip_special_tokens=True)): delivered
        # and counted when generated, but they add no text.
        detok = Detokenizer(tokenizer.token_bytes, skip_ids=stop_ids | frozenset(tokenizer.special_token_ids))
        self.checker = StopChecker(detok, stop=params.stop, stop_token_ids=stop_ids, max_tokens=budget,
                                   ignore_eos=params.ignore_eos)
        self.last_token: int | None = None     # the token the next decode step feeds
        self.final: StreamEvent | None = None  # the last event, held until the engine retires us
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.generated_ids: list[int] = []    # every generated token, delivered or not (what the cache is fed)
        self.cached_tokens = 0                 # prompt tokens taken from the prefix cache, not computed
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs else None
        self.t_admit = self.t_first = self.t_last = None
        self.max_gap_s = 0.0                   # the longest time between two generated tokens
        self.leader: Sequence | None = None    # the sibling choice whose prompt KV this one waits for
        self.followers: list[Sequence] = []    # sibling choices waiting for this one's prompt KV

    @property
    def kv_tokens(self) -> int:
        return 0 if self.cache is None else int(self.cache.length)

    @property
    def resumed(self) -> bool:
        """Preempted after its first token: its prefill picks no token."""
        return self.last_token is not None

    def context_ids(self) -> np.ndarray:
        """The tokens its cache holds between steps: the prompt and the generated tokens fed
        back (all but ``last_token``), ``[cache.length]`` int64."""
        generated = np.asarray(self.generated_ids, dtype=np.int64)
        return np.concatenate([self.prompt_ids, generated])[: self.cache.length]

    def preempt(self):
        """Let go of the cache and the draft state, to prefill the context again when admitted
        (module docstring): ``WAITING``, as the choices waiting for its prompt. Returns the
        cache, whose blocks the caller gives back."""
        if self.status is Status.DECODING:
            self.prefill_ids = self.context_ids()
        cache, self.cache, self.spec = self.cache, None, None
        self.preemptions += 1
        for seq in self.group:
            seq.status = Status.WAITING
        return cache

    @property
    def group(self) -> list[Sequence]:
        """This sequence and the choices waiting for its prompt KV."""
        return [self, *self.followers]

    def fork(self) -> tuple[list[Sequence], list[Sequence]]:
        """The prompt is in this sequence's cache: each follower gets a copy of the cache (and of
        the draft's state) and stops waiting. Returns them, ``DECODING`` as this one, to take
        their first token, and the followers the pool had no block left for the copy of:
        ``WAITING`` on their own now, each to prefill the prompt itself."""
        followers, self.followers = self.followers, []
        forked, alone = [], []
        for seq in followers:
            seq.leader = None
            seq.cache = self.cache.copy()
            if seq.cache is None:
                seq.status = Status.WAITING
                alone.append(seq)
                continue
            seq.spec = self.spec.copy() if self.spec is not None else None
            seq.status = Status.DECODING
            forked.append(seq)
        return forked, alone

    def pass_prefill(self) -> Sequence | None:
        """This leader ends before its prompt KV was shared: the first follower takes over its
        status, cache, draft state and remaining followers (the prefill so far is the same for
        every choice). Returns the new leader, or None without followers."""
        if not self.followers:
            return None
        heir, *rest = self.followers
        heir.leader, heir.followers, self.followers = None, rest, []
        for seq in rest:
            seq.leader = heir
        heir.status, heir.cache, heir.spec = self.status, self.cache, self.spec
        return heir

    def lane(self) -> Lane:
        """This sequence's part of a (batched) decoding step (``Lane.decode_plain`` takes a
        plain token, ``emit`` is ``accept``)."""
        return Lane(self.last_token, self.cache, self.spec, self.picker, self.accept)

    def accept(self, token: int) -> bool:
        """Take one generated token: stop checks, then delivery. True once the sequence is
        finished (its final event waits in ``final``); a speculative step calls this for each
        token of an accepted block until it returns True."""
        assert self.final is None, "token accepted after the sequence finished"
        now = time.perf_counter()
        if self.t_last is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.t_last)
        self.t_last = now
        self.t_first = self.t_first or self.t_last
        self.last_token = token
        self.generated_ids.append(token)
        d = self.checker.push(token)
        if not (d.text or d.token_ids or d.finish_reason):
            return False
        self.text_parts.append(d.text)
        self.token_ids.extend(d.token_ids)
        logprobs = self.picker.pop_logprobs(d.token_ids)
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        event = StreamEvent(d.text, d.token_ids, d.finish_reason, len(self.prompt_ids), self.checker.delivered,
                            logprobs=logprobs)
        if d.finish_reason is None:
            self.handle.deliver(event)
        else:
            self.final = event
        return self.final is not None

    def completion(self) -> Completion:
        """The join of the delivered events, with per-request stats."""
        return Completion("".join(self.text_parts), tuple(self.token_ids), self.checker.finish_reason,
                          len(self.prompt_ids), self.checker.delivered, self.stats(),
                          None if self.logprobs is None else tuple(self.logprobs))

    def stats(self) -> RequestStats:
        t0 = self.handle.t_submit
        return RequestStats(
            prompt_tokens=len(self.prompt_ids), completion_tokens=self.checker.delivered,
            generated_tokens=self.checker.generated, queue_s=(self.t_admit - t0) if self.t_admit else None,
            ttft_s=(self.t_first - t0) if self.t_first else None,
            decode_s=(self.t_last - self.t_first) if self.t_first else 0.0, total_s=time.perf_counter() - t0,
            spec=self.spec.report() if self.spec is not None else None, cached_tokens=self.cached_tokens,
            max_gap_s=self.max_gap_s)
