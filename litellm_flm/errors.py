"""Runtime errors -> the LiteLLM exceptions clients, the Router and the proxy act on.

The choice of class decides what LiteLLM does next (docs/design.md, "LiteLLM facts"):

- ``ContextWindowExceededError`` (over the context, or over the engine's whole KV memory budget)
  fires the Router's ``context_window_fallbacks``;
- ``RateLimitError`` (429) and ``ServiceUnavailableError`` (503) are retried and put the deployment
  in cooldown, so a full queue, a backend that is down or an engine that is shutting down
  (``EngineDrainingError``, a ``BackendUnavailableError``) sends traffic elsewhere for a while;
- ``BadRequestError`` / ``NotFoundError`` are the caller's to fix: no retry helps (a model file
  that cannot be read, ``ModelFormatError``, is a ``BadRequestError`` with ``param`` ``model``:
  the user's files are to fix, not the server);
- ``InternalServerError`` (500): the engine failed on this request (``EngineFaultError``: a kernel
  error or a bug, chained), or any other runtime error.

LiteLLM passes its own exception types through unchanged (``exception_type`` returns them as they
are), so what we raise here is what the caller catches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import litellm

from flm_runtime import (BackendUnavailableError, ContextLengthError, EngineOverloadedError, FlmError,
                         InvalidRequestError, KVBudgetError, ModelDownloadError, ModelFilesMissingError,
                         ModelFormatError, RequestTimeoutError, UnknownModelError)

PROVIDER = "flm"


def to_litellm(error: FlmError, model: str) -> Exception:
    """The LiteLLM exception for one runtime error (not raised: the caller raises it ``from error``).

    Args:
        error: what the runtime raised.
        model: the model as LiteLLM names it to the handler (the tag, e.g. ``"smollm2:135m"``).
    """
    msg = str(error)
    kw = {"message": msg, "model": model, "llm_provider": PROVIDER}
    # Order matters: both are InvalidRequestErrors. A request over the KV budget is over this
    # deployment's effective context (its memory cannot hold it even alone), so it fires the
    # Router's context_window_fallbacks too; with param "max_tokens", the value to lower.
    if isinstance(error, (ContextLengthError, KVBudgetError)):
        body = {"message": msg, "type": "invalid_request_error", "param": error.param,
                "code": "context_length_exceeded"}
        exc = litellm.ContextWindowExceededError(**kw, body=body)
        # Its constructor prefixes the message twice ("litellm.ContextWindowExceededError:
        # litellm.BadRequestError: ..."): once is what every other LiteLLM error carries.
        exc.message = f"litellm.ContextWindowExceededError: {msg}"
        exc.args = (exc.message,)
        return exc
    if isinstance(error, InvalidRequestError):
        if error.param and error.param not in msg:
            kw["message"] = f"{error.param}: {msg}"
        # The OpenAI error body's "param" (openai's APIError reads it into ``exc.param``).
        body = {"message": kw["message"], "type": "invalid_request_error", "param": error.param, "code": None}
        return litellm.BadRequestError(**kw, body=body)
    if isinstance(error, ModelFormatError):
        body = {"message": msg, "type": "invalid_request_error", "param": "model", "code": None}
        return litellm.BadRequestError(**kw, body=body)
    if isinstance(error, RequestTimeoutError):
        return litellm.Timeout(**kw)
    if isinstance(error, EngineOverloadedError):
        # 429: the engine is healthy but its queue / KV budget is full; retry after a while.
        return litellm.RateLimitError(**kw)
    if isinstance(error, (BackendUnavailableError, ModelDownloadError)):
        return litellm.ServiceUnavailableError(**kw)
    if isinstance(error, UnknownModelError):
        return litellm.NotFoundError(**{**kw, "message": f"{msg} (`litellm-flm list` shows the known tags)"})
    if isinstance(error, ModelFilesMissingError):
        # Not installed, and not pulled on use: a retry cannot help, so not a 503. The message already
        # says how to install it (`litellm-flm pull`, or where to put files that have no download).
        return litellm.NotFoundError(**kw)
    # Anything else (EngineFaultError among them): our side is broken, and retrying will not mend it.
    return litellm.InternalServerError(**kw)


@contextmanager
def litellm_errors(model: str) -> Iterator[None]:
    """Re-raise any ``FlmError`` raised inside the block as its LiteLLM exception, chained."""
    try:
        yield
    except FlmError as e:
        raise to_litellm(e, model) from e
