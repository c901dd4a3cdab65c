"""The runtime's plain Python API: model tag -> loaded model -> engine.

    from flm_runtime.api import get_engine
    from flm_runtime.engine.request import SamplingParams

    engine = get_engine("smollm2:135m")           # pulls the embedded default on first use
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    print(engine.submit(ids, SamplingParams(max_tokens=64)).result().text)

One engine per tag per process, created on first use and shared by every caller (the LiteLLM
handler, the CLI, tests). Loading holds a lock so concurrent first calls load once.

A DFlash tag (``X-dflash:size``) gets its own engine that decodes speculatively with the draft of
``registry.locate_draft(tag)``, over the *same* target object as the base tag's engine: a target is
loaded once per process whichever of the two tags comes first. Its speculation policy (when a
speculative step pays, by context; ``flm_runtime.engine.policy``) is ``load_policy``'s table.

Backends (``flm_runtime.backends``): ``get_engine(tag, backend=...)`` with ``auto`` (default, or
``$FLM_BACKEND``), ``cpu`` or ``npu``. The cpu target is the ``LlamaModel``; an npu target is an
``NpuModel`` built on top of it (it keeps the cpu model's embedding and LM head on the host). The
choice for a (model, requested backend) pair is made once per process; ``auto`` falls back to cpu
when the npu backend is not there or fails to start, logging why once.

Engine limits (``flm_runtime.engine.admission``): ``$FLM_KV_BUDGET`` (KV bytes) and
``$FLM_MAX_QUEUE`` (waiting requests), read when an engine is created. They are per process, not
per LiteLLM deployment: every deployment of a tag shares its one engine (one copy of the weights,
one batch), so a per-deployment value would have to either split that engine or contradict another
deployment's. A proxy sets them in its config's ``environment_variables``.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from flm_runtime import paths, pull, registry
from flm_runtime.backends import TargetModel, skinny_gemm
from flm_runtime.backends.select import log_once, requested_backend, select_backend
from flm_runtime.engine.admission import limits_from_env
from flm_runtime.engine.engine import Engine
from flm_runtime.engine.policy import FILE_NAME as POLICY_FILE
from flm_runtime.engine.policy import PolicyTable
from flm_runtime.engine.speculative import SpeculativeDecoder
from flm_runtime.errors import BackendUnavailableError
from flm_runtime.loading import Tokenizer, load_model_files
from flm_runtime.models.dflash import DFlashDraft
from flm_runtime.models.llama import LlamaModel

_lock = threading.Lock()
_engines: dict[str, Engine] = {}  # engine name (the tag; "tag[npu]" on the npu backend) -> engine


@dataclass(frozen=True)
class LoadedModel:
    """A target model ready to run, with its tokenizer (chat template included).

    ``model`` is a ``LlamaModel`` (``backend`` cpu) or an ``NpuModel`` (npu); both implement
    ``flm_runtime.backends.TargetModel``.
    """

    tag: str
    model: TargetModel
    tokenizer: Tokenizer


_targets: dict[str, LoadedModel] = {}  # canonical plain tag -> its cpu model, shared by engines
_npu_targets: dict[str, LoadedModel] = {}  # canonical plain tag -> its npu model
_choices: dict[tuple[str, str], str] = {}  # (plain tag, requested backend) -> backend that runs it
_keys: dict[tuple[str, str], str] = {}  # (tag as asked, requested backend) -> engine name


def load_model(tag: str) -> LoadedModel:
    """Locate (pulling if needed) and load the model of ``tag`` on the cpu backend.

    Raises:
        UnknownModelError: no registry defines ``tag``.
        ModelFilesMissingError: its files are absent and cannot be pulled.
        ModelDownloadError: pulling failed.
        ModelFormatError: the files are unreadable or unsupported.
    """
    bundle = load_model_files(pull.locate(tag), weights=registry.resolve(tag).weights)
    model, tokenizer = LlamaModel(bundle.config, bundle.weights), bundle.tokenizer
    del bundle  # the model holds its own (fused) copies of the weights
    _return_free_memory()
    # Compile (or load from numba's cache) the kernels here, not in the first request's time: the
    # skinny float32 kernel, and one step of the model for the quantized ones.
    skinny_gemm.compile_kernel()
    model.forward_batch([np.zeros(1, dtype=np.int64)], [model.new_cache(1)])
    return LoadedModel(tag, model, tokenizer)


def _return_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere): a load frees tens of MB of temporaries that glibc would otherwise keep resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_draft(tag: str, target: LlamaModel) -> DFlashDraft:
    """Load the DFlash draft of ``tag`` for ``target`` (the base tag's loaded model).

    The draft's ``target_sha256`` is compared with the base entry's recorded sha256 (which
    ``pull.locate`` has verified on the file) when the base is one file with a recorded hash;
    otherwise only the geometry is checked (an HF directory has no single recorded hash).

    Raises:
        ModelFilesMissingError: the draft's files are absent.
        ModelFormatError: unreadable draft files, or a draft that does not fit ``target``.
    """
    entry = registry.resolve(tag)
    assert entry.base is not None, f"{tag} is not a DFlash tag"
    base = registry.resolve(entry.base)
    sha = base.files[0].sha256 if len(base.files) == 1 else None
    return DFlashDraft.load(registry.locate_draft(tag), target, target_sha256=sha)


def load_npu_model(tag: str, cpu_model: LlamaModel):
    """The ``NpuModel`` of plain ``tag`` over its loaded cpu model, from the kernel build that
    ``xclbins/manifest.json`` (or ``$FLM_XCLBIN_PATH``) has for it.

    Raises:
        BackendUnavailableError: no valid build for ``tag``, no pyxrt or device, or a kernel or
            buffer that fails to load; the message says which.
    """
    from flm_runtime.backends import manifest as mf
    from flm_runtime.backends.npu import NpuModel

    manifest = mf.load_manifest()
    check = mf.validate_build(manifest, tag)
    if not check.ok:
        raise BackendUnavailableError(f"no usable NPU kernel build for {tag}: {check.summary()}")
    return NpuModel(cpu_model, manifest, check.build)


def load_policy(tag: str, backend: str) -> PolicyTable | None:
    """The speculation policy table of DFlash ``tag`` on ``backend``: the user's calibration
    (``paths.policy_file``) if there is one, else the table shipped in the draft directory
    (``policy-<backend>.json``), else None (always speculate).

    Raises:
        ValueError: a table file exists but is not a valid table (naming the file).
    """
    for path in (paths.policy_file(tag, backend), registry.locate_draft(tag) / POLICY_FILE.format(backend=backend)):
        if path.is_file():
            return PolicyTable.load(path)
    return None


def get_engine(tag: str, backend: str | None = None) -> Engine:
    """The process-wide engine serving ``tag`` on ``backend``, loading the model on first use.

    Args:
        tag: a registry tag.
        backend: ``auto``, ``cpu`` or ``npu``; None reads ``$FLM_BACKEND`` (default ``auto``).

    Raises:
        InvalidRequestError: ``backend`` (or ``$FLM_BACKEND``) is not auto, cpu or npu; or
            ``$FLM_KV_BUDGET`` / ``$FLM_MAX_QUEUE`` (the new engine's limits, see
            ``flm_runtime.engine.admission``) is not a positive integer.
        BackendUnavailableError: ``npu`` was asked for and cannot run (says what is missing).
        the errors of ``load_model`` (and of ``load_draft`` for a DFlash tag).
    """
    requested = requested_backend(backend)
    with _lock:
        key = _keys.get((tag, requested))
        engine = _engines.get(key) if key is not None else None
        if engine is None:
            entry = registry.resolve(tag)
            base = entry.base or entry.tag
            name = _backend_for(base, requested)
            key = _keys[(tag, requested)] = tag if name == "cpu" else f"{tag}[{name}]"
            engine = _engines.get(key)
        if engine is None:
            if entry.is_dflash:
                pull.locate(tag)  # the draft's and the base's files, pulling the base if need be
                loaded = _target(base, name)
                speculative = SpeculativeDecoder(loaded.model, load_draft(tag, loaded.model),
                                                 policy=load_policy(tag, name))
            else:
                loaded, speculative = _target(base, name), None
            sampling = registry.resolve(base).sampling  # a draft keeps its target's
            engine = Engine(loaded.model, loaded.tokenizer, name=key, speculative=speculative,
                            default_sampling=sampling, **limits_from_env())
            _engines[key] = engine
        return engine


def _backend_for(tag: str, requested: str) -> str:
    """The backend that runs plain ``tag`` for ``requested``, decided once per process (lock held).

    ``auto`` that selects npu but whose npu model then fails to start falls back to cpu; ``npu``
    raises instead, and is not remembered (a later call tries again).
    """
    name = _choices.get((tag, requested))
    if name is None:
        name = select_backend(requested, tag).name
        if name == "npu":
            try:
                _target(tag, "npu")
            except BackendUnavailableError as e:
                if requested == "npu":
                    raise
                log_once(f"backend auto chose cpu for {tag}: the npu backend failed to start: {e}")
                name = "cpu"
        _choices[(tag, requested)] = name
    return name


def _target(tag: str, backend: str = "cpu") -> LoadedModel:
    """The loaded model of plain ``tag`` (canonical) on ``backend``, once per process (lock held)."""
    if backend == "cpu":
        loaded = _targets.get(tag)
        if loaded is None:
            loaded = _targets[tag] = load_model(tag)
        return loaded
    assert backend == "npu", backend
    loaded = _npu_targets.get(tag)
    if loaded is None:
        cpu = _target(tag)
        loaded = _npu_targets[tag] = LoadedModel(tag, load_npu_model(tag, cpu.model), cpu.tokenizer)
    return loaded
