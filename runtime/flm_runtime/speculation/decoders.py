"""Which speculative decoder an engine of a tag gets: every tag speculates where it pays.

- A **DFlash tag** (``X-dflash:size``) decodes with the draft of ``registry.locate_draft(tag)``
  over its base tag's target, the retrieval proposers beside it. Its policy (when a speculative
  step pays, by context; ``policy.py``) is ``load_policy``'s table: the user's calibration, else
  the table shipped with the draft, on the cpu backend with this host's verify costs (measured the
  first time such an engine is built on the host, ``costs.py``); a draft without a table starts
  from the estimate those costs give (``estimate.first_run_table``).
- **Every other tag** decodes with the proposers that need no draft: a request's predicted output
  (``prediction.py``), prompt lookup (``ngram.py``), the suffix index of the engine's earlier
  requests (``suffix.py``) and a grammar's forced tokens, in n-gram-only steps of up to
  ``LOOKUP_BLOCK - 1`` tokens, each priced by this host's verify curve for the tag's target
  (``estimate.lookup_table``). Without that curve (``FLM_HOST_COSTS=0``) no step can be priced,
  and the tag decodes plainly.

``FLM_SPECULATION=0`` decodes every tag plainly (a DFlash tag with its target alone), and a
request asks the same for itself with ``SamplingParams.speculation``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from flm_runtime import paths, registry
from flm_runtime.backends import TargetModel
from flm_runtime.models.dflash import DFlashDraft
from flm_runtime.settings import Settings
from flm_runtime.speculation import costs
from flm_runtime.speculation.costs import HostCosts
from flm_runtime.speculation.estimate import first_run_table, lookup_table
from flm_runtime.speculation.policy import ALWAYS_SPECULATE, PolicyTable, SpeculationPolicy
from flm_runtime.speculation.policy import FILE_NAME as POLICY_FILE
from flm_runtime.speculation.speculative import SpeculativeDecoder
from flm_runtime.speculation.suffix import SuffixIndex

# Rows of a whole n-gram-only step of a tag without a draft: the anchor and up to 7 proposed
# tokens, as a DFlash block of 8. Longer copies pay no better where the verify curve is linear in
# the rows (docs/design.md, "Speculation policy"), and a short block bounds a wrong proposal's cost.
LOOKUP_BLOCK = 8


def load_draft(tag: str, target: TargetModel, models: registry.Registry | None = None) -> DFlashDraft:
    """Load the DFlash draft of ``tag`` for ``target`` (the base tag's loaded model), as ``models``
    (default ``registry.current()``) defines it.

    The draft's ``target_sha256`` is compared with the base entry's recorded sha256 (which
    ``pull.locate`` has verified on the file) when the base is one file with a recorded hash;
    otherwise only the geometry is checked (an HF directory has no single recorded hash).

    Raises:
        ModelFilesMissingError: the draft's files are absent.
        ModelFormatError: unreadable draft files, or a draft that does not fit ``target``.
    """
    models = models or registry.current()
    entry = models.resolve(tag)
    assert entry.base is not None, f"{tag} is not a DFlash tag"
    base = models.resolve(entry.base)
    sha = base.files[0].sha256 if len(base.files) == 1 else None
    return DFlashDraft.load(models.locate_draft(tag), target, target_sha256=sha)


def load_policy(tag: str, backend: str, models: registry.Registry | None = None, *,
                host_costs: Callable[[], HostCosts] | None = None) -> SpeculationPolicy:
    """The speculation policy table of DFlash ``tag`` on ``backend``: the user's calibration
    (``paths.policy_file``) if there is one, else the table shipped in the draft directory
    (``policy-<backend>.json``; ``models``, default ``registry.current()``, says where that is),
    with this host's verify costs (``host_costs()``, ``costs.py``) when given; without a table,
    the estimate from this host's costs when given (``estimate.first_run_table``), else
    ``ALWAYS_SPECULATE`` (the null policy: whole blocks, always).

    Raises:
        ValueError: a table file exists but is not a valid table (naming the file).
    """
    user = paths.policy_file(tag, backend)
    if user.is_file():
        return PolicyTable.load(user)  # calibrated on this host: its costs are the host's already
    shipped = (models or registry.current()).locate_draft(tag) / POLICY_FILE.format(backend=backend)
    if not shipped.is_file():
        return ALWAYS_SPECULATE if host_costs is None else first_run_table(tag, backend, host_costs())
    table = PolicyTable.load(shipped)
    if host_costs is None:
        return table
    costs = host_costs()
    return table.on_host(costs.verify_ratio, costs.context)


def decoder_for(tag: str, target: TargetModel, backend: str, settings: Settings,
                models: registry.Registry) -> SpeculativeDecoder | None:
    """The speculative decoder of an engine of ``tag`` (as ``models`` defines it) over its loaded
    ``target`` on ``backend`` (module docstring); None: the engine decodes plainly
    (``FLM_SPECULATION=0``; a tag without a draft where this host's costs are not measured:
    ``FLM_HOST_COSTS=0``, or the npu backend, whose costs are the device's own).

    Raises:
        InvalidRequestError: ``FLM_SPECULATION``, ``FLM_HOST_COSTS`` or
            ``FLM_SUFFIX_CACHE_TOKENS`` is not a valid value.
        the errors of ``load_draft`` and ``load_policy`` for a DFlash tag.
    """
    if not settings.speculation_on():
        return None
    measured = backend == "cpu" and settings.host_costs_on()
    cap = settings.suffix_cache_cap()
    suffix = SuffixIndex(cap) if cap else None
    if models.resolve(tag).is_dflash:
        draft = load_draft(tag, target, models)
        measure = None
        if measured:
            measure = functools.partial(costs.host_costs, paths.host_costs_file(tag, backend), target, draft,
                                        model=tag, backend=backend)
        return SpeculativeDecoder(target, draft, policy=load_policy(tag, backend, models, host_costs=measure),
                                  suffix=suffix)
    if not measured:
        return None
    curve = costs.host_costs(paths.host_costs_file(tag, backend), target, None, model=tag, backend=backend,
                             block_size=LOOKUP_BLOCK)
    policy = lookup_table(tag, backend, curve)
    return SpeculativeDecoder(target, None, policy=policy, suffix=suffix, block_size=policy.block_size)
