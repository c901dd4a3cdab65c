"""Every use of LiteLLM's internals, in one place: what the provider reads of LiteLLM's private
objects and undocumented keys, and the patches it makes to LiteLLM's classes and functions.

Each was written against LiteLLM ``LITELLM_VERSION``, the version pyproject.toml pins;
``check_version`` logs a warning under another. ``tests/litellm/test_compat.py`` holds one test per
patch and per private read, which fails, naming it, where another LiteLLM no longer does what it
relies on (``tests/litellm/test_flm_shutdown.py`` for the SIGTERM chain).

The patches (``register`` and the package's import apply them; each is idempotent):

- ``setup_custom_providers``: LiteLLM reads ``custom_provider_map`` only in ``custom_llm_setup``.
- ``stream_text_as_strings``: a streamed text completion's final chunk carries ``text`` "", not None.
- ``streams_named_as_served``: LiteLLM's stream wrapper names the stream ``flm/<tag>``.
- ``model_info_lists_supported_params``: the model info lists the parameters the handler supports.
- ``drain_on_sigterm``: a proxy's SIGTERM drains the engines before the server's own handler.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import litellm
from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper
from litellm.text_completions.streaming_iterator import TextCompletionStreamWrapper
from litellm.types.utils import GenericStreamingChunk

from flm_runtime import FlmError

from .errors import PROVIDER

_log = logging.getLogger(__name__)

LITELLM_VERSION = "1.110.2"  # the version every read and patch below was checked on (pyproject.toml pins it)
PROXY_SERVER = "litellm.proxy.proxy_server"  # the module a LiteLLM proxy's process has loaded
STATS_KEY = "flm_stats"  # a response's engine stats, in LiteLLM's _hidden_params


def check_version() -> bool:
    """Whether the installed LiteLLM is ``LITELLM_VERSION``; logs a warning naming both when not."""
    installed = importlib.metadata.version("litellm")
    if installed != LITELLM_VERSION:
        _log.warning("litellm %s is installed; litellm_flm's use of LiteLLM's internals (litellm_flm.compat) was "
                     "checked on %s only", installed, LITELLM_VERSION)
    return installed == LITELLM_VERSION


# --- reads of LiteLLM's objects -------------------------------------------------------------------

def sent_params(logging_obj: Any) -> Mapping[str, Any]:
    """The call's parameters as the caller sent them: LiteLLM's logging object keeps them
    (``Logging.model_call_details``) where ``optional_params`` has some renamed
    (``max_completion_tokens`` -> ``max_tokens``). Empty without a logging object."""
    sent = getattr(logging_obj, "model_call_details", None)
    return sent if isinstance(sent, Mapping) else {}


def sent_messages(messages: Any, logging_obj: Any) -> Any:
    """``messages`` without the roles LiteLLM filled in: its ``completion`` gives a message the
    caller sent without a role the role "assistant" before it calls the handler
    (``validate_and_fix_openai_messages``), and its logging object keeps the caller's messages
    (``Logging.messages``), so that ``params.normalize_messages`` refuses such a message instead of
    taking it for the assistant's."""
    sent = getattr(logging_obj, "messages", None)
    if not isinstance(sent, list) or not isinstance(messages, list) or len(sent) != len(messages):
        return messages
    return [{k: v for k, v in m.items() if k != "role"}
            if isinstance(m, Mapping) and isinstance(s, Mapping) and not s.get("role") else m
            for m, s in zip(messages, sent)]


