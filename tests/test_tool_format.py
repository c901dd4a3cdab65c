"""The generic (Hermes-style) tool-call format on its own: prompt rendering, checks of tools and
tool_choice, the grammar each tool choice gives (compiled by llguidance and walked byte by byte on
a byte vocabulary), and reading calls back, whole and streamed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.sampling.grammar import GrammarCompiler, lark_grammar
from flm_runtime.text import tool_format as tf

sys.path.insert(0, str(Path(__file__).parent / "engine"))
from engine_fakes import EOS, EOT, FakeTokenizer  # noqa: E402

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object",
                                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                     "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

tok = FakeTokenizer(vocab_size=300)
compiler = GrammarCompiler(tok)


def accepts(grammar: str | None, text: str, *, then_only_stop: bool = False) -> bool:
    """Whether ``text`` (in the vocabulary's own tokens: where the grammar forces a string,
    llguidance allows its canonical tokens) is a complete answer of ``grammar``: every token
    allowed where it comes, and then the stop tokens (``then_only_stop``: nothing else)."""
    proc = compiler.processor(lark_grammar(grammar), param="tools")
    for token in tok.encode(text):
        if not proc.allowed()[token]:
            return False
        proc.accept(token)
    allowed = set(np.flatnonzero(proc.allowed()).tolist())
    return allowed == {EOS, EOT} if then_only_stop else {EOS, EOT} <= allowed


def grammar(choice, parallel=True):
    mode, functions = tf.chosen_functions(tf.check_tools(TOOLS), choice)
    return tf.tool_grammar(functions, mode, parallel)


def test_required_allows_exactly_calls_that_match_the_schemas():
    g = grammar("required")
    assert accepts(g, CALL_WEATHER) and accepts(g, CALL_ADD)
    assert accepts(g, CALL_WEATHER + "\n" + CALL_ADD)                    # parallel calls
    assert not accepts(g, "Paris is sunny.")
    assert not accepts(g, CALL_WEATHER.replace("celsius", "kelvin"))     # the enum holds
    assert not accepts(g, CALL_ADD.replace('"b": 3', '"b": 3.5'))         # integers are integers
    assert not accepts(g, CALL_ADD.replace('"add"', '"sub"'))             # only the tools' names


def test_one_call_only_without_parallel_tool_calls():
    assert accepts(grammar("required", parallel=False), CALL_ADD, then_only_stop=True)
    assert not accepts(grammar("required", parallel=False), CALL_ADD + "\n" + CALL_ADD)


def test_a_named_function_allows_that_function_only():
    g = grammar({"type": "function", "function": {"name": "add"}})
    assert accepts(g, CALL_ADD, then_only_stop=True)                     # one call: a named function
    assert not accepts(g, CALL_WEATHER)


def test_auto_allows_text_or_calls_but_no_call_inside_text():
    g = grammar("auto")
    assert accepts(g, "Paris is sunny.") and accepts(g, "") and accepts(g, CALL_WEATHER)
    assert not accepts(g, "Let me check. " + CALL_WEATHER)
    assert grammar("none") is None


@pytest.mark.parametrize("tools, choice, param", [
    ([], None, "tools"),
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": ADD}, {"type": "function", "function": ADD}], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "mul"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
])
def test_bad_tools_and_choices_are_named(tools, choice, param):
    with pytest.raises(InvalidRequestError) as info:
        tf.chosen_functions(tf.check_tools(tools), choice)
    assert info.value.param == param


def test_render_puts_tools_in_the_system_message_and_the_history_in_the_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "5"}]},
    ]
    out = tf.render_messages(messages, tf.check_tools(TOOLS))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "Be brief.\n\n" + tf.tools_system_text([WEATHER, ADD])
    assert [json.loads(line)["function"]["name"] for line in
            out[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()] == ["get_weather", "add"]
    assert out[2]["content"] == CALL_WEATHER + "\n" + CALL_ADD
    assert out[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    own = tf.render_messages(messages[1:2], tf.check_tools(TOOLS))
    assert [m["role"] for m in own] == ["system", "user"]                 # a system message of its own
    assert tf.render_messages(messages[:2], None) == messages[:2]
    assert tf.render_messages(messages[2:3], None) == [{"role": "assistant", "content": CALL_WEATHER + "\n" + CALL_ADD}]


def test_render_refuses_a_call_whose_arguments_are_not_an_object():
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "[1]"}}]}]
    with pytest.raises(InvalidRequestError) as info:
        tf.render_messages(bad, None)
    assert info.value.param == "messages[0].tool_calls[0]"


def test_parse_reads_calls_and_leaves_text_alone():
    content, calls = tf.parse_tool_calls(CALL_WEATHER + "\n" + CALL_ADD)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                                  ("add", {"a": 2, "b": 3})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert tf.parse_tool_calls("Paris is sunny.") == ("Paris is sunny.", [])
    assert tf.parse_tool_calls("<tool") == ("<tool", [])
    cut = CALL_ADD + "\n<tool_call>\n{\"name\": \"ad"                      # cut by max_tokens
    content, calls = tf.parse_tool_calls(cut)
    assert [c.name for c in calls] == ["add"] and content is None  # the unfinished call is dropped
    for cut in (CALL_ADD + "\n<", CALL_ADD[:-3], "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}"):
        content, calls = tf.parse_tool_calls(cut)
        assert content is None and [c.name for c in calls] == (["add"] if cut.startswith(CALL_ADD) else [])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_the_stream_gives_what_parse_gives_in_pieces_of_any_size(size):
    for text in (CALL_WEATHER + "\n" + CALL_ADD, CALL_ADD + "\n<tool_call>\n{", "Paris is sunny.", "<tools are fun>",
                 "<tool"):
        stream, content, calls = tf.ToolCallStream(), "", []
        for i in range(0, len(text), size):
            piece, done = stream.feed(text[i:i + size])
            content += piece
            calls += done
        content += stream.finish()
        want_content, want_calls = tf.parse_tool_calls(text)
        assert (None if stream.is_calls else content) == want_content and (content == "" or not stream.is_calls)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
