"""The runtime's settings: every ``FLM_*`` environment variable, read in this module only.

``Settings.from_env()`` reads them all at once; the edges (``api.Runtime``, the CLI, the LiteLLM
provider) pass its values down, and a library function given no value reads the environment here,
never ``os.environ`` itself. Each value is checked where it is used, naming the variable. The
engine limits are per process, shared by every LiteLLM deployment of a tag (a proxy sets them in
its config's ``environment_variables``). Variables (default; meaning; where used):

    FLM_BACKEND (``auto``): ``auto``, ``cpu`` or ``npu`` (``backends.select``).
    FLM_WEIGHTS (``auto``): ``auto``, ``q4``, ``q8`` or ``f32``, where a registry entry does not
        say (``loading.weights``).
    FLM_KV_BUDGET (4 full contexts): KV cache bytes per engine (``scheduling.admission``).
    FLM_MAX_QUEUE (64): requests waiting per engine; one more is refused at once.
    FLM_MODEL_PATH (the user cache dir of ``litellm-flm``, ``/models``): where models are kept
        (``paths``).
    FLM_MODELS_FILE (``models.yaml`` in the user config dir): the user models file (``registry``).
    FLM_XCLBIN_PATH (the package ``flm_xclbins``): npu kernel builds and their ``manifest.json``.
    FLM_PREFIX_CACHE (``1``): ``0`` / ``false`` / ``off`` turns prefix caching off.
    FLM_SPECULATION (``1``): ``0`` decodes every tag plainly, a DFlash tag with its target alone
        (``speculation.decoders``; per request: ``SamplingParams.speculation``).
    FLM_SUFFIX_CACHE_TOKENS (``SUFFIX_CACHE_TOKENS``, 16384): tokens of finished requests an
        engine's suffix proposer keeps (``speculation.suffix``); ``0``: no suffix proposer.
    FLM_HOST_COSTS (``1``): ``0`` does not time this host's verify costs (``speculation.costs``): a
        DFlash tag keeps its shipped table's, a tag without a draft decodes plainly.
    FLM_THREADS (the CPUs the process may use, and at most that): the kernel team's threads
        (``kernels.team``).
    FLM_DRAIN_TIMEOUT_S (``DRAIN_TIMEOUT_S``, 25): seconds ``Runtime.drain`` lets running requests
        finish; keep it below the server's bound (LiteLLM's ``GRACEFUL_SHUTDOWN_TIMEOUT``, 30 s).
    FLM_MAX_TOKENS (``MAX_TOKENS``, 4096): the default output limit of a request that sets no
        ``max_tokens``, of a tag whose entry sets none (``api.with_output_limit``).
    FLM_LOG_LEVEL (unset: no handler): the level of ``flm_runtime`` and ``litellm_flm`` records sent
        to stderr (``litellm_flm.configure_logging``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from flm_runtime.errors import InvalidRequestError

BACKENDS = ("auto", "cpu", "npu")
# The suffix index's default cap in tokens: at most about 3 kB a token (``speculation.suffix``: 16
# trie nodes of at most about 190 bytes), so at most about 50 MB per DFlash engine.
SUFFIX_CACHE_TOKENS = 16384
# The drain's default bound in seconds: below LiteLLM's GRACEFUL_SHUTDOWN_TIMEOUT default (30 s),
# so that the requests it cuts end with an error of ours before uvicorn cancels them.
DRAIN_TIMEOUT_S = 25.0
# The default output limit in tokens: LiteLLM's own (litellm.constants.DEFAULT_MAX_TOKENS, what it
# sends a provider that requires one), so that a model that repeats itself ends with
# finish_reason "length" in minutes rather than filling a long context (32,768 for Qwen2.5-Coder)
# past a client's timeout.
MAX_TOKENS = 4096


@dataclass(frozen=True)
class Settings:
    """The ``FLM_*`` variables as set (None: unset or empty), unparsed.

    Attributes (each named after its variable, ``FLM_`` and upper case dropped): ``backend``,
    ``weights``, ``kv_budget``, ``max_queue``, ``model_path``, ``models_file``, ``xclbin_path``,
    ``prefix_cache``, ``speculation``, ``suffix_cache_tokens``, ``host_costs``, ``threads``,
    ``drain_timeout_s``, ``max_tokens``, ``log_level``.
    """

    backend: str | None = None
    weights: str | None = None
    kv_budget: str | None = None
    max_queue: str | None = None
    model_path: str | None = None
    models_file: str | None = None
    xclbin_path: str | None = None
    prefix_cache: str | None = None
    speculation: str | None = None
    suffix_cache_tokens: str | None = None
    host_costs: str | None = None
    threads: str | None = None
    drain_timeout_s: str | None = None
    max_tokens: str | None = None
    log_level: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of ``environ`` (default: the process environment, read now)."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: environ.get(variable(f.name), "").strip() or None for f in fields(cls)})

    def engine_limits(self) -> dict[str, int]:
        """``Engine`` keyword arguments set by ``FLM_KV_BUDGET`` (``kv_budget``) and
        ``FLM_MAX_QUEUE`` (``max_queue``); the unset ones are left out (the engine's defaults
        apply).

        Raises:
            InvalidRequestError: a value that is not a positive integer (``param`` names the
                variable).
        """
        return {key: self.positive(key) for key in ("kv_budget", "max_queue") if getattr(self, key) is not None}

    def prefix_cache_on(self) -> bool:
        """``FLM_PREFIX_CACHE``: on unless ``0``, ``false`` or ``off`` (``switch``)."""
        return self.switch("prefix_cache")

    def speculation_on(self) -> bool:
        """``FLM_SPECULATION``: on unless ``0``, ``false`` or ``off`` (``switch``)."""
        return self.switch("speculation")

    def host_costs_on(self) -> bool:
        """``FLM_HOST_COSTS``: on unless ``0``, ``false`` or ``off`` (``switch``)."""
        return self.switch("host_costs")

    def switch(self, key: str) -> bool:
        """The on/off field ``key``: on when unset or ``1``, ``true``, ``on``; off for ``0``,
        ``false``, ``off`` (any case).

        Raises:
            InvalidRequestError: another value (``param`` names the variable).
        """
        raw = (getattr(self, key) or "1").lower()
        if raw not in ("0", "false", "off", "1", "true", "on"):
            raise InvalidRequestError(f"{variable(key)} must be 1, true, on, 0, false or off, "
                                      f"got {getattr(self, key)!r}", param=variable(key))
        return raw in ("1", "true", "on")

    def suffix_cache_cap(self) -> int:
        """``FLM_SUFFIX_CACHE_TOKENS``: the suffix index's cap in tokens, ``SUFFIX_CACHE_TOKENS``
        when unset; 0: no suffix proposer.

        Raises:
            InvalidRequestError: a value that is not a non-negative integer (``param`` names the
                variable).
        """
        raw = self.suffix_cache_tokens
        if raw is None:
            return SUFFIX_CACHE_TOKENS
        if not raw.isdigit():
            raise InvalidRequestError(f"{variable('suffix_cache_tokens')} must be a non-negative integer, got {raw!r}",
                                      param=variable("suffix_cache_tokens"))
        return int(raw)

    def output_limit(self) -> int:
        """``FLM_MAX_TOKENS``: the default output limit in tokens, ``MAX_TOKENS`` when unset.

        Raises:
            InvalidRequestError: a value that is not a positive integer (``param`` names the
                variable).
        """
        return self.positive("max_tokens") or MAX_TOKENS

    def drain_timeout(self) -> float:
        """``FLM_DRAIN_TIMEOUT_S``: seconds, ``DRAIN_TIMEOUT_S`` when unset.

        Raises:
            InvalidRequestError: a value that is not a non-negative number of seconds (``param``
                names the variable).
        """
        raw = self.drain_timeout_s
        if raw is None:
            return DRAIN_TIMEOUT_S
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            raise InvalidRequestError(f"{variable('drain_timeout_s')} must be a non-negative number of seconds, "
                                      f"got {raw!r}", param=variable("drain_timeout_s"))
        return seconds

    def positive(self, key: str) -> int | None:
        """The field ``key`` as a positive integer, or None when unset.

        Raises:
            InvalidRequestError: a value that is not a positive integer (``param`` names the
                variable).
        """
        raw = getattr(self, key)
        if raw is None:
            return None
        if not raw.isdigit() or int(raw) < 1:
            raise InvalidRequestError(f"{variable(key)} must be a positive integer, got {raw!r}", param=variable(key))
        return int(raw)


def variable(name: str) -> str:
    """The environment variable of the ``Settings`` field ``name``: ``FLM_<NAME>``."""
    return f"FLM_{name.upper()}"


def requested_backend(value: str | None = None, settings: Settings | None = None) -> str:
    """``value``, else ``FLM_BACKEND`` (of ``settings``, default the current environment), else
    ``auto``; lower-cased and checked.

    Raises:
        InvalidRequestError: not one of auto, cpu, npu (``param`` is ``backend``; the message
            names ``FLM_BACKEND`` when the value came from there).
    """
    if value is None:
        source, chosen = variable("backend"), (settings or Settings.from_env()).backend or "auto"
    else:
        source, chosen = "backend", value
    if not isinstance(chosen, str) or chosen.strip().lower() not in BACKENDS:
        raise InvalidRequestError(f"{source} must be one of {', '.join(BACKENDS)}; got {chosen!r}",
                                  param="backend")
    return chosen.strip().lower()
