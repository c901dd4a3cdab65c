"""What a target step returns (``ForwardOutput``), what a proposer proposes (``Proposal``), and
the two readings of a proposal's confidence that the proposers and the speculation policy share
(``confident_length``, ``expected_accepted``). It imports nothing of ``flm_runtime``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ForwardOutput(NamedTuple):
    """What a target step returns (``TargetModel.forward_batch`` and the helpers over it in
    ``flm_runtime.backends``).

    Attributes:
        logits: float32 ``[N, V]`` of the rows the call asked logits for (or ``[V]`` of the one
            next position: ``prefill``, ``decode``).
        taps: ``[T, n_taps * E]`` float32, the tapped layers' outputs concatenated per position;
            None when no taps were asked.
    """

    logits: np.ndarray
    taps: np.ndarray | None


class Proposal(NamedTuple):
    """Drafted tokens of ``S`` sequences.

    Attributes:
        ids: ``[S, K]`` int64 target token ids ``d1 .. dK``.
        confidence: ``[S, K]`` float32, the draft's softmax probability of each drafted token (its
            top-1 probability over the draft vocabulary). The speculation policy reads it as an
            estimate of that token's acceptance (EAGLE-2: Li et al. 2024, arXiv:2406.16858, find
            draft confidence a good proxy of the acceptance rate, and so does
            ``benchmarks/draft_confidence.py`` for ours: docs/dflash.md, "Confidence").
    """

    ids: np.ndarray
    confidence: np.ndarray


def confident_length(confidence: np.ndarray, min_confidence: float) -> int | np.ndarray:
    """The leading drafted tokens whose cumulative confidence is at least ``min_confidence``.

    Args:
        confidence: ``[K]`` the draft's probability of each drafted token (``Proposal.confidence``),
            or ``[N, K]`` for N steps at once (calibration).
        min_confidence: the bucket's gate; 0 keeps all K.
    Returns:
        k in ``0 .. K``: verify ``d1 .. dk`` (0: a plain decode step); ``[N]`` int64 for N steps.
    """
    kept = np.count_nonzero(np.cumprod(confidence, axis=-1, dtype=np.float64) >= min_confidence, axis=-1)
    return int(kept) if np.ndim(confidence) == 1 else kept


def expected_accepted(confidence: np.ndarray) -> float:
    """The expected accepted tokens of a proposal whose tokens have these confidences (each the
    chance that the token is accepted once those before it were): the sum over ``i`` of the
    chance that the first ``i`` are all accepted, ``sum(cumprod(confidence))``.

    Args:
        confidence: ``[k]`` per-token confidence of the tokens a step would verify.
    Returns:
        0.0 to k (0.0 for k = 0).
    """
    return float(np.cumprod(confidence, dtype=np.float64).sum())
