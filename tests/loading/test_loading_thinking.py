"""A chat template's thinking switch: found among its variables (``thinking_format``), held by
the tokenizer, declared with other markers by a registry entry, and rendered on and off."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from flm_runtime import api, registry
from flm_runtime.loading import Tokenizer
from flm_runtime.loading.chat_template import ThinkingFormat, thinking_format

from tiny_llama_files import CHATML, random_hf_weights, tiny_config, tiny_tokenizer_json, write_tiny_hf_dir

# A Qwen3-style switch: thinking unless enable_thinking is false, which writes an empty block.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]
PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, found", [
    (TEMPLATE, ThinkingFormat()),
    ("{% set enable_thinking = enable_thinking | default(true) %}{{ messages }}", ThinkingFormat()),
    ("{% set enable_thinking = false %}{{ enable_thinking }}", None),  # set, never read from the caller
    (CHATML, None), (None, None), ("", None),
    ("{% if enable_thinking %}", None),  # does not compile: rendering says why
])
def test_thinking_format_is_found_among_the_template_variables(template, found):
    assert thinking_format(template) == found


def test_declared_markers_and_switch():
    markers = ThinkingFormat(start="<reason>", end="</reason>")
    assert thinking_format(TEMPLATE, markers) == markers
    assert thinking_format(TEMPLATE, ThinkingFormat(switch="reasoning")) is None  # the template does not read it
    assert thinking_format("{{ reasoning }}", ThinkingFormat(switch="reasoning")) == ThinkingFormat(switch="reasoning")


@pytest.mark.parametrize("bad", [dict(start=""), dict(end="<think>"), dict(switch="")])
def test_a_format_needs_a_switch_and_two_markers(bad):
    with pytest.raises(ValueError):
        ThinkingFormat(**bad)


@pytest.fixture
def thinking_dir(tmp_path):
    config = tiny_config()
    return write_tiny_hf_dir(tmp_path / "thinker", config, random_hf_weights(config), chat_template=TEMPLATE)


def test_the_tokenizer_holds_the_switch_and_renders_it(thinking_dir, tmp_path):
    tok = Tokenizer.from_hf_dir(thinking_dir)
    assert tok.thinking == ThinkingFormat()
    assert tok.apply_chat_template(MESSAGES) == PROMPT
    assert tok.apply_chat_template(MESSAGES, enable_thinking=True) == PROMPT
    assert tok.apply_chat_template(MESSAGES, enable_thinking=False) == PROMPT + "<think>\n\n</think>\n\n"
    config = tiny_config()
    plain = write_tiny_hf_dir(tmp_path / "plain", config, random_hf_weights(config))
    assert Tokenizer.from_hf_dir(plain).thinking is None


def test_a_registry_entry_declares_other_markers(thinking_dir, tmp_path, monkeypatch):
    models = tmp_path / "models.yaml"
    models.write_text(f"thinker:1m:\n  path: {thinking_dir}\n  thinking: {{start: '<reason>', end: '</reason>'}}\n"
                      f"plain:1m: {thinking_dir}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    registry.reload()
    try:
        assert registry.resolve("thinker:1m").thinking == ThinkingFormat(start="<reason>", end="</reason>")
        assert api.load_model("thinker:1m").tokenizer.thinking == ThinkingFormat(start="<reason>", end="</reason>")
        assert api.load_model("plain:1m").tokenizer.thinking == ThinkingFormat()
    finally:
        registry.reload()


def test_markers_made_special_tokens_stay_in_the_text():
    """A vocabulary may make <think> and </think> control tokens: a model with a thinking switch
    keeps them in its output (the reasoning split reads them), one without drops them."""
    hf = HFTokenizer.from_str(tiny_tokenizer_json())
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")])
    ids = hf.encode("<think>he</think>the").ids
    thinker = Tokenizer(hf, bos_token_id=None, eos_token_ids=[2], add_bos=False, chat_template=TEMPLATE, source="t")
    plain = Tokenizer(hf, bos_token_id=None, eos_token_ids=[2], add_bos=False, chat_template=CHATML, source="t")
    assert thinker.decode(ids, skip_special_tokens=True) == "<think>he</think>the"
    assert plain.decode(ids, skip_special_tokens=True) == "hethe"
    thinker.thinking = ThinkingFormat(start="<reason>", end="</reason>")  # a registry entry's markers
    assert thinker.decode(ids, skip_special_tokens=True) == "hethe"
