"""Request-level adjustments of the next-token logits: the ``LogitsProcessor`` protocol.

A request's processors are built when it is submitted (``Engine.submit_choices``, a set for
each choice: from its ``SamplingParams``, and a grammar's from its response format) and run, in
list order, by its ``picker.Picker`` on every position whose token it picks: plain decode, the
first token after the prompt, and each row of a speculative verify pass, so every path draws from
the same adjusted distribution. Each processor sees the logits as the previous one left them.

The processors of ``SamplingParams`` are here (``request_processors``: logit bias, repetition
penalty, frequency and presence penalties); they run before the sampler's warp, so temperature,
top-k, top-p and min-p see the penalised logits.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from flm_runtime.errors import InvalidRequestError
from flm_runtime.request import SamplingParams


class LogitsProcessor(Protocol):
    """A request's stateful adjustment of its next-token logits (a penalty, a bias, a grammar mask)."""

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The next position's ``[V]`` float32 logits, given every token accepted so far, adjusted
        (a new array or ``logits`` modified in place); ``-inf`` marks a token that may not come next."""

    def accept(self, token: int) -> None:
        """``token`` was emitted: the state moves past it."""


class LogitBias:
    """OpenAI's ``logit_bias``: a fixed value added to the logits of some tokens at every position.

    Args:
        bias: token id -> value (``SamplingParams.logit_bias``: ids < V, values in [-100, 100]).
    """

    def __init__(self, bias: Mapping[int, float]):
        self.ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))            # [B]
        self.values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))     # [B]

    def process(self, logits: np.ndarray) -> np.ndarray:
        logits[self.ids] += self.values
        return logits

    def accept(self, token: int) -> None:
        """Stateless."""


class RepetitionPenalty:
    """CTRL's repetition penalty (Keskar et al. 2019, arXiv:1909.05858), as Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``: the logit ``x`` of every token that occurs in the prompt
    or the output so far becomes ``x * penalty`` if ``x < 0``, else ``x / penalty`` (each token
    once, however often it occurred).

    Args:
        penalty: > 0; above 1 discourages repeating, below 1 encourages it.
        prompt_ids: ``[T]`` int the prompt's token ids.
    """

    def __init__(self, penalty: float, prompt_ids: np.ndarray):
        self.penalty = np.float32(penalty)
        self._seen = set(np.asarray(prompt_ids).tolist())
        self._ids: np.ndarray | None = None   # [S] the seen ids; None: rebuild (a new one came)

    def process(self, logits: np.ndarray) -> np.ndarray:
        if self._ids is None:
            self._ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        x = logits[self._ids]
        logits[self._ids] = np.where(x < 0, x * self.penalty, x / self.penalty)
        return logits

    def accept(self, token: int) -> None:
        if token not in self._seen:
            self._seen.add(token)
            self._ids = None


class FrequencyPresencePenalty:
    """OpenAI's presence and frequency penalties over the generated tokens: the logit of token
    ``j`` becomes ``x[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty``, with
    ``c[j]`` the times ``j`` was generated so far (the prompt does not count).

    Args:
        presence_penalty, frequency_penalty: in [-2, 2]; positive values discourage repeating.
    """

    def __init__(self, presence_penalty: float, frequency_penalty: float):
        self.presence = presence_penalty
        self.frequency = frequency_penalty
        self._counts: collections.Counter[int] = collections.Counter()

    def process(self, logits: np.ndarray) -> np.ndarray:
        if self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))      # [G]
            counts = np.fromiter(self._counts.values(), dtype=np.float64, count=len(self._counts))
            logits[ids] -= (counts * self.frequency + self.presence).astype(np.float32)
        return logits

    def accept(self, token: int) -> None:
        self._counts[token] += 1


def request_processors(params: SamplingParams, prompt_ids: np.ndarray, vocab_size: int) -> list[LogitsProcessor]:
    """The processors ``params`` asks for, in the order they apply: ``logit_bias``, then the
    repetition penalty, then the frequency and presence penalties (vLLM v1's order:
    ``vllm/v1/sample/sampler.py`` applies the bias among its logits processors, then
    ``apply_penalties``). A parameter at its neutral value adds none, so a request without them
    has no processor (and its picker copies no logits).

    Args:
        params: the request's sampling parameters (ranges already checked).
        prompt_ids: ``[T]`` int64 the prompt (the repetition penalty counts it).
        vocab_size: V, the model's vocabulary.

    Raises:
        InvalidRequestError: a ``logit_bias`` token id ``>= vocab_size`` (param ``logit_bias``).
    """
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        outside = sorted(t for t in params.logit_bias if t >= vocab_size)
        if outside:
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): "
                                      f"{outside[:5]}", param="logit_bias")
        out.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(params.repetition_penalty, prompt_ids))
    if params.presence_penalty or params.frequency_penalty:
        out.append(FrequencyPresencePenalty(params.presence_penalty, params.frequency_penalty))
    return out
