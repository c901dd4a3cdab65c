"""One parse of a LiteLLM call: ``parse_request`` reads every key of the request once, from one
table (``KEYS``), into a ``ChatRequest``; the handler then renders, submits and responds
(``litellm_flm.llm``).

LiteLLM hands a custom provider the caller's parameters in ``optional_params``, already partly
rewritten (checked on litellm 1.110.2):

- ``max_completion_tokens`` arrives renamed to ``max_tokens`` (``ChatRequest.names`` keeps the
  caller's name for the errors);
- non-OpenAI keys (``top_k``, ``min_p``) arrive at the top level, but keys sent through
  ``extra_body`` (the OpenAI SDK's way, and the proxy's) arrive nested in ``extra_body``, which is
  merged once (``merge_extra_body``);
- the Router adds ``stream`` and ``max_retries``; ``user`` and ``metadata`` go elsewhere, but may
  still show up from other callers.

Every key is one row of ``KEYS``, of one kind: a ``SamplingParams`` field (``SAMPLING``, checked
together by ``ChatParams``), an option (``OPTION``: a ``ChatRequest`` field of the key's name
with its own reader, declared there with ``option``), a part of the thinking switch
(``THINKING``, ``requested_thinking``) or of what the output is held to (``OUTPUT``,
``litellm_flm.structured``), ``IGNORED``, or ``NEUTRAL_ONLY`` (a known OpenAI parameter accepted
only at its "off" value). Any other key is refused. A refusal raises ``InvalidRequestError``
naming the parameter as the caller sent it, which ``litellm_flm.errors`` turns into
``litellm.BadRequestError``. Range checks live in ``SamplingParams`` itself and the default
sampler in the runtime (``SamplingDefaults``, per model): one place each.

``drop_params``: LiteLLM decides what to drop from a provider's supported-parameter list, but for
every custom provider it uses the same OpenAI-compatible list (litellm 1.110.2 has no hook for a
``CustomLLM`` to give its own), which names every ``NEUTRAL_ONLY`` key. So LiteLLM passes those
through, and ``parse_request`` drops them when the caller asks: the effect LiteLLM's
``drop_params`` has on a built-in provider whose list is ``SUPPORTED_OPENAI_PARAMS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import litellm
from pydantic import BaseModel, ConfigDict, ValidationError

from flm_runtime import InvalidRequestError, requested_backend

from . import compat
from .structured import OutputFormat, output_format

# The kinds of key (``Key.kind``).
SAMPLING = "sampling"  # a SamplingParams field (Key.field), checked with the others by ChatParams
OPTION = "option"  # a ChatRequest field of the key's name, read by its own reader (``option``)
THINKING = "thinking"  # a reasoning model's thinking switch, read with the other by requested_thinking
OUTPUT = "output"  # what the output is held to, read with the others by structured.output_format
IGNORED = "ignored"  # no meaning for a local model, or LiteLLM / the Router handles it
NEUTRAL_ONLY = "neutral_only"  # a known OpenAI parameter we do not implement: accepted only "off"


class Key(NamedTuple):
    """How ``parse_request`` reads one request key (at the top level or in ``extra_body``).

    Attributes:
        kind: ``SAMPLING``, ``OPTION``, ``THINKING``, ``OUTPUT``, ``IGNORED`` or ``NEUTRAL_ONLY``.
        listed: an OpenAI chat parameter this provider honours at every valid value, listed in
            ``SUPPORTED_OPENAI_PARAMS``.
        field: ``SAMPLING``: the ``SamplingParams`` field.
        read: ``OPTION``: ``read(key, value)`` checks a value (not None) and returns the field's.
        neutral: ``NEUTRAL_ONLY``: the values that mean "off", the only ones accepted.
        why: ``NEUTRAL_ONLY``: why another value is refused.
    """

    kind: str
    listed: bool = False
    field: str = ""
    read: Callable[[str, Any], Any] | None = None
    neutral: tuple[Any, ...] = ()
    why: str = ""


# Readers of an OPTION: the value of request key ``key`` as the field holds it; each raises
# InvalidRequestError naming ``key`` for a value it does not take.

def positive_int(key: str, value: Any) -> int:
    """An integer of at least 1 (not a bool, not a float)."""
    if type(value) is not int or value < 1:
        raise InvalidRequestError(f"{key} must be an integer >= 1, got {value!r}", param=key)
    return value


def boolean(key: str, value: Any) -> bool:
    """True or False (not 0 or 1)."""
    if type(value) is not bool:
        raise InvalidRequestError(f"{key} must be true or false, got {value!r}", param=key)
    return value


def string(key: str, value: Any) -> str:
    """A string, the empty one included."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{key} must be a string, got {value!r}", param=key)
    return value