def proxy_request_body(litellm_params: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The HTTP request's body behind a LiteLLM proxy (``litellm_params["proxy_server_request"]["body"]``),
    which keeps parameters LiteLLM dropped before calling the handler; empty elsewhere."""
    request = (litellm_params or {}).get("proxy_server_request")
    body = request.get("body") if isinstance(request, Mapping) else None
    return body if isinstance(body, Mapping) else {}


def put_stats(response: Any, stats: Any) -> None:
    """Attach the engine's stats to a response: ``response._hidden_params["flm_stats"]``, where
    LiteLLM keeps a response's provider-side extras (its cost among them) and a caller reads them."""
    response._hidden_params[STATS_KEY] = stats


def request_stats(response: Any) -> Any:
    """The stats ``put_stats`` attached to ``response`` (``RequestStats.as_dict``, or a list of
    them per choice).

    Raises:
        KeyError: the response carries none (not an ``flm`` model's).
    """
    return response._hidden_params[STATS_KEY]


def sibling_finish(index: int, finish_reason: str) -> GenericStreamingChunk:
    """The chunk that finishes choice ``index`` > 0 of a stream of several choices: LiteLLM
    ignores a GenericStreamingChunk's ``index`` but numbers the chunk by its ``choice_index`` key,
    and finishes that choice alone with its ``sibling_finish_reason`` (the keys its own OpenAI
    text-completion stream sets), where ``is_finished`` would end the stream."""
    chunk = GenericStreamingChunk(text="", is_finished=False, finish_reason="", index=index, tool_use=None, usage=None)
    chunk["choice_index"] = index
    chunk["sibling_finish_reason"] = finish_reason
    return chunk


# --- patches ---------------------------------------------------------------------------------------

def setup_custom_providers() -> None:
    """Make LiteLLM take up ``litellm.custom_provider_map`` now: it reads the map only in
    ``litellm.utils.custom_llm_setup``, which the proxy calls at startup and the SDK never."""
    litellm.utils.custom_llm_setup()


def stream_text_as_strings() -> None:
    """Make every streamed text-completion chunk of an ``flm`` model carry ``choices[i].text`` as a
    string ("" on the final chunk, as OpenAI sends), never None.

    LiteLLM builds a custom provider's final chunk itself (``CustomStreamWrapper``'s
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
    convert_to_text_completion_object.__wrapped__ = convert
    TextCompletionStreamWrapper.convert_to_text_completion_object = convert_to_text_completion_object


def streams_named_as_served(served_name: Callable[[str], str]) -> None:
    """Make LiteLLM's stream wrapper of an ``flm`` model name it ``served_name(tag)``
    (``flm/<tag>``), as the handler's own chunks and responses do.

    LiteLLM gives a custom provider's ``CustomStreamWrapper`` the tag without its prefix and puts
    that on the chunks it builds itself (the finish_reason's, the usage's), so a stream would name
    two models and ``stream_chunk_builder`` would rebuild it under the bare tag, which LiteLLM cannot
    place (its "Provider List" banner, once per lookup). The wrapper's constructor is wrapped
    instead, for this provider only.
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
    __init__.__wrapped__ = init
    CustomStreamWrapper.__init__ = __init__


def model_info_lists_supported_params(supported: Sequence[str]) -> None:
    """Make LiteLLM's model info of an ``flm`` model (``litellm.get_model_info``, the proxy's
    ``/v1/model/info``) list ``supported`` as its ``supported_openai_params``.

    LiteLLM gives every custom provider one OpenAI-compatible list (``OpenAILikeChatConfig``:
    ``functions``, ``audio``, ``prediction`` and more), which a model-cost entry cannot override.
    That list also decides what LiteLLM forwards to the handler, which refuses the rest naming them
    or drops them with ``drop_params`` (``params``), so only the model info's copy is replaced (in
    ``litellm.utils._build_model_info``).
    """
    build = litellm.utils._build_model_info
    if getattr(build, "_flm_supported_params", False):
        return

    def _build_model_info(*args, **kwargs):
        info = build(*args, **kwargs)
        if info.get("litellm_provider") == PROVIDER:
            info["supported_openai_params"] = list(supported)
        return info

    _build_model_info._flm_supported_params = True
    _build_model_info.__wrapped__ = build
    litellm.utils._build_model_info = _build_model_info
    litellm.get_model_info.cache_clear()  # an answer built before this one must not be kept


def drain_runtime() -> bool:
    """``flm_runtime.drain()``, imported when called: ``import litellm_flm`` stays cheap."""
    from flm_runtime import drain

    return drain()


def drain_on_sigterm(drain: Callable[[], bool] = drain_runtime) -> bool:
    """Wrap the SIGTERM handler of a LiteLLM proxy's process so that the signal starts ``drain``
    on a thread of its own (the server's event loop must go on streaming), then calls the handler
    it wrapped (uvicorn's, or LiteLLM's wrapper of it): chained, never replaced. Idempotent.

    What a proxy (``litellm --config``: uvicorn 0.54 under LiteLLM 1.110) does on SIGTERM: uvicorn's
    handler sets its exit flag, and within 0.1 s its main loop closes the listening socket (a new
    connection is refused from then on) and the idle connections, then waits for the responses
    under way, up to LiteLLM's ``GRACEFUL_SHUTDOWN_TIMEOUT`` (30 s by default), before it cancels
    what is left; then the app's shutdown, after which uvicorn raises SIGTERM again under the
    default handler, so the process ends by the signal (status -15), not with status 0. The
    engines refuse new requests at once with ``EngineDrainingError``, a 503 that a Router in front
    retries on another deployment, while the streams under way run to their end within
    ``FLM_DRAIN_TIMEOUT_S``; those left end with that error, and the engines close with their KV
    pools free.

    Installed only where a proxy serves: from the main thread of a process that loaded
    ``PROXY_SERVER``, with a Python SIGTERM handler to chain to (the proxy imports ``litellm_flm``
    when its lifespan loads the config, inside uvicorn's handlers). An SDK user's process keeps its
    signal handlers as they were.

    Args:
        drain: what the signal starts: ``flm_runtime.drain`` (its bound: ``FLM_DRAIN_TIMEOUT_S``);
            returns whether every request finished.

    Returns:
        whether the wrapper is in place.
    """
    if threading.current_thread() is not threading.main_thread() or PROXY_SERVER not in sys.modules:
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "drains_flm", False):
        return True
    if not callable(previous):  # no server's handler to chain to
        return False

    def drain_then_chain(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=_drain, args=(drain,), name="flm-drain").start()
        previous(signum, frame)

    drain_then_chain.drains_flm = True
    signal.signal(signal.SIGTERM, drain_then_chain)
    _log.info("SIGTERM drains the flm engines, then calls the server's handler")
    return True


def _drain(drain: Callable[[], bool]) -> None:
    """Run ``drain``, saying how it went."""
    try:
        finished = drain()
    except FlmError as e:  # a bad FLM_DRAIN_TIMEOUT_S: the server stops without a drain
        _log.error("the flm engines were not drained: %s", e)
        return
    _log.info("flm engines drained: %s", "every request finished" if finished else "the bound cut the requests left")
