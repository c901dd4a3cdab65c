"""Render a model's own Jinja chat template, the way Hugging Face ``apply_chat_template`` does.

The environment mirrors transformers' (``transformers/utils/chat_template_utils.py``): a sandboxed
immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception(msg)``
and ``strftime_now(fmt)``. Variables: ``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token`` and any extra keyword (``tools``, ``enable_thinking`` ...).

A model without a template is a base model (``gemma3:270m``): there is no prompt format its
training taught it, so rendering raises ``NoChatTemplateError`` rather than guess one; such a model
continues text (a text completion).

The sandbox is Jinja's: a template reaches no attribute whose name starts with an underscore
(``''.__class__.__mro__``, ``cycler.__init__.__globals__``, ``self._TemplateReference__context``),
no function's or frame's internals and no method that modifies its object. A template that names
such an attribute outright is refused when the model loads (``check_chat_template``); one that
reaches one at render time (through the ``attr`` filter, ``str.format`` or a computed name) is
refused then, where Jinja alone would render an empty string. Both are ``ModelFormatError``s: the
model's files are at fault, not the request.

A template that reads an ``enable_thinking`` variable (Qwen3's, Nemotron's) has a thinking switch:
``thinking_format`` says so, with the markers that enclose the model's thinking in its output
(``ThinkingFormat``; a registry entry may declare other ones).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from flm_runtime.errors import InvalidRequestError, ModelFormatError, NoChatTemplateError

# How the text parts of one OpenAI content list are joined (vLLM's "string" content format does
# the same); a text-only model has no better place for part boundaries.
TEXT_PART_SEPARATOR = "\n"


class _TemplateRaised(jinja2.TemplateError):
    """What ``raise_exception(msg)`` inside a template raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and forces ASCII; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing an unsafe attribute where it is read: Jinja gives an
    undefined value instead, which renders as an empty string until it is used."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template once (cached by its source text).

    Raises:
        InvalidRequestError: the template has a syntax error (``param="messages"``).
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the model's chat template is invalid: {e}",
                                  param="messages") from e


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads from its caller (Jinja's undeclared variables:
    ``messages``, ``add_generation_prompt``, ``enable_thinking`` ...).

    Raises:
        InvalidRequestError: the template has a syntax error (``param="messages"``).
    """
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the model's chat template is invalid: {e}",
                                  param="messages") from e


def check_chat_template(template: str | None, source: str) -> None:
    """Refuse a template that names an attribute outside the sandbox: ``x.__y``/``x._y``, or
    ``x['__y']`` and ``x | attr('_y')``, which the sandbox never grants (module docstring). A template
    that does not compile is left to rendering, which says why.

    Raises:
        ModelFormatError: naming ``source`` (the model's file), the attribute and its line.
    """
    if not template:
        return
    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter)):
        if isinstance(node, jinja2.nodes.Getattr):
            name = node.attr
        elif isinstance(node, jinja2.nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str) else ""
            name = name if name.startswith("__") else ""  # a mapping's own key may start with one underscore
        else:
            args = node.args[:1] if node.name == "attr" else []
            name = args[0].value if args and isinstance(args[0], jinja2.nodes.Const) and isinstance(args[0].value, str) else ""
        if name.startswith("_"):
            raise ModelFormatError(f"{source}: the chat template reads attribute {name!r} (line {node.lineno}), "
                                   "which its sandbox refuses")


THINKING_SWITCH = "enable_thinking"
# What opens and closes a tool call in the Hermes format (``flm_runtime.text.tool_format``; Qwen2.5's
# template teaches it): output text a parser reads, never dropped as a control token would be.
TOOL_CALL_MARKERS = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ThinkingFormat:
    """How a chat template switches the model's thinking, and how the output marks it.

    Attributes:
        switch: the template variable that turns thinking on (true) or off (false); left
            undefined, the template's own default applies.
        start, end: the text that opens and closes the thinking in the model's output (a
            template may already write ``start`` at the end of the generation prompt).
    """

    switch: str = THINKING_SWITCH
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if not (self.switch and self.start and self.end) or self.start == self.end:
            raise ValueError(f"a thinking format needs a switch and two different, non-empty markers; got {self}")


def thinking_format(template: str | None, declared: ThinkingFormat | None = None) -> ThinkingFormat | None:
    """The thinking switch of ``template``: ``declared`` (a registry entry's) or else the default
    ``ThinkingFormat``, when the template reads its ``switch`` variable; None when it does not
    (or there is no template), or when it does not compile (rendering it says why).
    """
    fmt = declared or ThinkingFormat()
    try:
        return fmt if template and fmt.switch in template_variables(template) else None
    except InvalidRequestError:
        return None


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    template_source: str = "the model",
    **extra: Any,
) -> str:
    """Render ``messages`` into the prompt text the model was trained on.

    Args:
        template: Jinja source (GGUF ``tokenizer.chat_template`` or tokenizer_config.json's
            ``chat_template``); ``None`` or empty: the model has none.
        messages: OpenAI-style messages, ``{"role": ..., "content": str | list[part] | None}``;
            list content is flattened to text (parts joined by ``TEXT_PART_SEPARATOR``), ``None``
            becomes ``""``; other keys (``name``, ``tool_calls`` ...) pass through unchanged.
        add_generation_prompt: end with the header of an assistant turn.
        bos_token, eos_token: the tokens' text, as templates expect them.
        template_source: the model's file the template is from, for error messages.
        **extra: more template variables (``tools``, ``enable_thinking`` ...).

    Returns:
        The prompt text, special tokens written out (``<|im_start|>``...).

    Raises:
        NoChatTemplateError: no ``template`` (a base model).
        InvalidRequestError: (``param="messages"``) malformed messages, a non-text content part,
            or the template rejected the conversation (its own message is kept).
        ModelFormatError: the template reached outside its sandbox (naming ``template_source``).
    """
    if not template:
        raise NoChatTemplateError()
    compiled = compile_chat_template(template)
    context = dict(extra, messages=normalize_messages(messages),
                   add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token, eos_token=eos_token)
    try:
        return compiled.render(**context)
    except SecurityError as e:
        raise ModelFormatError(f"{template_source}: the chat template reached outside its sandbox: {e}") from e
    except (jinja2.TemplateError, TypeError) as e:
        # TypeError: the template did arithmetic on a missing or non-string field.
        raise InvalidRequestError(f"chat template error: {e}", param="messages") from e


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose ``content`` is always a string.

    Raises:
        InvalidRequestError: (``param="messages"``) not a list of dicts with a string ``role``,
            or a content part whose type is not ``"text"``.
    """
    if not isinstance(messages, list):
        raise InvalidRequestError(
            f"messages must be a list, got {type(messages).__name__}", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string 'role'", param="messages")
        out.append(dict(message, content=_content_text(message.get("content"), i)))
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{index}].content must be a string or a list of content parts, "
            f"got {type(content).__name__}", param="messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"messages[{index}].content[{j}] has type {kind!r}; this model reads text only "
                f"(parts of type 'text' with a string 'text')", param="messages")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)
