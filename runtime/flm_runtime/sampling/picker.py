"""``Picker``: a request's one way to turn a position's logits into its token.

Plain decoding (``scheduling.step.Lane.decode_plain``), the first token after the prompt and the speculative
verifier (``speculative.verify``) all pick through the request's ``Picker``: its processors
(``processors.LogitsProcessor``, in order), then ``sampler``'s warp and draw with the request's
own RNG. The verifier picks row ``j`` of a verify pass after accepting the ``j`` tokens kept
before it, so each emitted token comes from the distribution plain decoding would have used there,
and its log-probability (``SamplingParams.logprobs``) is computed from that same distribution.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np

from flm_runtime.request import SamplingParams, TokenLogprob
from flm_runtime.sampling import sampler
from flm_runtime.sampling.processors import LogitsProcessor


class Picker:
    """Picks one request's tokens.

    Args:
        params: the request's sampling parameters.
        rng: the request's own generator (``sampler.new_rng``); greedy consumes nothing from it,
            a sampled token exactly one ``rng.random()``.
        processors: the request's logits processors, applied in order; empty: the logits go to
            the sampler as they are (no copy).

    Contract: every emitted token is ``accept``ed exactly once, in order, after its ``pick`` and
    before the next position's ``pick``; every ``pick`` is of a token that is then emitted (the
    verifier picks only the rows whose token it keeps).

    With ``params.logprobs``, each ``pick`` records the token's ``TokenLogprob``
    (``sampler.sample_with_logprob``) until ``pop_logprobs`` hands it on with its delivery.
    """

    def __init__(self, params: SamplingParams, rng: np.random.Generator, processors: Iterable[LogitsProcessor] = ()):
        self.params = params
        self.rng = rng
        self.processors = tuple(processors)
        self._logprobs: collections.deque[TokenLogprob] = collections.deque()  # picked, not yet delivered

    def pick(self, logits: np.ndarray) -> int:
        """The token of one position.

        Args:
            logits: ``[V]`` float32 target logits of the position; left unchanged.

        Returns:
            the token id: the processors' adjusted logits, warped and drawn (``sampler.sample``).
        """
        assert logits.ndim == 1, f"pick takes one row [V], got shape {logits.shape}"
        if self.processors:
            logits = np.array(logits, dtype=np.float32)  # ours to adjust in place: the pass's row stays as it was
            for processor in self.processors:
                logits = processor.process(logits)
        if not self.params.logprobs:
            return sampler.sample(logits, self.params, self.rng)
        token, record = sampler.sample_with_logprob(logits, self.params, self.rng, self.params.top_logprobs)
        self._logprobs.append(record)
        return token

    def accept(self, token: int) -> None:
        """``token`` is emitted: every processor's state moves past it."""
        for processor in self.processors:
            processor.accept(token)

    def pop_logprobs(self, token_ids: Sequence[int]) -> tuple[TokenLogprob, ...] | None:
        """The records of the next ``len(token_ids)`` picked tokens, which are being delivered
        (delivered tokens are always the first of those picked, in order: ``stop.py``); None
        without ``params.logprobs``."""
        if not self.params.logprobs:
            return None
        records = tuple(self._logprobs.popleft() for _ in token_ids)
        assert [r.token_id for r in records] == list(token_ids), "logprobs out of step with the delivered tokens"
        return records

    def pick_and_accept(self, logits: np.ndarray) -> int:
        """``pick`` then ``accept``: the token of a position that is kept, whatever it is."""
        token = self.pick(logits)
        self.accept(token)
        return token