def predicted_content(key: str, value: Any) -> str:
    """OpenAI's predicted output, ``{"type": "content", "content": text}`` (the text a string or a
    list of ``{"type": "text", "text": ...}`` parts, joined): the text."""
    content = value.get("content") if isinstance(value, Mapping) and value.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequestError(f'{key} must be {{"type": "content", "content": <text or text parts>}}, '
                                  f"got {value!r}", param=key)
    return content


def backend_name(key: str, value: Any) -> str:
    """``auto``, ``cpu`` or ``npu``, as ``FLM_BACKEND`` (``flm_runtime.requested_backend`` names ``backend``)."""
    return requested_backend(value)


def option(default: Any, read: Callable[[str, Any], Any], *, listed: bool = False) -> Any:
    """A ``ChatRequest`` field that is the request key of its name (``KEYS`` holds it as an
    ``OPTION``): ``read(key, value)`` checks the value the request gives, ``default`` stands where
    it gives none (or None); ``listed`` as ``Key.listed``."""
    return field(default=default, metadata={"read": read, "listed": listed})


@dataclass(frozen=True)
class ChatRequest:
    """A chat or text completion as ``parse_request`` read it: all the handler renders and submits.

    Attributes:
        messages: a chat's messages (``normalize_messages``); None for a text completion.
        prompts: a text completion's prompts (``raw_prompts``, one engine request each); None for a chat.
        sampling: the ``SamplingParams`` fields the request sets (runtime names, ``stop`` a tuple,
            ``logit_bias`` keyed by token id); the model's default sampler fills the rest
            (``Engine.sampling_params``, field by field). ``max_tokens`` left unset takes the
            model's default output limit, cut to what the prompt leaves of the context
            (``flm_runtime.with_output_limit``; docs/design.md, "Contract", 4).
        thinking: (on, the parameter that asked) or None: the template's default (``requested_thinking``).
        output: what the output is held to, and whether its answers hold tool calls.
        drop: the caller's ``drop_params``: what the request asks that the model cannot do is left
            out (a thinking switch it lacks, ``litellm_flm.reasoning.template_switch``).
        names: the runtime's name of a parameter -> the caller's, where the caller sent it under
            another (``max_completion_tokens``): ``named_as_sent`` of the errors raised after the parse.
        n: OpenAI's ``n``, the choices per prompt (the engine bounds it by ``max_active``).
        return_token_ids: vLLM's switch: the response carries the prompt's and each choice's token ids.
        suffix: a text completion's fill-in-the-middle suffix (empty: a gap at the end of the text).
        backend: the backend the deployment or request names (a Router deployment's
            ``litellm_params`` arrive at the top level); None: ``$FLM_BACKEND`` decides.
        prediction: OpenAI's predicted output, its text (``predicted_content``), which the engine
            proposes for verification (``SamplingParams.prediction``); None: none.
        speculation: False (``extra_body``): decode this request plainly
            (``SamplingParams.speculation``); the tokens are the same either way.
    """

    messages: list[dict[str, Any]] | None
    prompts: list[str] | None
    sampling: dict[str, Any] = field(default_factory=dict)
    thinking: tuple[bool, str] | None = None
    output: OutputFormat = OutputFormat()
    drop: bool = False
    names: dict[str, str] = field(default_factory=dict)
    # Options: each the request key of its name (``option``). A new key is one line here, and its use.
    n: int = option(1, positive_int, listed=True)
    return_token_ids: bool = option(False, boolean)
    suffix: str | None = option(None, string)
    backend: str | None = option(None, backend_name)
    prediction: str | None = option(None, predicted_content, listed=True)
    speculation: bool = option(True, boolean)

    @property
    def text_completion(self) -> bool:
        return self.prompts is not None


