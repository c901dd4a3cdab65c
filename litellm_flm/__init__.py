"""litellm_flm: run ``flm/<tag>`` models locally through LiteLLM.

Importing the package registers the provider (``register()``), so either of these is enough::

    import litellm, litellm_flm
    litellm.completion(model="flm/smollm2:135m", messages=[...])

and, in a LiteLLM proxy ``config.yaml`` (the proxy imports this package to resolve the handler,
which registers the models' context windows and zero costs as a side effect)::

    litellm_settings:
      custom_provider_map: [{provider: flm, custom_handler: litellm_flm.handler}]

In a proxy's process, the import also makes SIGTERM drain the engines before the server's own
handler runs (``litellm_flm.compat.drain_on_sigterm``): new requests get a 503, the running ones
finish. Every use of LiteLLM's internals, these patches among them, is in ``litellm_flm.compat``.

Registration on import is deliberate: LiteLLM has no entry-point discovery, and the proxy only
ever imports the handler, so an explicit ``register()`` call would have no place to live there.
It is cheap (no model is loaded) and idempotent.

``reasoning_effort`` / ``thinking`` switch a reasoning model's thinking (``litellm_flm.reasoning``);
LiteLLM forwards them to a custom provider only when ``allowed_openai_params`` lets them through
(or in ``extra_body``), as any OpenAI parameter it does not forward by default.

``$FLM_LOG_LEVEL`` (e.g. ``INFO``), read at import, sends the log records of ``flm_runtime`` and
``litellm_flm`` of that level and up to stderr (``configure_logging``). A LiteLLM proxy sets up
only its own loggers, so this is how its output shows the engine's lines, among them one per ended
request with the engine's stats (``flm_runtime.scheduling.engine.Engine._end``).
"""

from __future__ import annotations

import logging

import litellm

from flm_runtime import FlmError, Settings

from . import compat
from .errors import PROVIDER
from .llm import FlmLLM, served_name
from .params import SUPPORTED_OPENAI_PARAMS

__all__ = ["FlmLLM", "handler", "register", "configure_logging", "PROVIDER"]

# LiteLLM's model-info capability flags (supports_<feature>) of every flm model: tools and
# structured output by constrained decoding (litellm_flm.structured), no images.
FEATURES = {"function_calling": True, "parallel_function_calling": True, "tool_choice": True, "response_schema": True,
            "vision": False}

# The CustomLLM instance LiteLLM calls (custom_provider_map needs an instance, not the class).
handler = FlmLLM()

_log = logging.getLogger(__name__)


def _registry_entries() -> list:
    """Every registered model (``registry.ModelEntry``s).

    A broken user models file must not break ``import litellm_flm`` (nor the proxy's startup): it
    is logged here, and each request for a tag then raises the runtime's own error naming the file.
    """
    try:
        from flm_runtime import list_entries
    except ModuleNotFoundError as e:
        if e.name != "flm_runtime.registry":
            raise
        _log.warning("flm_runtime.registry is not installed: no flm/<tag> model metadata registered")
        return []
    try:
        return list(list_entries())
    except FlmError as e:
        _log.error("flm models were not registered with litellm: %s", e)
        return []


def _model_infos(entries: list) -> dict[str, dict]:
    """``flm/<tag>`` -> its ``model_info``: the context length its engine serves
    (``known_context_length``: the entry's, else its GGUF file's; None when not known before it
    loads) and whether it chats; a DFlash entry has its base's (its own context length first)."""
    by_tag = {e.tag: e for e in entries}
    infos = {}
    for e in entries:
        plain = by_tag.get(e.base) if e.base else e
        context = e.known_context_length() or (plain.known_context_length() if plain is not None else None)
        infos[f"{PROVIDER}/{e.tag}"] = model_info(context, plain is None or plain.chat)
    return infos


def model_info(context_length: int | None, chat: bool) -> dict:
    """LiteLLM's model-cost entry of a local model: free, mode ``chat`` or, for a base model (no
    chat template: ``chat`` False), ``completion``, the context shared by prompt and output (left
    out when unknown), tools and structured output but no images (``FEATURES``)."""
    window = {}
    if context_length:
        window = {"max_tokens": context_length, "max_input_tokens": context_length, "max_output_tokens": context_length}
    return {
        **window,
        "input_cost_per_token": 0.0,
        "output_cost_per_token": 0.0,
        # Without these litellm warns, for every tag, that cache costs "will default to 0".
        "cache_creation_input_token_cost": 0.0,
        "cache_read_input_token_cost": 0.0,
        "litellm_provider": PROVIDER,
        "mode": "chat" if chat else "completion",
        # What litellm.supports_function_calling / supports_response_schema / ... answer.
        **{f"supports_{feature}": value for feature, value in FEATURES.items()},
    }


def register() -> None:
    """Make ``flm/<tag>`` models callable in this process's LiteLLM. Idempotent.

    Adds ``{"provider": "flm", "custom_handler": handler}`` to ``litellm.custom_provider_map``
    (replacing any other ``flm`` entry, so there is never more than one) and has LiteLLM take it up,
    applies the patches of ``compat`` (a warning first if LiteLLM is not the version they were
    checked on), and registers every registry tag as ``flm/<tag>`` with zero costs, its context
    length, its mode (chat, or completion for a base model) and, in its model info, the OpenAI
    parameters the handler supports.
    """
    others = [item for item in litellm.custom_provider_map if item.get("provider") != PROVIDER]
    litellm.custom_provider_map = [*others, {"provider": PROVIDER, "custom_handler": handler}]
    compat.check_version()
    compat.setup_custom_providers()
    compat.stream_text_as_strings()
    compat.streams_named_as_served(served_name)
    compat.model_info_lists_supported_params(SUPPORTED_OPENAI_PARAMS)
    infos = _model_infos(_registry_entries())
    if infos:
        litellm.register_model(infos)


_stderr = logging.StreamHandler()  # sys.stderr
_stderr.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))


def configure_logging(level: str | None) -> None:
    """Send the ``flm_runtime`` and ``litellm_flm`` log records of ``level`` and up (a ``logging``
    level name, any case) to stderr, and not on to the root logger (no line twice where the
    application logs the root too). None or "" leaves logging alone. Idempotent.

    Raises:
        ValueError: ``level`` is not a level name; the message names ``FLM_LOG_LEVEL``.
    """
    if not level:
        return
    name = level.strip().upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"FLM_LOG_LEVEL must be a logging level (DEBUG, INFO, WARNING, ERROR), got {level!r}")
    for logger in map(logging.getLogger, ("flm_runtime", "litellm_flm")):
        logger.setLevel(name)
        logger.propagate = False
        if _stderr not in logger.handlers:
            logger.addHandler(_stderr)


configure_logging(Settings.from_env().log_level)
register()
compat.drain_on_sigterm()
