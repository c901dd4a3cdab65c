"""Tools through a model's own chat template (Qwen2.5-Coder's, from its GGUF): which templates
write Hermes calls themselves, the exact prompt against llama.cpp's rendering of the same chat,
and the tool-call markers as tokens: kept in the output text the parser reads, and written as
tokens in the grammar, whether the vocabulary makes them user-defined (Qwen2.5's) or control
tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.loading.chat_template import TOOL_CALL_MARKERS
from flm_runtime.loading.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, Tokenizer
from flm_runtime.sampling.grammar import GrammarCompiler, lark_grammar
from flm_runtime.text import tool_format as tf

DATA = Path(__file__).resolve().parent / "data"
# Recorded by `tests/reference/llama_cpp.py chat-template` (llama-server --jinja, /apply-template).
LLAMA_CPP = json.loads((DATA / "qwen2.5_coder_llama_cpp_tools_prompt.json").read_text(encoding="utf-8"))
TOOL_CALL, TOOL_CALL_END, IM_START, PAD = 151657, 151658, 151644, 151665


def prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    chat, extra = tf.chat_messages(messages, tf.check_tools(tools) if tools else None, tokenizer.chat_template)
    return tokenizer.apply_chat_template(chat, **extra)


def test_which_templates_write_hermes_calls_themselves(qwen_coder_tokenizer, smollm2_tokenizer):
    qwen3 = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
    assert tf.template_tool_arguments(qwen_coder_tokenizer.chat_template) == "object"
    assert tf.template_tool_arguments(qwen3) == "object"
    assert tf.template_tool_arguments(smollm2_tokenizer.chat_template) is None  # no tool syntax
    assert tf.template_tool_arguments(None) is None
    # Writes the arguments as given: OpenAI's JSON text fits, an object would print as a Python dict.
    raw = ("{% for t in tools %}{{ t.function.description }}{% endfor %}{% for m in messages %}"
           "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
           "{{ c.function.arguments }}}\n</tool_call>{% endfor %}{{ m.content }}{% endfor %}")
    assert tf.template_tool_arguments(raw) == "string"
    other = raw.replace("<tool_call>\n", "[TOOL_CALLS]").replace("\n</tool_call>", "")  # another format
    assert tf.template_tool_arguments(other) is None
    refusing = "{{ raise_exception('no tools here') if tools else messages[0].content }}"
    assert tf.template_tool_arguments(refusing) is None


def test_the_prompt_with_tools_is_llama_cpps(qwen_coder_tokenizer, qwen_coder_gguf):
    assert LLAMA_CPP["model"] == qwen_coder_gguf.name
    chat = LLAMA_CPP["conversation"]
    assert prompt(qwen_coder_tokenizer, chat["messages"], chat["tools"]) == LLAMA_CPP["prompt"]


def test_the_template_renders_the_history_without_tools_too(qwen_coder_tokenizer):
    """tool_choice none (or no tools) leaves the tools out of the prompt; the calls and results of
    the history are still the template's own turns, exactly as with tools."""
    messages = LLAMA_CPP["conversation"]["messages"]
    text = prompt(qwen_coder_tokenizer, messages, None)
    system = "<|im_start|>system\nYou are a weather bot.<|im_end|>\n"
    assert text == system + LLAMA_CPP["prompt"].split("<|im_end|>\n", 1)[1]


def test_a_call_of_the_history_is_checked_in_the_template_path_too(qwen_coder_tokenizer):
    bad = [{"role": "user", "content": "2 + 3?"},
           {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "[2, 3]"}}]}]
    with pytest.raises(InvalidRequestError) as info:
        tf.chat_messages(bad, None, qwen_coder_tokenizer.chat_template)
    assert info.value.param == "messages[1].tool_calls[0]"


def _with_marker_type(metadata: dict, token_type: int) -> Tokenizer:
    types = list(metadata["tokenizer.ggml.token_type"])
    types[TOOL_CALL] = types[TOOL_CALL_END] = token_type
    return Tokenizer.from_gguf(dict(metadata, **{"tokenizer.ggml.token_type": types}))


@pytest.mark.parametrize("marker_type", [TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_CONTROL])
def test_the_markers_reach_the_parser_and_the_grammar_as_tokens(qwen_coder_metadata, marker_type):
    """Qwen2.5's GGUF makes ``<tool_call>`` and ``</tool_call>`` USER_DEFINED tokens; as CONTROL
    tokens (which the output text drops) they are kept all the same: the text the parser reads
    holds them. The grammar writes each as its token: the only spelling of a marker it allows."""
    assert [qwen_coder_metadata["tokenizer.ggml.token_type"][i] for i in (TOOL_CALL, TOOL_CALL_END)] == [
        TOKEN_TYPE_USER_DEFINED] * 2
    tok = _with_marker_type(qwen_coder_metadata, marker_type)
    assert [tok.id_to_token(i) for i in (TOOL_CALL, TOOL_CALL_END)] == list(TOOL_CALL_MARKERS)
    assert {TOOL_CALL, TOOL_CALL_END}.isdisjoint(tok.special_token_ids)
    assert {IM_START, PAD} <= tok.special_token_ids
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = tok.encode("<|im_start|>assistant\n" + call + "<|im_end|>")
    assert ids.count(TOOL_CALL) == ids.count(TOOL_CALL_END) == 1
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "assistant\n" + call
    assert [(c.name, c.arguments) for c in tf.parse_tool_calls(text.removeprefix("assistant\n"))[1]] == [
        ("add", '{"a": 2, "b": 3}')]
    assert tf.marker_token_ids(tok) == (TOOL_CALL, TOOL_CALL_END)
    add = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "integer"}}}}
    grammar = tf.tool_grammar([add], "required", True, tf.marker_token_ids(tok))
    proc = GrammarCompiler(tok).processor(lark_grammar(grammar), param="tools")
    for token in tok.encode(call):
        allowed = set(np.flatnonzero(proc.allowed()).tolist())
        assert token in allowed
        if token in (TOOL_CALL, TOOL_CALL_END):
            assert allowed == {token}
        proc.accept(token)
    newline = tok.encode("\n")
    assert set(np.flatnonzero(proc.allowed()).tolist()) == {*newline, *tok.stop_token_ids}  # another call, or the end


def test_a_vocabulary_without_marker_tokens_spells_them_in_text(smollm2_tokenizer):
    assert tf.marker_token_ids(smollm2_tokenizer) == (None, None)
    assert tf.tool_grammar([{"name": "f"}], "named", True) == tf.tool_grammar([{"name": "f"}], "named", True,
                                                                                tf.marker_token_ids(smollm2_tokenizer))
