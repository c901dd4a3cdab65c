"""What the provider reads of LiteLLM's private objects, in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