# Every key a request may set: what it is and who reads it. Not OpenAI: top_k, min_p (vLLM / Ollama
# spellings), ignore_eos (vLLM's, for benchmarks), repetition_penalty (vLLM / HF), via extra_body or
# LiteLLM's passthrough.
KEYS: dict[str, Key] = {
    "temperature": Key(SAMPLING, listed=True, field="temperature"),
    "top_p": Key(SAMPLING, listed=True, field="top_p"),
    "top_k": Key(SAMPLING, field="top_k"),
    "min_p": Key(SAMPLING, field="min_p"),
    "seed": Key(SAMPLING, listed=True, field="seed"),
    "max_tokens": Key(SAMPLING, listed=True, field="max_tokens"),
    "max_completion_tokens": Key(SAMPLING, listed=True, field="max_tokens"),  # LiteLLM renames it; others may not
    "stop": Key(SAMPLING, listed=True, field="stop"),
    "ignore_eos": Key(SAMPLING, field="ignore_eos"),
    "presence_penalty": Key(SAMPLING, listed=True, field="presence_penalty"),
    "frequency_penalty": Key(SAMPLING, listed=True, field="frequency_penalty"),
    "repetition_penalty": Key(SAMPLING, field="repetition_penalty"),
    "logit_bias": Key(SAMPLING, listed=True, field="logit_bias"),  # token id (digits in JSON) -> [-100, 100]
    "logprobs": Key(SAMPLING, listed=True, field="logprobs"),
    "top_logprobs": Key(SAMPLING, listed=True, field="top_logprobs"),
    **{f.name: Key(OPTION, listed=f.metadata["listed"], read=f.metadata["read"])
       for f in fields(ChatRequest) if "read" in f.metadata},
    # LiteLLM refuses both itself for a custom provider (UnsupportedParamsError, or drops them with
    # drop_params) unless allowed_openai_params lets them by, or they come in extra_body.
    "reasoning_effort": Key(THINKING),
    "thinking": Key(THINKING),
    "response_format": Key(OUTPUT, listed=True),
    "tools": Key(OUTPUT, listed=True),
    "tool_choice": Key(OUTPUT, listed=True),
    "parallel_tool_calls": Key(OUTPUT, listed=True),
    # The Router adds max_retries to every call; stream is decided by which method LiteLLM calls;
    # usage is always on the last chunk, whatever stream_options says.
    **{k: Key(IGNORED, listed=True) for k in (
        "stream", "stream_options", "max_retries", "user", "safety_identifier", "metadata", "store", "service_tier",
        "prompt_cache_key", "prompt_cache_retention")},
    # Anything but the "off" value is refused rather than ignored, or dropped with drop_params.
    "functions": Key(NEUTRAL_ONLY, neutral=([],), why="functions (function calling) are not supported"),
    "function_call": Key(NEUTRAL_ONLY, neutral=("none",), why="function_call is not supported (functions are not supported)"),
    "modalities": Key(NEUTRAL_ONLY, neutral=(["text"],), why="only text output is supported (modalities=['text'])"),
    "audio": Key(NEUTRAL_ONLY, why="audio output is not supported"),
    "web_search_options": Key(NEUTRAL_ONLY, why="web_search_options (web search) is not supported"),
}

# What LiteLLM's get_supported_openai_params would answer for a built-in provider; the NEUTRAL_ONLY
# keys are the "not yet supported" rest (README.md, "Parameters").
SUPPORTED_OPENAI_PARAMS: tuple[str, ...] = tuple(sorted(k for k, key in KEYS.items() if key.listed))

# reasoning_effort -> thinking on (True) or off (False); None leaves the template's default. A
# template's switch has no levels: LiteLLM's own ollama_chat maps low/medium/high to on and none
# to off the same way; minimal (OpenAI's "very few reasoning tokens") is off, the nearer of the two.
REASONING_EFFORTS: dict[str, bool | None] = {
    "none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True, "max": True,
    "default": None,
}

MAX_STOP_STRINGS = 4  # OpenAI's limit: a request valid here stays valid for a cloud fallback model


class ChatParams(BaseModel):
    """The ``SAMPLING`` keys, type-checked (strict: no "0.5" strings, no floats for integers)."""

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


