"""Typed errors of the runtime.

The runtime never imports litellm; ``litellm_flm.errors`` maps each class below to the LiteLLM
exception a client expects (docs/design.md, "LiteLLM facts"). Every error carries enough
structured data for that mapping (the offending parameter, the token counts) and a message a user
can act on.
"""

from __future__ import annotations


class FlmError(Exception):
    """Base class of every error raised on purpose by ``flm_runtime``."""


class InvalidRequestError(FlmError, ValueError):
    """A request parameter is missing, of the wrong type or out of range.

    Attributes:
        param: name of the offending parameter as the caller spelled it (e.g. ``"top_p"``).
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt tokens + ``max_tokens`` exceed the model's context length (tokens), or with
    ``max_tokens`` None (unset) the prompt leaves no room for a completion; ``param`` names the
    prompt (``messages``, or ``input[i]`` for an embedding's text)."""

    def __init__(self, *, prompt_tokens: int, max_tokens: int | None, context_length: int, param: str = "messages"):
        if max_tokens is None:
            detail = f"the prompt has {prompt_tokens} tokens, which leaves no room for a completion"
        elif max_tokens == 0:  # a prompt that generates nothing (an embedding's text)
            detail = f"the text has {prompt_tokens} tokens"
        else:
            detail = (f"the prompt has {prompt_tokens} tokens and max_tokens asks for {max_tokens} more "
                      f"({prompt_tokens + max_tokens} in all)")
        super().__init__(f"this model's context length is {context_length} tokens; {detail}", param=param)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class KVBudgetError(InvalidRequestError):
    """A request whose KV cache could outgrow the engine's whole KV memory budget, even running
    alone (``flm_runtime.scheduling.admission``): no wait can help, only a smaller ``max_tokens`` (or
    ``n``) or a larger budget (``FLM_KV_BUDGET``).

    Attributes:
        prompt_tokens, max_tokens: the request (tokens); n: its choices, each a sequence.
        need_bytes: its KV cache at most, all choices (bytes); budget_bytes: the engine's budget
            (bytes).
    """

    def __init__(self, *, engine: str, prompt_tokens: int, max_tokens: int, need_bytes: int, budget_bytes: int,
                 bytes_per_token: int, n: int = 1):
        choices = f" for each of n={n} choices" if n > 1 else ""
        super().__init__(
            f"engine {engine!r}: the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}){choices} may need "
            f"{need_bytes:,} bytes of KV cache ({bytes_per_token:,} bytes per token), more than the engine's "
            f"whole KV budget of {budget_bytes:,} bytes ({budget_bytes // bytes_per_token} tokens); lower "
            f"max_tokens{' or n' if n > 1 else ''} or raise FLM_KV_BUDGET",
            param="max_tokens",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n = n
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes


class NoChatTemplateError(InvalidRequestError):
    """A chat request to a base model: its files carry no chat template, so there is no prompt
    format to render messages into; a text completion (the prompt's text, continued) runs.
    ``param`` is ``messages``."""

    def __init__(self) -> None:
        super().__init__(
            "this model is a base model without a chat template: it continues text and cannot answer "
            "chat messages; send the text as a text completion instead (litellm.text_completion, "
            "/v1/completions, or `litellm-flm run`, which continues the prompt of such a model)",
            param="messages")


class UnknownModelError(FlmError, LookupError):
    """A model tag that no registry (built-in, user file, entry point) defines."""


class ModelFilesMissingError(FlmError, FileNotFoundError):
    """A registered model whose files are not installed and cannot be pulled automatically."""


class ModelDownloadError(FlmError):
    """Fetching or verifying a model file failed; nothing was left in the model cache."""


class ModelFormatError(FlmError, ValueError):
    """A model file is unreadable, of an unsupported architecture or quantization, or inconsistent."""


class EngineOverloadedError(FlmError):
    """The engine's queue or KV memory budget is full; retry later."""


class RequestTimeoutError(FlmError, TimeoutError):
    """A request ran past its deadline (seconds) and was cancelled."""


class BackendUnavailableError(FlmError):
    """The chosen backend cannot run (no device, failed kernel load, engine stopped)."""


class DiskSpaceError(BackendUnavailableError):
    """A file the runtime keeps (a model being pulled, a model's converted weights) does not fit
    on its disk: nothing of it was left there. A 503 through LiteLLM: this host cannot serve the
    model until space is freed, another may.

    Attributes:
        path: the file that was being written; need_bytes: its size (bytes); free_bytes: what its
            folder's file system had free for this user when the write failed (bytes).
    """

    def __init__(self, path, *, need_bytes: int, free_bytes: int):
        super().__init__(f"not enough disk space for {path}: it needs {need_bytes:,} bytes and "
                         f"{path.parent} has {free_bytes:,} free; free some space there, or set "
                         "FLM_MODEL_PATH to a folder on a larger disk")
        self.path = path
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes


class EngineDrainingError(BackendUnavailableError):
    """The engine is shutting down (``Engine.drain``): it takes no new request, and a request it
    could not finish within the drain's bound ends with this error; retry on another deployment."""


class EngineFaultError(FlmError):
    """The engine's step raised for this request (a kernel error, a bug) and the engine failed it
    alone; the engine and the other requests go on. Its ``__cause__`` is what was raised."""
