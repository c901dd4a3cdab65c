"""Turning logits into tokens: the warp (temperature, top-k, top-p, min-p) and the draw.

Everything here is a pure function of its arguments, so the speculative verifier reuses it: DESIGN
§5 asks every emitted token to be distributed as the target's warped distribution ``p'``, and
``warp`` is that ``p'`` for one row or for the ``T`` rows of a verify pass (``[..., V]``).

Order of the filters (the one Hugging Face ``transformers`` uses in
``GenerationMixin._get_logits_processor``): temperature, then top-k, then top-p, then min-p; each
filter sees the distribution the previous one left (renormalized). vLLM v1 applies min-p *before*
top-k/top-p, so the two differ on requests that combine min-p with top-k or top-p; we follow HF.

Glossary: *greedy* = temperature 0 = argmax, ties broken towards the lowest token id (what
``np.argmax`` returns). A *draw* is one uniform number in [0, 1) taken from the request's own RNG;
a sampled token consumes exactly one draw and a greedy token none, so the same seed gives the same
tokens whether they come from plain decoding or from a verifier that draws one number per emitted
token in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flm_runtime.engine.request import SamplingParams


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The warped next-token distribution ``p'`` of each row.

    Args:
        logits: ``[..., V]`` float (any float dtype); ``-inf`` marks impossible tokens. Every row
            needs at least one finite value.
        params: the request's sampling parameters (temperature, top_k, top_p, min_p).

    Returns:
        ``[..., V]`` float64 probabilities, each row summing to 1; filtered-out tokens are exactly
        0. Greedy (temperature 0) gives the one-hot of the argmax (lowest id on ties).
    """
    logits = np.asarray(logits)
    if params.greedy:
        return _one_hot(np.argmax(logits, axis=-1), logits.shape[-1])
    z = logits.astype(np.float64) / params.temperature            # [..., V]
    if params.top_k and params.top_k < z.shape[-1]:
        z = _filter_top_k(z, params.top_k)
    if params.top_p < 1.0:
        z = _filter_top_p(z, params.top_p)
    if params.min_p > 0.0:
        z = _filter_min_p(z, params.min_p)
    return _softmax(z)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token for one position.

    Args:
        logits: ``[V]`` float logits of the position.
        params: the request's sampling parameters.
        rng: the request's own generator (see ``new_rng``); greedy consumes nothing from it,
            sampling consumes exactly one ``rng.random()``.

    Returns:
        the token id.
    """
    assert logits.ndim == 1, f"sample takes one row [V], got shape {logits.shape}"
    if params.greedy:
        return int(np.argmax(logits))
    return int(sample_from_probs(warp(logits, params), rng.random()))


def sample_from_probs(probs: np.ndarray, u) -> np.ndarray:
    """Inverse-CDF draw: the token ``i`` with ``cdf[i-1] <= u * total < cdf[i]``.

    Args:
        probs: ``[..., V]`` non-negative weights (``warp``'s output); need not sum exactly to 1.
        u: ``[...]`` uniform draws in [0, 1) (a float for a single row).

    Returns:
        ``[...]`` int64 token ids; a token of probability 0 is never returned.
    """
    cdf = np.cumsum(probs, axis=-1)                                 # [..., V]
    target = np.asarray(u, dtype=np.float64)[..., None] * cdf[..., -1:]   # [..., 1]
    idx = np.sum(cdf <= target, axis=-1)                            # [...] first index with cdf > target
    # u * total can round up to total; fall back to the last token that has mass.
    last = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last).astype(np.int64)


def new_rng(seed: int | None) -> np.random.Generator:
    """The request's own generator: PCG64 seeded with ``seed``; None draws entropy from the OS."""
    return np.random.Generator(np.random.PCG64(seed))


def _one_hot(ids: np.ndarray, vocab: int) -> np.ndarray:
    """``[...]`` int ids -> ``[..., V]`` float64 one-hot rows."""
    out = np.zeros(np.shape(ids) + (vocab,), dtype=np.float64)
    np.put_along_axis(out, np.asarray(ids)[..., None], 1.0, axis=-1)
    return out


def _softmax(z: np.ndarray) -> np.ndarray:
    """``[..., V]`` float64 scores (``-inf`` allowed) -> probabilities."""
    m = np.max(z, axis=-1, keepdims=True)
    assert np.all(np.isfinite(m)), "every row needs at least one finite logit"
    e = np.exp(z - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def _filter_top_k(z: np.ndarray, k: int) -> np.ndarray:
    """Keep the tokens scoring at least the k-th largest score (ties at the boundary all kept, as
    HF's ``TopKLogitsWarper`` does); the rest become ``-inf``."""
    kth = np.partition(z, z.shape[-1] - k, axis=-1)[..., -k, None]   # [..., 1]
    return np.where(z >= kth, z, -np.inf)


def _filter_top_p(z: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus (Holtzman et al. 2019): keep the smallest most-likely set whose mass reaches
    ``top_p``, i.e. each token whose more-likely predecessors hold less than ``top_p``; the top-1
    is always kept. Equal scores are ordered by token id (stable sort)."""
    order = np.argsort(-z, axis=-1, kind="stable")                  # [..., V] most likely first
    probs = np.take_along_axis(_softmax(z), order, axis=-1)         # [..., V] sorted
    before = np.cumsum(probs, axis=-1) - probs                      # [..., V] mass strictly before
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return np.where(keep, z, -np.inf)


def _filter_min_p(z: np.ndarray, min_p: float) -> np.ndarray:
    """Min-p (Nguyen et al. 2024): drop tokens whose probability is below ``min_p * p(top-1)``."""
    probs = _softmax(z)
    floor = min_p * np.max(probs, axis=-1, keepdims=True)           # [..., 1]
    return np.where(probs >= floor, z, -np.inf)


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's default sampler: the values a request's *unset* fields take.

    Applied field by field (as vLLM does with a model's ``generation_config.json``): a request
    that sets only ``temperature=0.7`` keeps this entry's top_k/top_p/min_p. An explicit
    ``temperature=0`` is greedy whatever the defaults say. The registry entry of a model may
    define its own; ``CARD_DEFAULT`` is used otherwise.
    """

    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95
    min_p: float = 0.0

    def resolve(self, **given) -> SamplingParams:
        """``SamplingParams`` from the request's fields; a field given as None (or absent) takes
        this default. Non-sampling fields (seed, max_tokens, stop, ignore_eos) pass through.

        Raises:
            InvalidRequestError: a value out of range (from ``SamplingParams``), naming it.
            TypeError: a field ``SamplingParams`` does not have.
        """
        fields = {k: v for k, v in given.items() if v is not None}
        for name in ("temperature", "top_k", "top_p", "min_p"):
            fields.setdefault(name, getattr(self, name))
        if "stop" in fields:
            stop = fields["stop"]
            fields["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        return SamplingParams(**fields)


# The card's "model's default sampler" (seed/benchmark-card.md: temperature 1.0, top_k 64,
# top_p 0.95): used for a request that sets no sampling field and a model entry that names none.
CARD_DEFAULT = SamplingDefaults(temperature=1.0, top_k=64, top_p=0.95, min_p=0.0)
GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def default_sampling(entry_default: SamplingDefaults | None = None) -> SamplingDefaults:
    """The defaults to apply: the model entry's own when it defines one, else ``CARD_DEFAULT``."""
    return entry_default if entry_default is not None else CARD_DEFAULT
