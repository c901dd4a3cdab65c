"""OpenAI chat parameters -> the runtime's ``SamplingParams``, and chat messages -> template input.

LiteLLM hands a custom provider the caller's parameters in ``optional_params``, already partly
rewritten (checked on litellm 1.110.2):

- ``max_completion_tokens`` arrives renamed to ``max_tokens``;
- non-OpenAI keys (``top_k``, ``min_p``) arrive at the top level, but keys sent through
  ``extra_body`` (the OpenAI SDK's way, and the proxy's) arrive nested in ``extra_body``;
- the Router adds ``stream`` and ``max_retries``; ``user`` and ``metadata`` go elsewhere, but may
  still show up from other callers.

Every key is then one of: *mapped* (``OPENAI_TO_RUNTIME``), an *output* key (``OUTPUT_KEYS``:
response format and tools, read by ``litellm_flm.structured``), *ignored* (``IGNORED``), *accepted only
at its neutral value* (``NEUTRAL_ONLY``), a *deployment* key that chooses where the model runs
rather than how it samples (``DEPLOYMENT_KEYS``: ``backend``, read by ``backend_of``), a switch of a reasoning
model's thinking (``REASONING_PARAMS``, read by ``requested_thinking``), ``n`` (the choices per
prompt, read by ``choices_of``), ``return_token_ids`` (read by ``returns_token_ids``), ``suffix`` (a text
completion's fill-in-the-middle, read by ``fim_suffix``), or rejected. Anything rejected raises
``InvalidRequestError`` naming the parameter, which ``litellm_flm.errors`` turns into
``litellm.BadRequestError``. Range checks live in ``SamplingParams`` itself and the default sampler
in the runtime (``SamplingDefaults``, per model): one place each.

``drop_params``: LiteLLM decides what to drop from a provider's supported-parameter list, but for
every custom provider it uses the same OpenAI-compatible list (litellm 1.110.2 has no hook for a
``CustomLLM`` to give its own), which names everything in ``NEUTRAL_ONLY``. So LiteLLM passes those
through, and ``request_fields(..., drop_unsupported=True)`` drops them here instead: the effect
LiteLLM's ``drop_params`` has on a built-in provider whose list is ``SUPPORTED_OPENAI_PARAMS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from flm_runtime import FALLBACK_SAMPLING, InvalidRequestError, SamplingDefaults, SamplingParams, requested_backend

# OpenAI (or extra_body) name -> SamplingParams field. Everything the runtime acts on.
OPENAI_TO_RUNTIME: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",  # not OpenAI; vLLM / Ollama spelling, via extra_body or litellm's passthrough
    "min_p": "min_p",  # same
    "seed": "seed",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",  # litellm renames it, but other callers may not
    "stop": "stop",
    "ignore_eos": "ignore_eos",  # not OpenAI; for benchmarks (vLLM spelling)
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",  # not OpenAI; vLLM / HF spelling, via extra_body
    "logit_bias": "logit_bias",  # token id (a string of digits in JSON) -> [-100, 100]
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}

# Keys that carry no meaning for a local model, or that LiteLLM / the Router handles itself
# (the Router adds max_retries to every call; stream is decided by which method LiteLLM calls;
# usage is always on the last chunk, whatever stream_options says).
IGNORED: frozenset[str] = frozenset(
    {
        "stream", "stream_options", "max_retries", "user", "safety_identifier", "metadata", "store",
        "service_tier", "prompt_cache_key", "prompt_cache_retention",
    }
)

# Known OpenAI parameters we do not implement: accepted only at the value that means "off", so a
# client that always sends the default still works; anything else is refused rather than ignored,
# or dropped when the caller asks for drop_params.
NEUTRAL_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "functions (function calling) are not supported"),
    "function_call": (("none",), "function_call is not supported (functions are not supported)"),
    "modalities": ((["text"],), "only text output is supported (modalities=['text'])"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "prediction (predicted outputs) is not supported"),
    "web_search_options": ((), "web_search_options (web search) is not supported"),
}

# The switches of a reasoning model's thinking, read by ``requested_thinking``. LiteLLM refuses
# both itself for a custom provider (UnsupportedParamsError, or drops them with drop_params)
# unless the call or the deployment lets them by with allowed_openai_params, or they come in
# extra_body.
REASONING_PARAMS: tuple[str, ...] = ("reasoning_effort", "thinking")

# reasoning_effort -> thinking on (True) or off (False); None leaves the template's default. A
# template's switch has no levels: LiteLLM's own ollama_chat maps low/medium/high to on and none
# to off the same way; minimal (OpenAI's "very few reasoning tokens") is off, the nearer of the two.
REASONING_EFFORTS: dict[str, bool | None] = {
    "none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True, "max": True,
    "default": None,
}

# The number of choices per prompt: a request-level key, not a SamplingParams field (choices_of).
CHOICES_KEY = "n"

# vLLM's switch (not OpenAI's) for the response to carry the prompt's and each choice's token ids
# (returns_token_ids); it changes what is returned, not what is generated.
TOKEN_IDS_KEY = "return_token_ids"

# A text completion's text after the gap to fill (OpenAI's legacy completions parameter): a
# request-level key, read by fim_suffix. LiteLLM's text_completion puts it at the top level.
SUFFIX_KEY = "suffix"

# The keys of OPENAI_TO_RUNTIME that are not OpenAI parameters (vLLM / Ollama spellings).
NON_OPENAI: frozenset[str] = frozenset({"top_k", "min_p", "ignore_eos", "repetition_penalty"})

# The OpenAI chat parameters this provider honours at every valid value: what LiteLLM's
# get_supported_openai_params would answer for a built-in provider. NEUTRAL_ONLY is the "not yet
# supported" rest (README.md, "Parameters").
OUTPUT_KEYS: frozenset[str] = frozenset({"response_format", "tools", "tool_choice", "parallel_tool_calls"})
SUPPORTED_OPENAI_PARAMS: tuple[str, ...] = tuple(
    sorted((set(OPENAI_TO_RUNTIME) | IGNORED | OUTPUT_KEYS | {CHOICES_KEY}) - NON_OPENAI)
)

# Keys that choose where the model runs: a Router deployment's litellm_params (they arrive at the
# top level of optional_params) or a request's extra_body. backend: auto | cpu | npu, as FLM_BACKEND.
DEPLOYMENT_KEYS: frozenset[str] = frozenset({"backend"})

MAX_STOP_STRINGS = 4  # OpenAI's limit: a request valid here stays valid for a cloud fallback model


class ChatParams(BaseModel):
    """The mapped parameters, type-checked (strict: no "0.5" strings, no floats for integers)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str | int, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def merge_extra_body(optional_params: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten ``extra_body`` into the top level; a key given in both places with two values is an error."""
    flat = {k: v for k, v in optional_params.items() if k != "extra_body"}
    extra = optional_params.get("extra_body") or {}
    if not isinstance(extra, Mapping):
        raise InvalidRequestError(f"extra_body must be an object, got {type(extra).__name__}", param="extra_body")
    for key, value in extra.items():
        if key in flat and flat[key] != value:
            raise InvalidRequestError(
                f"{key} is given twice with different values ({flat[key]!r} and {value!r} in extra_body)",
                param=key,
            )
        flat[key] = value
    return flat


def request_fields(optional_params: Mapping[str, Any], drop_unsupported: bool = False) -> dict[str, Any]:
    """Validate LiteLLM's ``optional_params`` into the ``SamplingParams`` fields the request sets.

    Args:
        optional_params: as LiteLLM passes them to a ``CustomLLM`` (``extra_body`` nested).
        drop_unsupported: the caller's ``drop_params``: leave out the known OpenAI parameters we do
            not support (``NEUTRAL_ONLY``) at any value instead of refusing them. Unknown keys are
            still refused, as LiteLLM's own ``drop_params`` drops only OpenAI parameters.

    Returns:
        ``SamplingParams`` keyword arguments, runtime names, only those the request gave (``stop``
        as a tuple). The model's default sampler fills the rest: ``Engine.sampling_params``, field
        by field (a request setting only ``temperature=0.7`` keeps the model's top_k / top_p).
        ``max_tokens`` left unset means up to the context: no hidden cap (docs/design.md,
        "Contract", 4).

    Raises:
        InvalidRequestError: an unknown, unsupported or mistyped parameter; ``param`` names it as the
            caller spelled it. Ranges are checked later, by ``SamplingParams`` itself.
    """
    flat = {k: v for k, v in merge_extra_body(optional_params).items()
            if v is not None and k not in IGNORED and k not in DEPLOYMENT_KEYS and k not in REASONING_PARAMS
            and k not in OUTPUT_KEYS and k not in (CHOICES_KEY, TOKEN_IDS_KEY, SUFFIX_KEY)}
    mapped: dict[str, Any] = {}
    for key, value in flat.items():
        if key in OPENAI_TO_RUNTIME:
            mapped[key] = value
        elif key in NEUTRAL_ONLY and drop_unsupported:
            continue
        elif key in NEUTRAL_ONLY:
            neutral, why = NEUTRAL_ONLY[key]
            if not _is_neutral(value, neutral):
                raise InvalidRequestError(f"{why}; got {key}={value!r}", param=key)
        else:
            raise InvalidRequestError(f"unknown or unsupported parameter {key!r} for provider flm", param=key)
    renamed = "max_completion_tokens" in mapped
    if renamed:
        if "max_tokens" in mapped:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
        mapped["max_tokens"] = mapped.pop("max_completion_tokens")

    try:
        checked = ChatParams(**mapped)
    except ValidationError as e:
        raise _first_error(e, "max_completion_tokens" if renamed else "max_tokens") from e
    fields = checked.model_dump(exclude_none=True)
    if "stop" in fields:
        fields["stop"] = _stop_tuple(checked.stop)
    if "logit_bias" in fields:
        fields["logit_bias"] = _token_ids(checked.logit_bias)
    return fields


def requested_thinking(optional_params: Mapping[str, Any]) -> tuple[bool, str] | None:
    """Whether the request turns a reasoning model's thinking on (True) or off (False), and the
    parameter that says so; None leaves the model's chat template to its default.

    ``reasoning_effort`` maps through ``REASONING_EFFORTS``; Anthropic's ``thinking`` is
    ``{"type": "enabled", "budget_tokens": N}`` (on), ``{"type": "disabled"}`` (off) or
    ``{"type": "adaptive"}`` (the model decides: the template's default). ``budget_tokens`` is
    accepted but not enforced: the model ends its own thinking, and ``max_tokens`` bounds the
    whole reply.

    Raises:
        InvalidRequestError: a value not understood (``param`` names it, e.g. ``thinking.type``),
            or the two parameters asking for opposite things (``param`` ``thinking``).
    """
    flat = merge_extra_body(optional_params)
    asked: list[tuple[bool, str]] = []
    effort = flat.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
                                      param="reasoning_effort")
        if REASONING_EFFORTS[effort] is not None:
            asked.append((REASONING_EFFORTS[effort], "reasoning_effort"))
    thinking = flat.get("thinking")
    if thinking is not None and (on := _thinking_type(thinking)) is not None:
        asked.append((on, "thinking"))
    if len(asked) == 2 and asked[0][0] != asked[1][0]:
        raise InvalidRequestError(f"reasoning_effort={effort!r} and thinking={thinking!r} ask for opposite things; "
                                  "give one of them", param="thinking")
    return asked[0] if asked else None


THINKING_TYPES: dict[str, bool | None] = {"enabled": True, "disabled": False, "adaptive": None}


def _thinking_type(thinking: Any) -> bool | None:
    """Anthropic's ``thinking`` parameter -> on (True), off (False) or the template's default (None)."""
    if not isinstance(thinking, Mapping) or thinking.get("type") not in THINKING_TYPES:
        got = thinking.get("type") if isinstance(thinking, Mapping) else thinking
        raise InvalidRequestError(f"thinking must be {{'type': one of {list(THINKING_TYPES)}}}, got {got!r}",
                                  param="thinking.type")
    allowed = {"type", "budget_tokens"} if thinking["type"] == "enabled" else {"type"}
    for key in thinking:
        if key not in allowed:
            raise InvalidRequestError(f"thinking of type {thinking['type']!r} takes no {key!r}",
                                      param=f"thinking.{key}")
    budget = thinking.get("budget_tokens")
    if budget is not None and (type(budget) is not int or budget < 1):
        raise InvalidRequestError(f"thinking.budget_tokens must be a positive integer, got {budget!r}",
                                  param="thinking.budget_tokens")
    return THINKING_TYPES[thinking["type"]]


def choices_of(optional_params: Mapping[str, Any]) -> int:
    """OpenAI's ``n``: how many choices to generate for each prompt (1 when unset). The engine
    bounds it by how many sequences it runs at once (``max_active``).

    Raises:
        InvalidRequestError: not an integer >= 1 (``param`` is ``n``).
    """
    value = merge_extra_body(optional_params).get(CHOICES_KEY)
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise InvalidRequestError(f"n must be an integer >= 1, got {value!r}", param=CHOICES_KEY)
    return value


def returns_token_ids(optional_params: Mapping[str, Any]) -> bool:
    """vLLM's ``return_token_ids`` (via ``extra_body``; False when unset): the response carries
    ``prompt_token_ids`` and each choice its ``token_ids`` (``litellm_flm.llm``).

    Raises:
        InvalidRequestError: not a boolean (``param`` is ``return_token_ids``).
    """
    value = merge_extra_body(optional_params).get(TOKEN_IDS_KEY)
    if value is None:
        return False
    if type(value) is not bool:
        raise InvalidRequestError(f"return_token_ids must be true or false, got {value!r}", param=TOKEN_IDS_KEY)
    return value


def fim_suffix(optional_params: Mapping[str, Any]) -> str | None:
    """A text completion's ``suffix`` (top level or ``extra_body``): the text that follows the
    one to generate, for a fill-in-the-middle prompt; None when unset. An empty suffix is a gap at
    the end of the text.

    Raises:
        InvalidRequestError: not a string (``param`` is ``suffix``).
    """
    value = merge_extra_body(optional_params).get(SUFFIX_KEY)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"suffix must be a string, got {value!r}", param=SUFFIX_KEY)
    return value


def backend_of(optional_params: Mapping[str, Any]) -> str | None:
    """The ``backend`` the deployment or request names (``auto``, ``cpu``, ``npu``), or None
    (then ``$FLM_BACKEND``, default ``auto``, decides).

    Raises:
        InvalidRequestError: another value (``param`` is ``backend``).
    """
    value = merge_extra_body(optional_params).get("backend")
    return None if value is None else requested_backend(value)


def to_sampling_params(optional_params: Mapping[str, Any], defaults: SamplingDefaults | None = None) -> SamplingParams:
    """``request_fields`` resolved against a default sampler (``FALLBACK_SAMPLING`` when None).

    Raises:
        InvalidRequestError: as ``request_fields``, or a value out of range, naming the parameter.
    """
    return (defaults or FALLBACK_SAMPLING).resolve(**request_fields(optional_params))


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # Equal is not enough (in Python True == 1 and False == 0): the value must have the neutral one's type too.
    return any(type(value) is type(n) and value == n for n in neutral)


def _stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop strings must not be empty", param="stop")
    return stops


def _token_ids(bias: dict[str | int, float]) -> dict[int, float]:
    """``logit_bias`` with its keys as ints: JSON (OpenAI's SDK, the proxy) sends ``{"1234": -100}``."""
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _first_error(e: ValidationError, max_tokens_name: str) -> InvalidRequestError:
    """The first pydantic error, named as the caller spelled the parameter."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else "request"
    if param == "max_tokens":
        param = max_tokens_name
    return InvalidRequestError(f"{param}: {err['msg']}, got {err.get('input')!r}", param=param)


ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> ``[{"role", "content"}]`` (and an assistant's ``tool_calls``) for
    ``flm_runtime.text.tool_format.chat_messages`` and the model's chat template.

    ``developer`` is OpenAI's newer name for ``system``. ``tool`` messages (the results of calls)
    and an assistant's ``tool_calls`` are kept; the deprecated ``function`` messages and
    ``function_call`` are refused. Every message needs a ``role``, and every one but an assistant's
    a ``content`` (OpenAI's rule). Content is passed on as given: the runtime's template renderer
    flattens text parts and refuses images and audio.

    Raises:
        InvalidRequestError: with ``param`` naming the message and the key, e.g. ``messages[2].role``.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"{where} must be an object with role and content", param=where)
        role = msg.get("role")
        if role is None:
            raise InvalidRequestError(f"{where}.role is missing; give one of {sorted(ROLE_ALIASES)}",
                                      param=f"{where}.role")
        if role not in ROLE_ALIASES:
            raise InvalidRequestError(
                f"{where}.role {role!r} is not supported; use one of {sorted(ROLE_ALIASES)}", param=f"{where}.role"
            )
        if msg.get("function_call"):
            raise InvalidRequestError(f"{where}.function_call (deprecated) is not supported; use tool_calls",
                                      param=f"{where}.function_call")
        tool_calls = msg.get("tool_calls")
        if tool_calls and (role != "assistant" or not isinstance(tool_calls, list)):
            raise InvalidRequestError(f"{where}.tool_calls must be a list on an assistant message",
                                      param=f"{where}.tool_calls")
        if msg.get("content") is None and role != "assistant":  # OpenAI's rule: only an assistant's is optional
            raise InvalidRequestError(f"{where}.content is missing; a {role} message needs it",
                                      param=f"{where}.content")
        out.append({"role": ROLE_ALIASES[role], "content": msg.get("content")}
                   | ({"tool_calls": tool_calls} if tool_calls else {}))
    return out


def raw_prompts(messages: Any, allow_empty: bool = False) -> list[str]:
    """The prompts of a text completion, as LiteLLM hands them to a custom provider: one
    ``{"role": "user", "content": prompt}`` message per prompt string (a prompt of token ids
    LiteLLM refuses itself).

    Args:
        allow_empty: accept an empty prompt (a fill-in-the-middle prefix: the gap opens the text).

    Raises:
        InvalidRequestError: ``param`` ``prompt`` (one prompt) or ``prompt[i]``: not a text prompt
            or, unless allowed, an empty prompt.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("prompt must be a string or a non-empty list of strings", param="prompt")
    prompts = []
    for i, msg in enumerate(messages):
        where = "prompt" if len(messages) == 1 else f"prompt[{i}]"
        content = msg.get("content") if isinstance(msg, Mapping) and msg.get("role") == "user" else None
        if not isinstance(content, str):
            raise InvalidRequestError(f"{where} must be a string", param=where)
        if not content and not allow_empty:
            raise InvalidRequestError(f"{where} is empty; give the text to continue", param=where)
        prompts.append(content)
    return prompts


ENCODING_FORMATS = ("float", "base64")


def embedding_inputs(input: Any) -> list[str | list[int]]:
    """OpenAI's embedding ``input`` -> one item per text: a string, or a text already tokenized
    (a list of token ids), as OpenAI accepts them (a string, a list of strings, a list of token
    ids, a list of such lists).

    Raises:
        InvalidRequestError: ``param`` ``input`` or ``input[i]``: no texts, an empty string, or an
            item of another type.
    """
    if isinstance(input, str) or (isinstance(input, list) and input and all(_is_token_id(t) for t in input)):
        input = [input]
    if not isinstance(input, list) or not input:
        raise InvalidRequestError("input must be a string or a non-empty list of strings or token-id lists",
                                  param="input")
    for i, item in enumerate(input):
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"input[{i}] is an empty string", param=f"input[{i}]")
        elif not (isinstance(item, list) and item and all(_is_token_id(t) for t in item)):
            raise InvalidRequestError(f"input[{i}] must be a non-empty string or a non-empty list of token ids",
                                      param=f"input[{i}]")
    return input


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encoding_format(optional_params: Mapping[str, Any], request_body: Mapping[str, Any] | None) -> str:
    """The embedding's ``encoding_format``: ``float`` (the default) or ``base64`` (little-endian
    float32 bytes, as OpenAI's).

    LiteLLM refuses ``encoding_format`` for a custom provider unless it is dropped (``drop_params``,
    or ``additional_drop_params: [encoding_format]`` on the deployment), and a dropped one never
    reaches the handler; behind the proxy the caller's value is still in the HTTP request's body
    (``request_body``, the proxy's ``proxy_server_request["body"]``), so it is read from there.

    Raises:
        InvalidRequestError: another value, or another parameter in ``optional_params`` (an
            embedding takes no sampling parameter); ``param`` names it.
    """
    flat = {k: v for k, v in merge_extra_body(optional_params).items()
            if v is not None and k not in IGNORED and k not in DEPLOYMENT_KEYS}
    value = flat.pop("encoding_format", None)
    if flat:
        key = next(iter(flat))
        raise InvalidRequestError(f"unknown or unsupported embedding parameter {key!r} for provider flm", param=key)
    if value is None and isinstance(request_body, Mapping):
        value = request_body.get("encoding_format")
    if value is None:
        return "float"
    if value not in ENCODING_FORMATS:
        raise InvalidRequestError(f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {value!r}",
                                  param="encoding_format")
    return value
