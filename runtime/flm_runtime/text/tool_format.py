"""The generic tool-call format: tools in the prompt, calls in the output, for any chat template.

SmolLM2's chat template (and most small models') has no tool syntax, so every model gets the
*Hermes* convention, the one NousResearch's Hermes 2 Pro and Qwen2.5's templates use:

- the tools' OpenAI definitions, one JSON object a line, between ``<tools>`` and ``</tools>`` in
  the system message, with an instruction to answer with calls in the form below
  (``TOOLS_PREAMBLE``; appended to the caller's own system message, or a system message of its
  own first);
- a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several calls one
  after another, separated by a newline (``CALL_OPEN`` / ``CALL_CLOSE``);
- an earlier assistant turn's ``tool_calls`` are written back into its content in that form, and
  each ``tool`` message's content becomes ``<tool_response>\\n...\\n</tool_response>`` in a user turn
  (consecutive tool messages share one turn), as Qwen2.5's template renders them.

``tool_grammar`` holds the output to that form (a Lark grammar for ``grammar.lark_grammar``, the
arguments held to each tool's ``parameters`` schema with ``%json``): ``required`` makes the whole
output calls (one, or with ``parallel_tool_calls`` one or more), a named function exactly one call
of it; ``auto`` allows either calls or text that never writes ``<tool_call>``; ``none`` adds no
grammar. ``parse_tool_calls`` and ``ToolCallStream`` read the
calls back, whole or as the text streams.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flm_runtime.errors import InvalidRequestError
from flm_runtime.loading.chat_template import normalize_messages

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call functions to help answer the user. Their definitions, one per line, are inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# llguidance's JSON options for the arguments (as grammar.JSON_OPTIONS: compact but spaced).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: ``call_`` and 24 random hex digits (OpenAI's form), unique per call.
        name: the function's name.
        arguments: the arguments as a JSON string (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments: str


def check_tools(tools: Any) -> list[dict]:
    """The request's ``tools``, checked: a list of ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}`` with distinct names.

    Returns:
        the function definitions (the ``function`` objects), in order.

    Raises:
        InvalidRequestError: ``param`` naming the bad entry (``tools[1].function.name``).
    """
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of function tools", param="tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                              Mapping):
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                                      param=f"{where}.function.name")
        if name in names:
            raise InvalidRequestError(f"{where}: a second function named {name!r}", param=f"{where}.function.name")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object",
                                      param=f"{where}.function.parameters")
        names.add(name)
        functions.append(dict(function))
    return functions


def chosen_functions(functions: list[dict], tool_choice: Any) -> tuple[str, list[dict]]:
    """The mode and the functions a call may name, for OpenAI's ``tool_choice``.

    Args:
        functions: ``check_tools``' output.
        tool_choice: ``"none"``, ``"auto"`` (None means it), ``"required"``, or
            ``{"type": "function", "function": {"name": ...}}``.

    Returns:
        ``(mode, functions)``: mode ``none`` / ``auto`` / ``required``, or ``named`` with the one
        function named.

    Raises:
        InvalidRequestError: ``param="tool_choice"``: another value, or a name not in ``tools``.
    """
    if tool_choice is None:
        return "auto", functions
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function, got "
                                      f"{tool_choice!r}", param="tool_choice")
        return tool_choice, functions
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise InvalidRequestError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}, '
                                  f"got {tool_choice!r}", param="tool_choice")
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools "
                                  f"({', '.join(f['name'] for f in functions)})", param="tool_choice")
    return "named", named


def tool_grammar(functions: list[dict], mode: str, parallel: bool) -> str | None:
    """The Lark grammar (llguidance's dialect) of an answer under ``mode``.

    Args:
        functions: the functions a call may name (``chosen_functions``).
        mode: ``required``: one call, or with ``parallel`` one or more; ``named``: one call;
            ``auto``: the calls of ``required``, or text that never writes ``<tool_call>``;
            ``none``: no grammar.
        parallel: OpenAI's ``parallel_tool_calls`` (true by default).

    Returns:
        the grammar text, or None for ``none``.
    """
    if mode == "none":
        return None
    rules = [f"call_{i}: {json.dumps(CALL_OPEN)} %json {json.dumps(_call_schema(f))} {json.dumps(CALL_CLOSE)}"
             for i, f in enumerate(functions)]
    lines = [
        "start: " + ("calls | TEXT" if mode == "auto" else "calls"),
        "calls: call" + (f" ({json.dumps(CALL_SEPARATOR)} call)*" if parallel and mode != "named" else ""),
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        *rules,
    ]
    if mode == "auto":
        # Any text, as long as it never opens a call: a call is made only through the grammar.
        lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN.strip())}(?s:.*)/")
    return "\n".join(lines)


def _call_schema(function: dict) -> dict:
    """The JSON schema of one call's object: the function's name, then its arguments."""
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters", {"type": "object"})},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_STYLE}


def tools_system_text(functions: list[dict]) -> str:
    """``TOOLS_PREAMBLE`` listing ``functions`` as OpenAI tool objects."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return TOOLS_PREAMBLE.format(tools=lines)


def render_messages(messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """OpenAI messages with tools -> plain ``{"role", "content"}`` messages for any chat template.

    Args:
        messages: ``system`` / ``user`` / ``assistant`` (perhaps with ``tool_calls``) / ``tool``
            messages; content a string, a list of text parts or None.
        functions: the tools to describe (``check_tools``), or None to describe none (the
            history may still hold calls and results).

    Returns:
        new messages: the tools in the system message, calls in assistant content, tool results
        in user turns (see the module docstring).

    Raises:
        InvalidRequestError: a tool call without a function name or with arguments that are not
            a JSON object string (``param`` ``messages[i].tool_calls[j]``); content that is not
            text (``param`` ``messages``).
    """
    messages = normalize_messages(messages)  # content as one string
    out: list[dict] = []
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # the results of one turn's calls share a user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call_text(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(message["tool_calls"])]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    if functions:
        text = tools_system_text(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_text(call: Any, where: str) -> str:
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError(f"{where} needs function.name", param=where)
    arguments = function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{where}.function.arguments is not JSON: {e}", param=where) from e
    if not isinstance(parsed, Mapping):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object", param=where)
    return CALL_OPEN + json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False) + CALL_CLOSE


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _read_call(block: str) -> ToolCall | None:
    """One call's JSON text -> ``ToolCall``; None when it is not a complete call object."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(_new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer -> ``(content, calls)``.

    An answer that starts with ``<tool_call>`` is calls: every complete block becomes a
    ``ToolCall`` and ``content`` is None. A call cut short (``max_tokens``) is dropped: its text is
    markup no client can use, and the finish reason ``length`` says the answer was cut. Any other
    answer is ``(text, [])``.
    """
    stream = ToolCallStream()
    _, calls = stream.feed(text)
    stream.finish()
    return (None, calls) if stream.is_calls else (text, [])


class ToolCallStream:
    """Reads calls out of an answer as it streams (``feed`` each new piece of text, then
    ``finish``).

    Text is held back while the answer could still be the start of ``<tool_call>``; an answer
    that is not calls then passes through unchanged. In a calls answer each call comes out when
    its ``</tool_call>`` arrives; nothing else of it is content, an unfinished call included.
    """

    def __init__(self):
        self._buffer = ""
        self._calls: bool | None = None  # None until the answer's start tells text from calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the complete calls that ``text``, appended to the answer so far, lets out."""
        self._buffer += text
        if self._calls is None:
            head = CALL_OPEN.strip()
            if self._buffer.startswith(head):
                self._calls = True
            elif head.startswith(self._buffer):
                return "", []
            else:
                self._calls = False
        if not self._calls:
            out, self._buffer = self._buffer, ""
            return out, []
        calls = []
        while (end := self._buffer.find(CALL_CLOSE.strip())) >= 0:
            block, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE.strip()):]
            call = _read_call(block.strip().removeprefix(CALL_OPEN.strip()).strip())
            if call is not None:
                calls.append(call)
        return "", calls

    @property
    def is_calls(self) -> bool:
        """Whether the answer so far is a calls answer (it starts with ``<tool_call>``)."""
        return self._calls is True

    def finish(self) -> str:
        """The content left at the end: held-back text of an answer that is not calls ("" for a
        calls answer, whose unfinished call is dropped)."""
        out, self._buffer = self._buffer, ""
        return "" if self._calls else out
