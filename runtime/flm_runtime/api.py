"""The runtime's plain Python API: model tag -> loaded model -> engine.

    from flm_runtime import SamplingParams, get_engine

    engine = get_engine("smollm2:135m")           # pulls the embedded default on first use
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    print(engine.submit(ids, SamplingParams(max_tokens=64)).result().text)

One engine per tag per process, created on first use and shared by every caller: the engines and
loaded models live in a ``Runtime`` (the module's ``get_engine`` asks ``default_runtime``; a test
makes its own and closes it, or ``forget``s a tag). Concurrent first calls load once, and a load
never blocks an engine already served. Every engine gets the decoder
``flm_runtime.speculation.decoders`` builds for its tag (a DFlash tag adds the draft of
``registry.locate_draft``), and a DFlash tag's engine runs over the *same* target object as its
base tag's. A ``Runtime`` without ``Settings`` reads the environment's at each ``get_engine``.
Backends: ``auto`` (``$FLM_BACKEND``), ``cpu`` (a ``CausalLM``) or ``npu`` (an ``NpuModel`` over
it), chosen once per (model, requested backend); ``auto`` falls back to cpu, logging why once.
Engine limits (``$FLM_KV_BUDGET``, ``$FLM_MAX_QUEUE``) are per process (``flm_runtime.settings``).
``drain`` stops admitting, lets what runs finish within ``$FLM_DRAIN_TIMEOUT_S`` and closes the
engines (a LiteLLM proxy's SIGTERM: ``litellm_flm.compat.drain_on_sigterm``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from flm_runtime import paths, pull, registry
from flm_runtime.backends import TargetModel
from flm_runtime.backends.select import log_once, select_backend
from flm_runtime.errors import BackendUnavailableError, EngineDrainingError, InvalidRequestError, ModelFormatError
from flm_runtime.loading import Tokenizer, load_model_files
from flm_runtime.loading.chat_template import thinking_format
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.request import SamplingParams
from flm_runtime.sampling.sampler import default_sampling
from flm_runtime.scheduling.engine import Engine
from flm_runtime.settings import Settings, requested_backend
from flm_runtime.speculation.decoders import decoder_for


@dataclass(frozen=True)
class LoadedModel:
    """A target model ready to run, with its tokenizer (chat template included).

    ``model`` is a ``CausalLM`` (``backend`` cpu) or an ``NpuModel`` (npu); both implement
    ``flm_runtime.backends.TargetModel``.
    """

    tag: str
    model: TargetModel
    tokenizer: Tokenizer


def load_model(tag: str, models: registry.Registry | None = None) -> LoadedModel:
    """Locate (pulling if needed) and load the model of ``tag`` on the cpu backend, as ``models``
    (default ``registry.current()``) defines it.

    Raises:
        UnknownModelError: no registry defines ``tag``.
        ModelFilesMissingError: its files are absent and cannot be pulled.
        ModelDownloadError: pulling failed.
        ModelFormatError: the files are unreadable or unsupported.
        DiskSpaceError: no room for the download or for the kept conversion of its weights.
    """
    models = models or registry.current()
    entry = models.resolve(tag)
    bundle = load_model_files(pull.locate(tag, models=models), weights=entry.weights, keep=paths.converted_dir())
    model, tokenizer = CausalLM(bundle.config, bundle.weights), bundle.tokenizer
    if entry.thinking is not None:  # the entry's markers replace the defaults the template was read with
        tokenizer.thinking = thinking_format(tokenizer.chat_template, entry.thinking)
    del bundle  # the model holds what it needs: views of the kept file's mapping (copies if none was kept)
    _return_free_memory()
    # Compile (or load from numba's cache) the kernels here, not in the first request's time: one
    # step of the model runs every kernel a decode runs (the skinny float32 one only where a
    # float32 matrix is), and no other.
    model.forward_batch([np.zeros(1, dtype=np.int64)], [model.new_cache(1)])
    return LoadedModel(tag, model, tokenizer)


def _return_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere): a load frees tens of MB of temporaries that glibc would otherwise keep resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_npu_model(tag: str, cpu_model: CausalLM):
    """The ``NpuModel`` of plain ``tag`` over its loaded cpu model, from the kernel build that
    ``xclbins/flm_xclbins/manifest.json`` (or ``$FLM_XCLBIN_PATH``) has for it.

    Raises:
        BackendUnavailableError: no valid build for ``tag``, no pyxrt or device, or a kernel or
            buffer that fails to load; the message says which.
    """
    from flm_runtime.backends.npu import manifest as mf
    from flm_runtime.backends.npu import NpuModel

    manifest = mf.load_manifest()
    check = mf.validate_build(manifest, tag)
    if not check.ok:
        raise BackendUnavailableError(f"no usable NPU kernel build for {tag}: {check.summary()}")
    return NpuModel(cpu_model, manifest, check.build)


class Runtime:
    """The engines and loaded models of one process (``default_runtime``) or one test.

    An engine per (tag, backend that runs it), each plain tag's target loaded once per backend
    and shared by its plain and DFlash engines, and each (tag, requested backend)'s backend
    choice, made once.

    Loads never block what is already served: the runtime's lock guards its tables only, for
    microseconds; building an engine (pull, load, warm-up, the host's costs) holds a lock of its
    own (its name), and loading a target one of its own (tag, backend), so a
    request for a loaded engine never waits on another tag's load, and concurrent first requests
    for one tag build it once.

    Args:
        settings: the ``FLM_*`` settings its engines are made with; None reads the environment's
            at each ``get_engine``.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._engines: dict[str, Engine] = {}  # engine name (the tag; "tag[npu]" on the npu backend) -> engine
        self._targets: dict[tuple[str, str], LoadedModel] = {}  # (canonical plain tag, backend) -> its model
        self._choices: dict[tuple[str, str], str] = {}  # (plain tag, requested backend) -> backend that runs it
        self._keys: dict[tuple[str, str], str] = {}  # (tag as asked, requested backend) -> engine name
        self._building: dict[tuple, threading.Lock] = {}  # ("engine", name) | ("target", tag, backend) -> lock
        self._draining = False

    def get_engine(self, tag: str, backend: str | None = None) -> Engine:
        """The engine serving ``tag`` on ``backend``, loading the model on first use; one registry
        (``registry.current()``) answers every lookup of the call. The engine's context is the
        tag's ``context_length`` (a DFlash tag without one: its base's), else the model's own; its
        default sampler is the (base) tag's, with the default output limit ``$FLM_MAX_TOKENS``
        (``Settings.output_limit``) where the tag sets none (``with_output_limit`` applies it).

        Args:
            tag: a registry tag.
            backend: ``auto``, ``cpu`` or ``npu``; None reads ``$FLM_BACKEND`` (default ``auto``).

        Raises:
            InvalidRequestError: ``backend`` (or ``$FLM_BACKEND``) is not auto, cpu or npu; or
                ``$FLM_KV_BUDGET`` / ``$FLM_MAX_QUEUE`` (the new engine's limits, see
                ``flm_runtime.scheduling.admission``) or ``$FLM_MAX_TOKENS`` is not a positive
                integer.
            BackendUnavailableError: ``npu`` was asked for and cannot run (says what is missing).
            EngineDrainingError: the runtime is shutting down (``drain``).
            ModelFormatError: the ``context_length`` the engine takes is more than the model's
                own, naming the tag that gives it and where it is defined.
            the errors of ``load_model`` (and of ``load_draft`` for a DFlash tag).
        """
        settings = self.settings
        requested = requested_backend(backend, settings)
        engine = self._served(tag, requested)
        if engine is not None:
            return engine
        models = registry.current()
        entry = models.resolve(tag)
        name = self._backend_for(entry.base or entry.tag, requested, models)
        key = tag if name == "cpu" else f"{tag}[{name}]"
        with self._build_lock("engine", key):  # one build of this engine; other tags go on
            with self._lock:
                engine = self._engines.get(key)  # built while this call waited
            if engine is None:
                engine = self._build(tag, key, name, settings, models)
            with self._lock:
                if self._draining:  # drained while it was built: it serves nothing
                    engine.close()
                    raise _draining(tag)
                self._engines[key] = engine
                self._keys[(tag, requested)] = key
            return engine

    def _served(self, tag: str, requested: str) -> Engine | None:
        """The engine already built for ``tag`` on ``requested``, None if none.

        Raises:
            EngineDrainingError: the runtime is shutting down.
        """
        with self._lock:
            if self._draining:
                raise _draining(tag)
            key = self._keys.get((tag, requested))
            return self._engines.get(key) if key is not None else None

    def _build_lock(self, *what: str) -> threading.Lock:
        """The lock that serializes building ``what`` (``("engine", engine name)`` or
        ``("target", tag, backend)``), made on first use."""
        with self._lock:
            return self._building.setdefault(what, threading.Lock())

    def _build(self, tag: str, key: str, backend: str, settings: Settings, models: registry.Registry) -> Engine:
        """A new engine named ``key`` for ``tag`` on ``backend`` (``get_engine``'s contract)."""
        entry = models.resolve(tag)
        base = entry.base or entry.tag
        if entry.is_dflash:
            pull.locate(tag, models=models)  # the draft's and the base's files, pulling the base if need be
        loaded = self._target(base, backend, models)
        speculative = decoder_for(tag, loaded.model, backend, settings, models)
        plain = models.resolve(base)  # a draft keeps its target's sampler
        capped = entry if entry.context_length else plain  # a DFlash tag's context, else its base's
        sampling = default_sampling(plain.sampling)
        if sampling.max_tokens is None:
            sampling = dataclasses.replace(sampling, max_tokens=settings.output_limit())
        try:
            return Engine(loaded.model, loaded.tokenizer, name=key, speculative=speculative,
                          default_sampling=sampling, prefix_cache=settings.prefix_cache_on(),
                          context_length=capped.context_length, **settings.engine_limits())
        except InvalidRequestError as e:
            if e.param != "context_length":
                raise
            raise ModelFormatError(f"{capped.tag} ({capped.origin}): {e}") from e

    @property
    def settings(self) -> Settings:
        """The settings given at creation, else the environment's now."""
        return self._settings if self._settings is not None else Settings.from_env()

    def forget(self, tag: str) -> int:
        """Close and drop the engines of ``tag`` (as asked, on every backend): the next
        ``get_engine`` builds a new one, reading its draft and policy table again. Loaded targets
        stay.

        Returns:
            how many engines were closed (0: ``tag`` had none).
        """
        with self._lock:
            engines = [e for (asked, _), key in self._keys.items() if asked == tag
                       and (e := self._engines.pop(key, None)) is not None]
        for engine in engines:
            engine.close()
        return len(engines)

    def drain(self, timeout: float | None = None) -> bool:
        """Shut the engines down gracefully, all at once (``Engine.drain``): they refuse new
        requests from now on, as ``get_engine`` does (``EngineDrainingError``), the requests they
        hold finish within ``timeout`` seconds and those left end with ``EngineDrainingError``;
        then the engines are closed, their KV pools free, and dropped. Loaded targets stay.

        Args:
            timeout: seconds; None: ``$FLM_DRAIN_TIMEOUT_S`` (``Settings.drain_timeout``).

        Returns:
            True when every request finished within ``timeout``.

        Raises:
            InvalidRequestError: ``$FLM_DRAIN_TIMEOUT_S`` is not a non-negative number (nothing
                was drained).
        """
        timeout = self.settings.drain_timeout() if timeout is None else timeout
        with self._lock:
            self._draining = True
            engines = list(self._engines.values())
            self._engines.clear()
            self._keys.clear()
        if not engines:
            return True
        with ThreadPoolExecutor(len(engines), thread_name_prefix="flm-drain") as pool:  # one bound for all
            return all(pool.map(lambda engine: engine.drain(timeout), engines))

    def close(self) -> None:
        """Close every engine and drop every engine, target and backend choice."""
        with self._lock:
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()
            self._targets.clear()
            self._choices.clear()
            self._keys.clear()

    def _backend_for(self, tag: str, requested: str, models: registry.Registry) -> str:
        """The backend that runs plain ``tag`` for ``requested``, decided once.

        ``auto`` that selects npu but whose npu model then fails to start falls back to cpu; ``npu``
        raises instead, and is not remembered (a later call tries again).
        """
        with self._lock:
            name = self._choices.get((tag, requested))
        if name is None:
            name = select_backend(requested, tag).name
            if name == "npu":
                try:
                    self._target(tag, "npu", models)
                except BackendUnavailableError as e:
                    if requested == "npu":
                        raise
                    log_once(f"backend auto chose cpu for {tag}: the npu backend failed to start: {e}")
                    name = "cpu"
            with self._lock:
                self._choices[(tag, requested)] = name
        return name

    def _target(self, tag: str, backend: str, models: registry.Registry) -> LoadedModel:
        """The loaded model of plain ``tag`` (canonical) on ``backend``, loaded once."""
        with self._build_lock("target", tag, backend):
            with self._lock:
                loaded = self._targets.get((tag, backend))
            if loaded is None:
                if backend == "cpu":
                    loaded = load_model(tag, models)
                else:
                    assert backend == "npu", backend
                    cpu = self._target(tag, "cpu", models)
                    loaded = LoadedModel(tag, load_npu_model(tag, cpu.model), cpu.tokenizer)
                with self._lock:
                    self._targets[(tag, backend)] = loaded
            return loaded


def _draining(tag: str) -> EngineDrainingError:
    return EngineDrainingError(f"this process is shutting down and serves no new request for {tag!r}; "
                               "retry on another deployment")


default_runtime = Runtime()  # the process's: the one the LiteLLM handler, the CLI and get_engine use


def with_output_limit(engine: Engine, params: SamplingParams, prompt_tokens: int, n: int = 1) -> SamplingParams:
    """``params`` for a prompt of ``prompt_tokens`` tokens and ``n`` choices on ``engine``: an
    unset ``max_tokens`` becomes the engine's default output limit
    (``engine.default_sampling.max_tokens``: a ``Runtime``'s engines have one, ``get_engine``),
    cut to what the context and the KV pool leave each choice (what the engine gives an unset
    ``max_tokens``: ``KVBudget.generated_tokens``), so the limit ends an answer with
    ``finish_reason`` ``length`` and never refuses a prompt. ``params`` as given when its
    ``max_tokens`` is set (a request's own value is refused when the prompt leaves less) or the
    engine has no default limit.

    Raises:
        ContextLengthError: the prompt leaves no room for a completion.
    """
    limit = engine.default_sampling.max_tokens
    if params.max_tokens is not None or limit is None:
        return params
    room = engine.kv.generated_tokens(prompt_tokens, None, engine.pool.block_tokens, n)
    return dataclasses.replace(params, max_tokens=min(limit, room))


def get_engine(tag: str, backend: str | None = None) -> Engine:
    """``default_runtime.get_engine(tag, backend)``: the process-wide engine of ``tag``."""
    return default_runtime.get_engine(tag, backend)


def drain(timeout: float | None = None) -> bool:
    """``default_runtime.drain(timeout)``: shut the process's engines down gracefully."""
    return default_runtime.drain(timeout)
