"""Turning logits into tokens: the warp (temperature, top-k, top-p, min-p), the draw, and the
drawn token's log-probabilities (``sample_with_logprob``).

The logits given here are already adjusted by the request's processors (penalties, bias, a
grammar mask: ``processors.py``, run by the request's ``picker.Picker``).

Everything here is a pure function of its arguments, so the speculative verifier reuses it:
lossless speculation (docs/design.md, "DFlash") asks every emitted token to be distributed as
the target's warped distribution ``p'``, and
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

from flm_runtime.request import SamplingParams, TokenLogprob


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
    rows = logits.reshape(-1, logits.shape[-1])                     # [R, V]
    out = np.zeros(rows.shape, dtype=np.float64)
    for r in range(rows.shape[0]):                                  # R is small (1, or a verify pass's T <= 16)
        ids, probs = _warp_sparse(rows[r], params)
        out[r, ids] = probs
    return out.reshape(logits.shape)


def _warp_sparse(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """``warp`` of one ``[V]`` row as (ids ``[C]`` ascending int64, probs ``[C]`` float64) of the
    tokens left with mass; works on those candidates only (a few dozen after top-k)."""
    # Top-k on the raw logits: dividing by T > 0 keeps their order, and then only the C
    # candidates are converted and exponentiated.
    ids = _top_k_candidates(logits, params.top_k)                   # [C] ascending token ids
    zc = logits[ids].astype(np.float64) / params.temperature        # [C]
    assert zc.size, "every row needs at least one finite logit"
    if params.top_p < 1.0:
        keep = _top_p_keep(_softmax(zc), params.top_p)
        ids, zc = ids[keep], zc[keep]
    if params.min_p > 0.0:
        # Min-p (Nguyen et al. 2024): drop tokens below min_p * p(top-1) of what is left.
        probs = _softmax(zc)
        keep = probs >= params.min_p * probs.max()
        ids, zc = ids[keep], zc[keep]
    return ids, _softmax(zc)


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
    return _draw(*_warp_sparse(logits, params), rng)


def sample_with_logprob(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
                        top_n: int) -> tuple[int, TokenLogprob]:
    """``sample``'s token (the same token, the same draws) with its log-probability.

    The log-probabilities are those of the distribution the token is drawn from, as OpenAI's
    and vLLM's "processed" logprobs: ``log p'`` of ``warp`` (temperature, top-k, top-p, min-p
    over these logits, which the request's processors already adjusted); a token the filters
    drop has ``-inf``. Greedy has no such distribution (it is one-hot), so greedy gives the
    log-softmax of the logits themselves (temperature 1, no filter).

    Args:
        logits: ``[V]`` float logits of the position.
        params, rng: as ``sample``.
        top_n: how many of the most likely tokens to list (``TokenLogprob.top``): by
            log-probability, then (among tokens of ``-inf``) by logit, then lowest id first.

    Returns:
        ``(token, TokenLogprob)``.
    """
    assert logits.ndim == 1, f"sample takes one row [V], got shape {logits.shape}"
    if params.greedy:
        token = int(np.argmax(logits))
        z = logits.astype(np.float64)
        logp = z - (z[token] + np.log(np.sum(np.exp(z - z[token]))))   # [V] log-softmax
        top = _top_ids(logp, top_n)
        return token, TokenLogprob(token, float(logp[token]), tuple(zip(top.tolist(), logp[top].tolist())))
    ids, probs = _warp_sparse(logits, params)
    token = _draw(ids, probs, rng)
    with np.errstate(divide="ignore"):   # a kept token can underflow to probability 0
        logp = np.log(probs)                                           # [C]
    best = _top_ids(logp, top_n)                                       # ids ascending: ties by id
    top = list(zip(ids[best].tolist(), logp[best].tolist()))
    if len(top) < top_n:  # fewer tokens kept than asked for: the others by logit, at -inf
        others = np.ones(logits.shape[0], dtype=bool)
        others[ids] = False
        pool = np.flatnonzero(others)
        top += [(t, -np.inf) for t in pool[_top_ids(logits[pool], top_n - len(top))].tolist()]
    return token, TokenLogprob(token, float(logp[np.searchsorted(ids, token)]), tuple(top))


def _draw(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from ``warp``'s sparse row (``_warp_sparse``): the same token as
    ``sample_from_probs(warp(logits), u)``, as the zeros ``warp`` adds change no cdf value."""
    return int(ids[sample_from_probs(probs, rng.random())])


def _top_ids(scores: np.ndarray, n: int) -> np.ndarray:
    """Indexes of the ``n`` highest of ``scores`` ``[C]`` (all of them when ``n >= C``), highest
    first, the lowest index first among equals."""
    n = min(n, scores.size)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(scores, scores.size - n)[scores.size - n]
    ids = np.flatnonzero(scores >= kth)
    return ids[np.lexsort((ids, -scores[ids]))][:n]


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


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request of ``n`` > 1 choices seeded ``seed``: choice ``i``
    gives what a request of one choice seeded ``choice_seed(seed, i)`` gives (docs/design.md,
    "Contract", item 6).

    Choice 0 keeps ``seed``, so a request's first choice is the same for every ``n``. Choice
    ``i >= 1`` takes 63 bits of numpy's ``SeedSequence([seed, i])`` (a hash of both numbers)
    rather than ``seed + i``, so that requests seeded ``s`` and ``s + 1`` share no choice.
    ``seed`` None stays None: each choice draws its own entropy from the OS.
    """
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def _one_hot(ids: np.ndarray, vocab: int) -> np.ndarray:
    """``[...]`` int ids -> ``[..., V]`` float64 one-hot rows."""
    out = np.zeros(np.shape(ids) + (vocab,), dtype=np.float64)
    np.put_along_axis(out, np.asarray(ids)[..., None], 1.0, axis=-1)
    return out


def _softmax(z: np.ndarray) -> np.ndarray:
    """``[..., C]`` float64 scores (``-inf`` allowed, one finite per row) -> probabilities."""
    e = np.exp(z - np.max(z, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _top_k_candidates(z: np.ndarray, k: int) -> np.ndarray:
    """Ids (ascending) of the tokens of ``z`` ``[V]`` scoring at least the k-th largest score,
    ties at the boundary all kept as HF's ``TopKLogitsWarper`` does; k = 0 or >= V: every token
    that is possible (finite)."""
    if 0 < k < z.size:
        kth = np.partition(z, z.size - k)[z.size - k]
        return np.flatnonzero(z >= kth)
    return np.flatnonzero(z > -np.inf)


def _top_p_keep(probs: np.ndarray, top_p: float, first_look: int = 512) -> np.ndarray:
    """Nucleus (Holtzman et al. 2019) mask over ``probs`` ``[C]``: keep each token whose more
    likely predecessors hold less than ``top_p`` (the smallest most-likely set reaching
    ``top_p``; the top-1 always). Equal probabilities are ordered by position (= token id).

    Sorting all 49k tokens costs milliseconds, so the ``first_look`` most likely are sorted first;
    that answer is exact when the kept prefix ends before them and strictly above their lowest
    probability (no tie can reach across the boundary); otherwise everything is sorted.
    """
    n = probs.size
    m = min(n, first_look)
    top = np.argpartition(-probs, m - 1)[:m] if m < n else np.arange(n)
    top = top[np.lexsort((top, -probs[top]))]                       # [m] most likely first
    before = np.cumsum(probs[top]) - probs[top]                     # mass strictly before
    n_keep = max(int(np.count_nonzero(before < top_p)), 1)
    if m < n and (n_keep == m or probs[top[n_keep - 1]] <= probs[top[-1]]):
        return _top_p_keep(probs, top_p, first_look=n)
    keep = np.zeros(n, dtype=bool)
    keep[top[:n_keep]] = True
    return keep


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's default sampler: the values a request's *unset* fields take.

    Applied field by field (as vLLM does with a model's ``generation_config.json``): a request
    that sets only ``temperature=0.7`` keeps this entry's top_k/top_p/min_p. An explicit
    ``temperature=0`` is greedy whatever the defaults say. The registry entry of a model may
    define its own; ``FALLBACK_SAMPLING`` is used otherwise.

    ``max_tokens`` is the default output limit (completion tokens, >= 1; None: none), which
    ``resolve`` leaves alone: unlike a request's own value it is cut to what a prompt leaves of
    the context, never refused, so it needs the prompt (``flm_runtime.api.with_output_limit``).

    Raises:
        ValueError: ``max_tokens`` not None nor an integer >= 1.
    """

    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95
    min_p: float = 0.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")

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


# The "model's default sampler" of the reference benchmark (docs/benchmarks.md, "The reference
# benchmark"): temperature 1.0, top_k 64, top_p 0.95, for a request that sets no sampling field and
# a model entry that names none.
FALLBACK_SAMPLING = SamplingDefaults(temperature=1.0, top_k=64, top_p=0.95, min_p=0.0)
GREEDY = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def default_sampling(entry_default: SamplingDefaults | None = None) -> SamplingDefaults:
    """The defaults to apply: the model entry's own when it defines one, else ``FALLBACK_SAMPLING``."""
    return entry_default if entry_default is not None else FALLBACK_SAMPLING
