"""The policies built from this host's costs alone: a DFlash tag's without a table (this host's
costs and a prior of the draft), and a tag's without a draft (``lookup_table``).

A tag with neither a shipped table nor one the user calibrated (a draft added through the
registry, such as a public DFlash draft of block size 16) would otherwise speculate whole blocks
at every step (``policy.ALWAYS_SPECULATE``): on a CPU, where 16 rows cost several decodes, most
of those verify rows are spent on tokens the target rejects. So its engine starts from an
estimate (docs/design.md, "Speculation policy"): one bucket, for every context, built from

- the host's measured costs (``speculation.costs``, kept per host): a step of K drafted tokens
  costs ``c(K) = propose_ratio[K-1] + verify_ratio[K-1]`` decode steps;
- a prior of the draft's acceptance: each drafted token is accepted with probability
  ``ACCEPTANCE_PRIOR`` once those before it were, so a step of K keeps
  ``E(K) = 1 + a + .. + a^K = (1 - a^(K+1)) / (1 - a)`` tokens, the bonus included (the
  i.i.d. acceptance model of Leviathan et al. 2023, arXiv:2211.17192, section 3.1).

The bucket drafts the K of the most expected tokens per unit of cost, ``argmax E(K) / c(K)``
(the shortest of equal ones), speculates where that speed-up exceeds ``MIN_SPEEDUP`` (the margin
of calibrated buckets), verifies all K (no gate: choosing one takes the draft's confidence
records, which ``litellm-flm calibrate`` measures), takes ``E(K)`` as its ``expected_al`` and
``c(K)`` as its ``cost_ratio``, and the host's ``verify_ratio`` for n-gram-only steps. The request's
``AcceptanceTracker`` starts from that prior and switches speculation off for a request whose own
AL falls below ``c(K)``, so a draft weaker than the prior costs a few steps, not the request.
The curves are measured at ``costs.CONTEXT`` tokens: at long contexts a verify pass costs more
decodes (attention), which only ``calibrate``'s buckets account for.
"""

from __future__ import annotations

import numpy as np

from flm_runtime.speculation.costs import HostCosts
from flm_runtime.speculation.policy import MIN_SPEEDUP, Bucket, PolicyTable

# The prior's per-token acceptance, our choice (an AL of 3.3 at most, for a block of 16): below
# what trained DFlash drafts keep, so that the estimate drafts shorter than such a draft would pay
# for rather than longer (docs/design.md, "Speculation policy").
ACCEPTANCE_PRIOR = 0.7


def expected_tokens(drafted: int, acceptance: float = ACCEPTANCE_PRIOR) -> np.ndarray:
    """``E(K)`` for ``K = 1 .. drafted`` under the prior (module docstring): ``[drafted]`` float64,
    tokens per step, the bonus included."""
    return np.cumsum(acceptance ** np.arange(drafted + 1, dtype=np.float64))[1:]


def first_run_table(model: str, backend: str, costs: HostCosts, *, acceptance: float = ACCEPTANCE_PRIOR,
                    min_speedup: float = MIN_SPEEDUP) -> PolicyTable:
    """The estimated policy of DFlash tag ``model`` on ``backend`` from this host's ``costs`` (module
    docstring): one bucket up to ``costs.context`` (a context above it uses it too), of block size
    ``len(costs.verify_ratio) + 1``.

    Args:
        acceptance: the prior's per-token acceptance, in (0, 1).
        min_speedup: the expected speed-up the bucket must exceed to speculate.
    Raises:
        ValueError: ``acceptance`` outside (0, 1), or curves of different lengths.
    """
    if not 0.0 < acceptance < 1.0:
        raise ValueError(f"the prior's acceptance must be in (0, 1), got {acceptance}")
    drafted = len(costs.verify_ratio)
    if len(costs.propose_ratio) != drafted:
        raise ValueError(f"{len(costs.propose_ratio)} propose costs for {drafted} verify costs")
    tokens = expected_tokens(drafted, acceptance)  # [K]
    cost = np.asarray(costs.propose_ratio, dtype=np.float64) + np.asarray(costs.verify_ratio, dtype=np.float64)
    best = int(np.argmax(tokens / cost))  # the first of equal ones: the shortest K
    speedup = tokens[best] / cost[best]
    bucket = Bucket(max_context=costs.context, speculate=bool(speedup > min_speedup), draft_length=best + 1,
                    cost_ratio=round(float(cost[best]), 4), expected_al=round(float(tokens[best]), 4),
                    verify_ratio=list(costs.verify_ratio))
    return PolicyTable(model=model, backend=backend, buckets=[bucket], block_size=drafted + 1,
                       min_speedup=min_speedup, measured={
                           "estimate": {"acceptance_prior": acceptance, "expected_speedup": round(float(speedup), 4)},
                           "host_costs": costs.model_dump()})


def lookup_table(model: str, backend: str, costs: HostCosts, *, min_speedup: float = MIN_SPEEDUP) -> PolicyTable:
    """The policy of ``model``, a tag without a draft, on ``backend``: one bucket for every
    context that never drafts and prices n-gram-only steps by this host's verify curve
    (``costs.verify_ratio``, block size ``len(costs.verify_ratio) + 1``): a retrieval proposal
    or a grammar's forced tokens are verified where their expected speed-up exceeds
    ``min_speedup`` (``policy.paying_step``)."""
    bucket = Bucket(max_context=costs.context, speculate=False, verify_ratio=list(costs.verify_ratio))
    return PolicyTable(model=model, backend=backend, buckets=[bucket], block_size=len(costs.verify_ratio) + 1,
                       min_speedup=min_speedup, measured={"host_costs": costs.model_dump()})