def parse_request(messages: Any, optional_params: Mapping[str, Any], litellm_params: Mapping[str, Any] | None = None,
                  logging_obj: Any = None) -> ChatRequest:
    """A LiteLLM call, as a ``CustomLLM`` gets it -> the ``ChatRequest``; blocking-free, loads no model.

    Args:
        messages: the chat's messages, or a text completion's prompts as LiteLLM makes them (one
            user message each).
        optional_params: as LiteLLM passes them (``extra_body`` nested).
        litellm_params: of these only ``drop_params`` (LiteLLM made it a bool; ``litellm.drop_params``
            counts too) and ``text_completion`` are read.
        logging_obj: LiteLLM's, which keeps the call as the caller made it (``compat.sent_params``,
            ``compat.sent_messages``): errors name what the caller sent.

    With ``drop_params`` the ``NEUTRAL_ONLY`` keys are left out at any value, and on a text
    completion ``logprobs`` / ``top_logprobs`` and ``return_token_ids`` (else refused, naming
    them); unknown keys are still refused, as LiteLLM's own ``drop_params`` drops only OpenAI
    parameters. A key whose value is None is unset.

    Raises:
        InvalidRequestError: an unknown, unsupported or mistyped parameter, or malformed messages;
            ``param`` names it as the caller sent it. Ranges are checked later, by ``SamplingParams``.
    """
    litellm_params = litellm_params or {}
    flat = merge_extra_body(optional_params)
    names = _names_as_sent(flat, compat.sent_params(logging_obj))
    with named_as_sent(names):
        return _parse(messages, flat, litellm.drop_params is True or litellm_params.get("drop_params") is True,
                      litellm_params.get("text_completion") is True, names, logging_obj)


def _parse(messages: Any, flat: dict[str, Any], drop: bool, raw: bool, names: dict[str, str],
           logging_obj: Any) -> ChatRequest:
    """``parse_request`` of the merged keys ``flat``."""
    # The legacy completions' logprobs (an integer, 0 included: hence `is`, as 0 == False) are not built yet.
    if raw and flat.get("logprobs") is not None and flat["logprobs"] is not False:
        if not drop:
            raise InvalidRequestError("logprobs are not supported on text completions yet; a chat completion "
                                      "returns them", param="logprobs")
        flat = {k: v for k, v in flat.items() if k not in ("logprobs", "top_logprobs")}
    parts: dict[str, dict[str, Any]] = {SAMPLING: {}, THINKING: {}, OUTPUT: {}, OPTION: {}}
    for name, value in flat.items():
        key = KEYS.get(name)
        if value is None or (key is not None and (key.kind == IGNORED or (key.kind == NEUTRAL_ONLY and drop))):
            continue
        if key is None:
            raise InvalidRequestError(f"unknown or unsupported parameter {name!r} for provider flm", param=name)
        if key.kind == NEUTRAL_ONLY:
            if not _is_neutral(value, key.neutral):
                raise InvalidRequestError(f"{key.why}; got {name}={value!r}", param=name)
            continue
        parts[key.kind][name] = key.read(name, value) if key.kind == OPTION else value
    options = parts[OPTION]
    if raw and options.get("return_token_ids"):
        if not drop:
            raise InvalidRequestError("return_token_ids is not supported on text completions; a chat completion "
                                      "returns them", param="return_token_ids")
        options["return_token_ids"] = False
    sampling = sampling_fields(parts[SAMPLING])
    thinking = requested_thinking(parts[THINKING])
    output = output_format(parts[OUTPUT])
    suffix = options.get("suffix")
    if suffix is not None and not raw:
        raise InvalidRequestError("suffix (fill-in-the-middle) is a text completion parameter; a chat completion "
                                  "takes none", param="suffix")
    return ChatRequest(
        messages=None if raw else normalize_messages(compat.sent_messages(messages, logging_obj)),
        prompts=raw_prompts(messages, allow_empty=suffix is not None) if raw else None,
        sampling=sampling, thinking=thinking, output=output, drop=drop, names=names, **options)


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


def _names_as_sent(flat: Mapping[str, Any], sent: Mapping[str, Any]) -> dict[str, str]:
    """The runtime's name -> the caller's, of a ``max_tokens`` the caller sent as
    ``max_completion_tokens``: given so (and not with ``max_tokens``, an error of its own), or
    renamed by LiteLLM (``sent``, the caller's keys, has it; ``flat`` has ``max_tokens``)."""
    if "max_tokens" in flat and "max_completion_tokens" in flat:
        return {}
    if "max_completion_tokens" in flat or (sent.get("max_completion_tokens") is not None
                                           and sent.get("max_tokens") is None):
        return {"max_tokens": "max_completion_tokens"}
    return {}


