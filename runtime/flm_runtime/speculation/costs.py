"""What a verify pass and a draft's proposal cost on the machine that serves, in decode steps.

A step that verifies ``n`` proposed tokens runs one target pass over ``n + 1`` rows; its cost in
decode steps, ``verify_ratio[n-1] = t_verify(n+1) / t_decode``, sets how many tokens a step should
verify (``policy.paying_step``: the most expected tokens per unit of cost); a step that drafts
them first adds the draft's pass, ``propose_ratio[n-1] = t_propose(n) / t_decode``. The curve
depends on the host: where the one-row pass is bound by memory bandwidth and the kernels have compute to
spare per weight read, eight rows cost little more than one; where compute binds sooner they cost
several decodes (docs/benchmarks.md, "`benchmarks/skinny_gemm.py`"). A policy table
calibrated on one host therefore drafts too short or too long on another.

So the first time an engine of a tag that speculates is built on a host, its curves are measured
there, K = block size - 1 (7 or 15; a tag without a draft, ``decoders.LOOKUP_BLOCK`` - 1): the target's (``measure_verify_ratio``: interleaved rounds of a one-row pass
and passes of 2 .. K + 1 rows at ``CONTEXT`` tokens, medians: a prefill of ``CONTEXT`` tokens and
``(ROUNDS + 1) * (K + 1)`` passes) and the draft's (``measure_propose_ratio``: proposals of 1 .. K
tokens, each after a one-row target pass, the draft's own passes a fraction of the target's), and
kept (``HostCosts``, JSON, ``paths.host_costs_file``) for the later processes of the same host,
keyed by ``host_id`` and by the code that runs the passes (``kernels_digest``: new kernels or a
new weight format change the curve, so it is measured again). ``PolicyTable.on_host`` applies the verify curve to the shipped table; a tag
without a table starts from the estimate both curves give (``speculation.estimate``). A
table the user calibrated (``litellm-flm calibrate``, ``paths.policy_file``) was measured on their
host already and is used as it is. ``FLM_HOST_COSTS=0`` turns the measurement off. A curve timed
while other work loaded the machine is off (a busy machine slows the one-row pass more than the
longer ones): deleting the file measures it again at the next start.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from flm_runtime.backends import KVCacheLike, TargetModel, forward
from flm_runtime.kernels.cpu_features import cpu_model, host_features
from flm_runtime.kernels.jit import sources_key
from flm_runtime.layers import stack
from flm_runtime.loading import gguf
from flm_runtime.models.dflash import DFlashDraft

log = logging.getLogger(__name__)

CONTEXT = 256   # tokens in the cache when the passes are timed: the shipped table's first bucket edge
ROUNDS = 5      # timed rounds after one warm-up round; each pass's median is kept
# The features that change which kernels run, and so the curve (``kernels.qgemm``, ``attention``).
KERNEL_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vnni", "avxvnni")


class HostCosts(BaseModel):
    """A target's verify cost curve on one host (the JSON file ``host_costs`` keeps).

    Attributes:
        host: ``host_id()`` of the machine that measured it.
        model: the tag whose target was timed.
        backend: ``"cpu"`` or ``"npu"``.
        context: tokens in the KV cache during the timed passes.
        verify_ratio: ``t_verify(n+1) / t_decode`` for ``n = 1 .. K`` (K = block size - 1).
        propose_ratio: ``t_propose(n) / t_decode`` for ``n = 1 .. K``: the draft catching up one
            position and drafting ``n`` tokens; empty for a tag without a draft. A DFlash tag's
            file without it (written before it was measured) is measured again.
        date: when it was measured (ISO date).
        kernels: ``kernels_digest()`` of the code that ran the passes; empty in a file written
            before it was kept (measured again).
    """

    model_config = ConfigDict(extra="forbid")

    host: str
    model: str
    backend: str
    context: int = Field(gt=0)
    verify_ratio: list[PositiveFloat] = Field(min_length=1)
    propose_ratio: list[PositiveFloat] = Field(default_factory=list)
    date: str
    kernels: str = ""


def host_id() -> str:
    """What the curve depends on, as one string: the CPU model, the kernel-relevant features it
    has, and the CPUs the process may run on."""
    features = ",".join(f for f in KERNEL_FEATURES if f in host_features())
    return f"{cpu_model()} | {features} | {len(os.sched_getaffinity(0))} CPUs"


@functools.cache
def kernels_digest() -> str:
    """A digest of the code a pass runs: the kernels' and the layers' sources (``jit.sources_key``:
    the products, the compiled step) and the GGUF reader (which width each weight is held in)."""
    h = hashlib.sha256(sources_key(Path(stack.__file__).parent).encode())
    h.update(Path(gguf.__file__).read_bytes())
    return h.hexdigest()[:16]


def measure_verify_ratio(target: TargetModel, taps: tuple[int, ...], drafted: int, *, context: int = CONTEXT,
                         rounds: int = ROUNDS, seed: int = 0) -> list[float]:
    """``t_verify(n+1) / t_decode`` for ``n = 1 .. drafted``, timed on ``target`` here.

    Each round times a one-row pass (a decode step: last-row logits) and passes of ``n + 1`` rows
    as a verify runs them (every row's logits, the draft's ``taps``), one after the other, each
    rolled back from a cache holding ``context`` random tokens; the first round warms up and is
    dropped, each pass keeps its median (the ratio of medians).

    Raises:
        ValueError: ``context + drafted + 1`` is beyond the target's context length.
    """
    rng = np.random.default_rng(seed)
    cache = _filled_cache(target, context, drafted, rng)
    block = rng.integers(0, target.config.vocab_size, drafted + 1)
    times: list[list[float]] = [[] for _ in range(drafted + 1)]  # [rows - 1][round]
    for _ in range(rounds + 1):
        for rows in range(1, drafted + 2):
            t0 = time.perf_counter()
            if rows == 1:
                forward(target, block[:1], cache)
            else:
                forward(target, block[:rows], cache, all_logits=True, taps=taps)
            times[rows - 1].append(time.perf_counter() - t0)
            cache.trim(context)
    decode, *verify = (statistics.median(t[1:]) for t in times)
    return [round(t / decode, 4) for t in verify]


def _filled_cache(target: TargetModel, context: int, drafted: int, rng: np.random.Generator) -> KVCacheLike:
    """A target cache holding ``context`` random tokens, with room for ``drafted + 1`` rows more.

    Raises:
        ValueError: ``context + drafted + 1`` is beyond the target's context length.
    """
    limit = target.config.max_position_embeddings
    if context + drafted + 1 > limit:
        raise ValueError(f"a context of {context} and {drafted + 1} rows do not fit {limit} positions")
    cache = target.new_cache(context + drafted + 1)
    forward(target, rng.integers(0, target.config.vocab_size, context), cache)
    return cache


def measure_propose_ratio(target: TargetModel, draft: DFlashDraft, drafted: int, *, context: int = CONTEXT,
                          rounds: int = ROUNDS, seed: int = 0) -> list[float]:
    """``t_propose(n) / t_decode`` for ``n = 1 .. drafted``, timed on ``draft`` and ``target`` here.

    A proposal as a step runs it: the draft takes one position's taps into its cache and drafts
    ``n`` tokens (``draft_blocks``, a block of ``n + 1`` rows). Each round times a one-row target
    pass, then each proposal right after an untimed one-row pass (back to back, the draft's
    weights would stay in cache and time low, as ``litellm-flm calibrate`` finds), each rolled
    back from caches holding ``context`` random tokens (the draft's from random taps); the first
    round warms up and is dropped, each keeps its median (the ratio of medians).

    Raises:
        ValueError: ``context + drafted + 1`` is beyond the target's context length.
    """
    rng = np.random.default_rng(seed)
    cache = _filled_cache(target, context, drafted, rng)
    width = len(draft.config.target_layer_ids) * target.config.hidden_size
    draft_cache = draft.new_cache(context + drafted + 2)
    draft.add_context(draft_cache, rng.standard_normal((context, width)).astype(np.float32), 0)
    one_tap = rng.standard_normal((1, width)).astype(np.float32)
    anchor = rng.integers(0, target.config.vocab_size, 1)

    def decode() -> None:
        forward(target, anchor, cache)
        cache.trim(context)

    times: list[list[float]] = [[] for _ in range(drafted + 1)]  # [0]: the one-row pass, [n]: a proposal of n
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        decode()
        times[0].append(time.perf_counter() - t0)
        for n in range(1, drafted + 1):
            decode()
            t0 = time.perf_counter()
            draft.add_context(draft_cache, one_tap, context)
            draft.draft_blocks([draft_cache], [int(anchor[0])], n)
            times[n].append(time.perf_counter() - t0)
            draft_cache.trim(context)
    decode_time, *propose = (statistics.median(t[1:]) for t in times)
    return [round(t / decode_time, 4) for t in propose]


def load(path: Path, host: str, model: str, backend: str, drafted: int, proposed: int) -> HostCosts | None:
    """The curves kept at ``path`` if they are this host's, model's and backend's, measured by this
    code (``kernels_digest``), with ``drafted`` verify and ``proposed`` propose values
    (``drafted``, or 0 without a draft); None otherwise (no file, another host or code, a file
    that does not parse: they are measured again and replaced)."""
    try:
        costs = HostCosts.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        if path.exists():
            log.warning("ignoring %s, it will be measured again: %s", path, e)
        return None
    if (costs.host, costs.model, costs.backend, costs.kernels, len(costs.verify_ratio), len(costs.propose_ratio)) != (
            host, model, backend, kernels_digest(), drafted, proposed):
        return None
    return costs


def host_costs(path: Path, target: TargetModel, draft: DFlashDraft | None, *, model: str, backend: str,
               block_size: int | None = None) -> HostCosts:
    """This host's curves for ``model``'s target and ``draft`` (``drafted`` = its block size - 1
    values each; without a draft, ``block_size - 1`` verify values and no propose ones): those
    kept at ``path``, else measured now (``measure_verify_ratio``, ``measure_propose_ratio``) and
    written there (a temporary name, then renamed). A measurement takes seconds, in the first
    request's time (docs/design.md, "Speculation policy"): it is said on stderr as it starts."""
    host = host_id()
    drafted = int(draft.config.block_size if draft is not None else block_size) - 1
    proposed = drafted if draft is not None else 0
    costs = load(path, host, model, backend, drafted, proposed)
    if costs is not None:
        return costs
    context = min(CONTEXT, target.config.max_position_embeddings - drafted - 1)
    passes = "verify and draft passes" if draft is not None else "verify passes"
    print(f"litellm-flm: timing this host's {passes} for {model} once, seconds (kept in {path}; "
          "FLM_HOST_COSTS=0 skips it)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
    costs = HostCosts(host=host, model=model, backend=backend, context=context,
                      verify_ratio=measure_verify_ratio(target, taps, drafted, context=context),
                      propose_ratio=measure_propose_ratio(target, draft, drafted, context=context) if proposed else [],
                      date=datetime.date.today().isoformat(), kernels=kernels_digest())
    log.info("measured %s's verify and propose costs on this host in %.1f s: %s, %s (kept in %s)", model,
             time.perf_counter() - t0, costs.verify_ratio, costs.propose_ratio, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(costs.model_dump_json(indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return costs
