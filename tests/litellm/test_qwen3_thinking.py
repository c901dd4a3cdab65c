"""Qwen3's real chat template (``tests/data/qwen3_chat_template.jinja``) on a tiny random Qwen3
model, through LiteLLM: ``reasoning_effort`` turns its ``enable_thinking`` switch, and the
template's own rules hold in our renderer (an earlier turn's reasoning is left out of the prompt).

The figures are exact token counts: the model's tokenizer is the tests' tiny byte-level one, so
the prompt of each request is known to the token.
"""

from __future__ import annotations

import json
from pathlib import Path

import litellm
import numpy as np
import pytest
from loading.tiny_llama_files import tiny_tokenizer_json, tiny_vocab
from models.family_files import hf_config
from safetensors.numpy import save_file

import litellm_flm  # noqa: F401  (registers the flm provider)
from flm_runtime import api, registry
from flm_runtime import families

TAG = "tiny-qwen3:1m"
MODEL = f"flm/{TAG}"
TEMPLATE = (Path(__file__).parents[1] / "data" / "qwen3_chat_template.jinja").read_text()
QUESTION = [{"role": "user", "content": "the world"}]
# LiteLLM refuses reasoning_effort for a custom provider unless it is let by.
LET_BY = {"allowed_openai_params": ["reasoning_effort"]}
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"  # what the template writes when thinking is off


def write_qwen3_dir(path: Path) -> Path:
    """A Qwen3 Hugging Face directory: the golden tests' tiny Qwen3 shape over the tiny byte-level
    vocabulary, seeded random weights, the real chat template."""
    path.mkdir()
    values = {**hf_config("qwen3"), "vocab_size": len(tiny_vocab()[0]), "max_position_embeddings": 512}
    family = families.for_model_type("qwen3", str(path))
    config = family.config_from_hf(values, str(path))
    rng = np.random.default_rng(0)
    tensors = {name: (0.2 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in family.checkpoint_shapes(config).items()}
    (path / "config.json").write_text(json.dumps(values))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return path


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    """The engine of ``TAG`` (named in a user models file); dropped afterwards."""
    tmp = tmp_path_factory.mktemp("qwen3")
    directory = write_qwen3_dir(tmp / "tiny-qwen3")
    (tmp / "models.yaml").write_text(f"{TAG}:\n  path: {directory}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLM_MODELS_FILE", str(tmp / "models.yaml"))
        mp.setenv("FLM_BACKEND", "cpu")
        registry.reload()
        engine = api.get_engine(TAG)
        yield engine
        api.default_runtime.forget(TAG)
    registry.reload()


def prompt_tokens(messages, **params) -> int:
    r = litellm.completion(model=MODEL, messages=messages, max_tokens=2, temperature=0, **params)
    return r.usage.prompt_tokens


def test_reasoning_effort_turns_the_templates_thinking_switch(qwen3_engine):
    tok = qwen3_engine.tokenizer
    on = prompt_tokens(QUESTION, reasoning_effort="high", **LET_BY)
    off = prompt_tokens(QUESTION, reasoning_effort="none", **LET_BY)
    # The template renders "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", and
    # with thinking off an empty thought after it; Qwen3 thinks unless told not to.
    assert on == len(tok.encode("<|im_start|>user\nthe world<|im_end|>\n<|im_start|>assistant\n"))
    assert off == on + len(tok.encode(EMPTY_THOUGHT))
    assert prompt_tokens(QUESTION) == on


def test_an_earlier_turns_reasoning_stays_out_of_the_prompt(qwen3_engine):
    answered = [*QUESTION, {"role": "assistant", "content": "<think>\nsome long plan\n</think>\n\nin order"}]
    bare = [*QUESTION, {"role": "assistant", "content": "in order"}]
    follow_up = {"role": "user", "content": "and then"}
    assert prompt_tokens([*answered, follow_up]) == prompt_tokens([*bare, follow_up])