@contextmanager
def named_as_sent(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise an ``InvalidRequestError`` of the block with each parameter the runtime names
    otherwise than the caller sent it (``names``: the runtime's name -> the caller's) named as
    sent, in its ``param`` and its message."""
    try:
        yield
    except InvalidRequestError as e:
        message = str(e)
        for ours, theirs in names.items():
            e.param = theirs if e.param == ours else e.param
            message = re.sub(rf"\b{re.escape(ours)}\b", theirs, message)
        e.args = (message,)
        raise


def sampling_fields(given: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SAMPLING`` keys the request gave (not None) -> ``SamplingParams`` keyword arguments
    (``ChatRequest.sampling``).

    Raises:
        InvalidRequestError: a mistyped value, ``max_tokens`` and ``max_completion_tokens`` both,
            too many or empty stop strings, a ``logit_bias`` key that is no token id; ``param``
            names it (the runtime's name: ``parse_request`` renames it as sent).
    """
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise InvalidRequestError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    try:
        checked = ChatParams(**{KEYS[k].field: v for k, v in given.items()})
    except ValidationError as e:
        raise _first_error(e) from e
    fields = checked.model_dump(exclude_none=True)
    if "stop" in fields:
        fields["stop"] = _stop_tuple(checked.stop)
    if "logit_bias" in fields:
        fields["logit_bias"] = _token_ids(checked.logit_bias)
    return fields


def requested_thinking(given: Mapping[str, Any]) -> tuple[bool, str] | None:
    """Whether the ``THINKING`` keys the request gave (not None) turn a reasoning model's thinking
    on (True) or off (False), and the parameter that says so; None leaves the model's chat
    template to its default.

    ``reasoning_effort`` maps through ``REASONING_EFFORTS``; Anthropic's ``thinking`` is
    ``{"type": "enabled", "budget_tokens": N}`` (on), ``{"type": "disabled"}`` (off) or
    ``{"type": "adaptive"}`` (the model decides: the template's default). ``budget_tokens`` is
    accepted but not enforced: the model ends its own thinking, and ``max_tokens`` bounds the
    whole reply.

    Raises:
        InvalidRequestError: a value not understood (``param`` names it, e.g. ``thinking.type``),
            or the two parameters asking for opposite things (``param`` ``thinking``).
    """
    asked: list[tuple[bool, str]] = []
    effort = given.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
                                      param="reasoning_effort")
        if REASONING_EFFORTS[effort] is not None:
            asked.append((REASONING_EFFORTS[effort], "reasoning_effort"))
    thinking = given.get("thinking")
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


def _first_error(e: ValidationError) -> InvalidRequestError:
    """The first pydantic error, naming its parameter."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else "request"
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


@dataclass(frozen=True)
class EmbeddingRequest:
    """An embedding call as ``parse_embedding_request`` read it.

    Attributes:
        inputs: one item per text: a string, or a text already tokenized (``embedding_inputs``).
        encoding_format: ``float`` or ``base64`` (little-endian float32 bytes, as OpenAI's).
        backend: as ``ChatRequest.backend``.
    """

    inputs: list[str | list[int]]
    encoding_format: str = "float"
    backend: str | None = None


def parse_embedding_request(input: Any, optional_params: Mapping[str, Any],
                            litellm_params: Mapping[str, Any] | None = None) -> EmbeddingRequest:
    """A LiteLLM embedding call -> the ``EmbeddingRequest``: of ``KEYS`` it takes the ``IGNORED``
    ones and ``backend``, and ``encoding_format`` besides.

    LiteLLM refuses ``encoding_format`` for a custom provider unless it is dropped (``drop_params``,
    or ``additional_drop_params: [encoding_format]`` on the deployment), and a dropped one never
    reaches the handler; behind the proxy the caller's value is still in the HTTP request's body
    (``compat.proxy_request_body``), so it is read from there.

    Raises:
        InvalidRequestError: another ``encoding_format`` than ``ENCODING_FORMATS``, another
            parameter (an embedding takes no sampling parameter), bad input; ``param`` names it.
    """
    flat = {k: v for k, v in merge_extra_body(optional_params).items()
            if v is not None and (k not in KEYS or KEYS[k].kind != IGNORED)}
    backend = flat.pop("backend", None)
    value = flat.pop("encoding_format", None)
    if flat:
        key = next(iter(flat))
        raise InvalidRequestError(f"unknown or unsupported embedding parameter {key!r} for provider flm", param=key)
    if value is None:
        value = compat.proxy_request_body(litellm_params).get("encoding_format")
    if value is not None and value not in ENCODING_FORMATS:
        raise InvalidRequestError(f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {value!r}",
                                  param="encoding_format")
    return EmbeddingRequest(embedding_inputs(input), value or "float",
                            None if backend is None else backend_name("backend", backend))
