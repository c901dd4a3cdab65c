"""litellm_flm: run ``flm/<tag>`` models locally through LiteLLM.

Importing the package registers the provider (``register()``), so either of these is enough::

    import litellm, litellm_flm
    litellm.completion(model="flm/smollm2:135m", messages=[...])

and, in a LiteLLM proxy ``config.yaml`` (the proxy imports this package to resolve the handler,
which registers the models' context windows and zero costs as a side effect)::

    litellm_settings:
      custom_provider_map: [{provider: flm, custom_handler: litellm_flm.handler}]

In a proxy's process, the import also makes SIGTERM drain the engines before the server's own
handler runs (``litellm_flm.shutdown``): new requests get a 503, the running ones finish.

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

import inspect
import logging

import litellm
from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper
from litellm.text_completions.streaming_iterator import TextCompletionStreamWrapper

from flm_runtime import FlmError, Settings

from .llm import FlmLLM, served_name
from .params import SUPPORTED_OPENAI_PARAMS
from .shutdown import drain_on_sigterm

__all__ = ["FlmLLM", "handler", "register", "configure_logging", "PROVIDER"]

PROVIDER = "flm"
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
    (replacing any other ``flm`` entry, so there is never more than one), adds the provider to
    LiteLLM's provider lists, and registers every registry tag as ``flm/<tag>`` with zero costs
    its context length, its mode (chat, or completion for a base model) and, in its model info,
    the OpenAI parameters the handler supports.
    """
    others = [item for item in litellm.custom_provider_map if item.get("provider") != PROVIDER]
    litellm.custom_provider_map = [*others, {"provider": PROVIDER, "custom_handler": handler}]
    litellm.utils.custom_llm_setup()
    _stream_text_as_strings()
    _streams_named_as_served()
    _model_info_lists_the_supported_params()
    infos = _model_infos(_registry_entries())
    if infos:
        litellm.register_model(infos)


def _stream_text_as_strings() -> None:
    """Make every streamed text-completion chunk of an ``flm`` model carry ``choices[i].text`` as a
    string ("" on the final chunk, as OpenAI sends), never None. Idempotent.

    LiteLLM 1.110.2 builds a custom provider's final chunk itself (``CustomStreamWrapper``'s
    ``finish_reason_handler``, an empty ``Delta``) and ``TextCompletionStreamWrapper`` copies its
    ``content`` None into ``text``, so no chunk the handler yields can set it: the conversion is
    wrapped instead, for chunks LiteLLM marks as this provider's only.
    """
    convert = TextCompletionStreamWrapper.convert_to_text_completion_object
    if getattr(convert, "_flm_text_as_strings", False):
        return

    def convert_to_text_completion_object(self, chunk):
        response = convert(self, chunk)
        ours = (getattr(chunk, "_hidden_params", None) or {}).get("custom_llm_provider") == PROVIDER
        for choice in response.choices if ours or self.custom_llm_provider == PROVIDER else ():
            if choice.text is None:
                choice.text = ""
        return response

    convert_to_text_completion_object._flm_text_as_strings = True
    TextCompletionStreamWrapper.convert_to_text_completion_object = convert_to_text_completion_object


def _streams_named_as_served() -> None:
    """Make LiteLLM's stream wrapper of an ``flm`` model name it ``flm/<tag>`` (``served_name``),
    as the handler's own chunks and responses do. Idempotent.

    LiteLLM 1.110.2 gives a custom provider's ``CustomStreamWrapper`` the tag without its prefix
    and puts that on the chunks it builds itself (the finish_reason's, the usage's), so a stream
    would name two models and ``stream_chunk_builder`` would rebuild it under the bare tag, which
    LiteLLM cannot place (its "Provider List" banner, once per lookup). The wrapper's constructor
    is wrapped instead, for this provider only.
    """
    init = CustomStreamWrapper.__init__
    if getattr(init, "_flm_served_name", False):
        return
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("custom_llm_provider") == PROVIDER and isinstance(bound.arguments["model"], str):
            bound.arguments["model"] = served_name(bound.arguments["model"])
        init(*bound.args, **bound.kwargs)

    __init__._flm_served_name = True
    CustomStreamWrapper.__init__ = __init__


def _model_info_lists_the_supported_params() -> None:
    """Make LiteLLM's model info of an ``flm`` model (``litellm.get_model_info``, the proxy's
    ``/v1/model/info``) list the OpenAI parameters the handler supports
    (``params.SUPPORTED_OPENAI_PARAMS``). Idempotent.

    LiteLLM 1.110.2 gives every custom provider one OpenAI-compatible list (``OpenAILikeChatConfig``:
    ``functions``, ``audio``, ``prediction`` and more), which a model-cost entry cannot override.
    That list also decides what LiteLLM forwards to the handler, which refuses the rest naming them
    or drops them with ``drop_params`` (``params``), so only the model info's copy is replaced.
    """
    build = litellm.utils._build_model_info
    if getattr(build, "_flm_supported_params", False):
        return

    def _build_model_info(*args, **kwargs):
        info = build(*args, **kwargs)
        if info.get("litellm_provider") == PROVIDER:
            info["supported_openai_params"] = list(SUPPORTED_OPENAI_PARAMS)
        return info

    _build_model_info._flm_supported_params = True
    litellm.utils._build_model_info = _build_model_info
    litellm.get_model_info.cache_clear()  # an answer built before this one must not be kept


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
drain_on_sigterm()
