"""Request-level adjustments of the next-token logits: the ``LogitsProcessor`` protocol.

A request's processors are built when it is submitted (``Engine.submit``: from its
``SamplingParams``, and a grammar's from its response format) and run, in list order, by its
``picker.Picker`` on every position whose token it picks: plain decode, the first token after
the prompt, and each row of a speculative verify pass, so every path draws from the same adjusted
distribution. Each processor sees the logits as the previous one left them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class LogitsProcessor(Protocol):
    """A request's stateful adjustment of its next-token logits (a penalty, a bias, a grammar mask)."""

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The next position's ``[V]`` float32 logits, given every token accepted so far, adjusted
        (a new array or ``logits`` modified in place); ``-inf`` marks a token that may not come next."""

    def accept(self, token: int) -> None:
        """``token`` was emitted: the state moves past it."""
