"""The Hermes tool-call format: tools in the prompt, calls in the output, for any chat template.

Every model's calls are in the *Hermes* convention, the one NousResearch's Hermes 2 Pro and
Qwen2.5's templates use: a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
several calls one after another, separated by a newline (``CALL_OPEN`` / ``CALL_CLOSE``).

How the tools and the conversation reach the prompt (``chat_messages``):

- a template that writes this format itself (Qwen2.5's: ``template_tool_arguments`` finds it by
  rendering a probe conversation) is given the tools (``tools``), the earlier calls and the tool
  results, and renders them as its model was trained;
- any other (SmolLM2's, and most small models', has no tool syntax) gets the generic rendering
  (``render_messages``): the tools' OpenAI definitions, one JSON object a line, between
  ``<tools>`` and ``</tools>`` in the system message, with an instruction to answer with calls in
  the form above (``TOOLS_PREAMBLE``; appended to the caller's own system message, or a system
  message of its own first); an earlier assistant turn's ``tool_calls`` written back into its
  content in that form, and each ``tool`` message's content as
  ``<tool_response>\\n...\\n</tool_response>`` in a user turn (consecutive tool messages share one
  turn), as Qwen2.5's template renders them.

``tool_grammar`` holds the output to that form (a Lark grammar for ``grammar.lark_grammar``, the
arguments held to each tool's ``parameters`` schema with ``%json``): ``required`` makes the whole
output calls (one, or with ``parallel_tool_calls`` one or more), a named function exactly one call
of it; ``auto`` allows either calls or text that never writes ``<tool_call>``; ``none`` adds no
grammar. ``parse_tool_calls`` and ``ToolCallStream`` read the calls back, whole or as the text
streams. Where the vocabulary has a marker as a token of its own (Qwen2.5's ``<tool_call>`` and
``</tool_call>``: user-defined tokens) the grammar writes it as that token (``marker_token_ids``),
and the tokenizer never drops it from the output (``Tokenizer.special_token_ids``).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flm_runtime.errors import InvalidRequestError
from flm_runtime.loading.chat_template import TOOL_CALL_MARKERS, normalize_messages, render_chat_template

CALL_OPEN = TOOL_CALL_MARKERS[0] + "\n"
CALL_CLOSE = "\n" + TOOL_CALL_MARKERS[1]
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


def tool_grammar(functions: list[dict], mode: str, parallel: bool,
                 marker_ids: tuple[int | None, int | None] = (None, None)) -> str | None:
    """The Lark grammar (llguidance's dialect) of an answer under ``mode``.

    Args:
        functions: the functions a call may name (``chosen_functions``).
        mode: ``required``: one call, or with ``parallel`` one or more; ``named``: one call;
            ``auto``: the calls of ``required``, or text that never writes ``<tool_call>``;
            ``none``: no grammar.
        parallel: OpenAI's ``parallel_tool_calls`` (true by default).
        marker_ids: the token of ``<tool_call>`` and of ``</tool_call>`` in the vocabulary the
            grammar is for (``marker_token_ids``), or None: a marker with a token is that token
            alone, the one spelling the model saw in training (its tokenizer never splits it);
            one without is its text, in any tokens.

    Returns:
        the grammar text, or None for ``none``.
    """
    if mode == "none":
        return None
    call_open, call_close = (_lark_text(text, marker, token_id)
                             for text, marker, token_id in zip((CALL_OPEN, CALL_CLOSE), TOOL_CALL_MARKERS, marker_ids))
    rules = [f"call_{i}: {call_open} %json {json.dumps(_call_schema(f))} {call_close}" for i, f in enumerate(functions)]
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


def marker_token_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of ``<tool_call>`` and ``</tool_call>`` (``TOOL_CALL_MARKERS``) where ``tokenizer``
    encodes each as one token (Qwen2.5's added tokens), None where it takes several (SmolLM2's)."""
    return tuple(ids[0] if len(ids := tokenizer.encode(m, add_bos=False)) == 1 else None for m in TOOL_CALL_MARKERS)


def _lark_text(text: str, marker: str, token_id: int | None) -> str:
    """Lark for ``text``, which holds ``marker`` once: that part the token ``token_id`` where given."""
    if token_id is None:
        return json.dumps(text)
    before, after = text.split(marker)
    return " ".join(part for part in (json.dumps(before), f"<[{token_id}]>", json.dumps(after)) if part != '""')


def _call_schema(function: dict) -> dict:
    """The JSON schema of one call's object: the function's name, then its arguments."""
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters", {"type": "object"})},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_STYLE}


def tools_system_text(functions: list[dict]) -> str:
    """``TOOLS_PREAMBLE`` listing ``functions`` as OpenAI tool objects."""
    lines = "\n".join(json.dumps(_tool_object(f), ensure_ascii=False) for f in functions)
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
            calls = [_call_text(*_history_call(call, f"messages[{i}].tool_calls[{j}]"))
                     for j, call in enumerate(message["tool_calls"])]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    if functions:
        text = tools_system_text(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _history_call(call: Any, where: str) -> tuple[str, dict]:
    """An earlier assistant turn's tool call -> its function's name and its arguments as an object.

    Raises:
        InvalidRequestError: ``param=where``: no function name, or arguments that are not a JSON
            object (or its JSON text).
    """
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
    return name, dict(parsed)


def _call_text(name: str, arguments: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_CLOSE


# The probe conversation of ``template_tool_arguments``: names no real tool or request would use.
_PROBE_TOOL = {"name": "flm_probe", "description": "flm_probe_description",
               "parameters": {"type": "object", "properties": {"flm_key": {"type": "string"}}}}
_PROBE_ARGUMENTS = {"flm_key": "flm_value"}
_PROBE_RESULT = "flm_probe_result"


@functools.lru_cache(maxsize=16)
def template_tool_arguments(template: str | None) -> str | None:
    """Whether ``template`` (a chat template's source) writes tools in this format itself, and how
    it wants a call's arguments; found by rendering a probe conversation, as llama.cpp finds a
    template's capabilities (``caps_get`` in ``common/jinja/caps.cpp``): a user turn, an assistant
    turn calling a probe tool, the tool's result, with the probe tool in ``tools``.

    Returns:
        ``"object"`` (Qwen2.5's template) or ``"string"``: with the call's arguments given as a
        JSON object, or else as their JSON text (OpenAI's form), the template lists the tool it is
        given, writes the call exactly as ``_call_text`` does (``CALL_OPEN``, the call object,
        ``CALL_CLOSE``) and writes the result. None: it does not (it ignores ``tools``, as
        SmolLM2's; it writes calls in another format; it refuses the conversation), or there is no
        template.
    """
    if not template:
        return None
    for form in ("object", "string"):
        arguments = _PROBE_ARGUMENTS if form == "object" else json.dumps(_PROBE_ARGUMENTS)
        messages = [{"role": "user", "content": "flm_probe_question"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_flm_probe", "type": "function",
                         "function": {"name": _PROBE_TOOL["name"], "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_flm_probe", "content": _PROBE_RESULT}]
        try:
            text = render_chat_template(template, messages, tools=[_tool_object(_PROBE_TOOL)])
        except InvalidRequestError:
            return None
        if (_PROBE_TOOL["description"] in text and _PROBE_RESULT in text
                and _call_text(_PROBE_TOOL["name"], _PROBE_ARGUMENTS) in text):
            return form
    return None


def chat_messages(messages: list[dict], functions: list[dict] | None,
                  template: str | None) -> tuple[list[dict], dict[str, Any]]:
    """OpenAI messages with tools -> the messages and the extra variables to render ``template``
    with.

    A template that writes tools in this format itself (``template_tool_arguments``: Qwen2.5's)
    renders them as its model was trained: the messages keep their tool calls (each checked, its
    arguments in the form the template wants) and tool results, and ``tools`` lists ``functions``
    as OpenAI tool objects (no ``tools`` when ``functions`` is None), as transformers' and
    llama.cpp's ``apply_chat_template`` pass them. Any other template gets the generic format
    (``render_messages``) and no variables.

    Raises:
        InvalidRequestError: as ``render_messages``.
    """
    form = template_tool_arguments(template)
    if form is None:
        return render_messages(messages, functions), {}
    out = []
    for i, message in enumerate(normalize_messages(messages)):
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                name, arguments = _history_call(call, f"messages[{i}].tool_calls[{j}]")
                calls.append({"id": call.get("id"), "type": "function", "function": {
                    "name": name, "arguments": arguments if form == "object" else json.dumps(arguments)}})
            message = dict(message, tool_calls=calls)
        out.append(message)
    return out, ({"tools": [_tool_object(f) for f in functions]} if functions else {})


def _tool_object(function: dict) -> dict:
    return {"type": "function", "function": function}


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
