"""``response_format``, ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> what a request's
output is held to (a grammar for ``flm_runtime.sampling.grammar``) and how its answer is read back.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object: OpenAI's JSON mode) or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"?}}`` (JSON that validates against ``schema``; LiteLLM turns a pydantic class into
  this form). The output is held to it by constrained decoding, whatever ``strict`` says.
- ``tools`` (functions only), ``tool_choice`` and ``parallel_tool_calls``: the Hermes tool-call
  format of ``flm_runtime.text.tool_format``; the answer's calls come back as OpenAI ``tool_calls``.

A request may not combine tools (other than ``tool_choice="none"``) with a JSON
``response_format``: each asks for the whole output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flm_runtime import (InvalidRequestError, check_tools, chosen_functions, json_object_grammar, json_schema_grammar,
                         lark_grammar, marker_token_ids, tool_grammar)

@dataclass(frozen=True)
class OutputFormat:
    """What a request's output is held to.

    Attributes:
        grammar: the response format's llguidance grammar, or None (``grammar_for`` gives the
            request's, tool calls' included).
        param: the parameter a grammar that does not compile is blamed on.
        functions: the tools to describe in the prompt (``flm_runtime.chat_messages``), or None.
        reads_tool_calls: the answer may hold calls: read them into ``tool_calls``.
        calls: the calls' grammar arguments (``flm_runtime.tool_grammar``: the functions a call
            may name, the mode, parallel calls or not), or None.
    """

    grammar: str | None = None
    param: str = "response_format"
    functions: list[dict] | None = None
    reads_tool_calls: bool = False
    calls: tuple[list[dict], str, bool] | None = None

    def grammar_for(self, tokenizer) -> str | None:
        """The llguidance grammar to compile against ``tokenizer``: the calls' (each marker the
        vocabulary has as one token written as that token, ``flm_runtime.marker_token_ids``) or
        the response format's; None: the output is free."""
        if self.calls is None:
            return self.grammar
        return lark_grammar(tool_grammar(*self.calls, marker_token_ids(tokenizer)))


def output_format(optional_params: Mapping[str, Any]) -> OutputFormat:
    """The request's ``OutputFormat`` from its ``optional_params`` (``extra_body`` already merged).

    Raises:
        InvalidRequestError: a malformed value, a tool choice without tools, or tools with a JSON
            response format; ``param`` names the parameter.
    """
    response_format = _response_format_grammar(optional_params.get("response_format"))
    tools = optional_params.get("tools")
    tool_choice = optional_params.get("tool_choice")
    parallel = optional_params.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {parallel!r}",
                                  param="parallel_tool_calls")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return OutputFormat(grammar=response_format)
    functions = check_tools(tools)
    mode, chosen = chosen_functions(functions, tool_choice)
    if mode == "none":  # the tools are left out of the prompt: nothing would read a call
        return OutputFormat(grammar=response_format)
    if response_format is not None:
        raise InvalidRequestError("response_format json_object / json_schema cannot be combined with tools "
                                  "(tool_choice other than 'none'): both constrain the whole output",
                                  param="response_format")
    return OutputFormat(param="tools", functions=functions, reads_tool_calls=True, calls=(chosen, mode, parallel))


def _response_format_grammar(response_format: Any) -> str | None:
    """The grammar of OpenAI's ``response_format``; None for ``text`` or none given."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise InvalidRequestError('response_format json_schema needs {"json_schema": {"name": ..., '
                                      '"schema": {...}}}', param="response_format.json_schema")
        return json_schema_grammar(spec["schema"], param="response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format type must be text, json_object or json_schema, got {response_format!r}",
                              param="response_format")
