"""A tag's context length: what caps its engine (a models file's ``context_length``, as
llama-server's ``-c``), and what LiteLLM registers for it (that, else its GGUF file's own)."""

from __future__ import annotations

import gguf
import litellm
import pytest
from loading.tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf

import litellm_flm
from flm_runtime import api, registry
from flm_runtime.errors import ModelFormatError
from flm_runtime.loading.gguf import gguf_context_length

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def tiny_tags(tmp_path, monkeypatch):
    """Tags of one tiny GGUF (128 positions) in a user models file: ``capped:1m`` (context_length
    64), ``own:1m`` (none given), ``over:1m`` (200, more than the file's); a runtime of its own."""
    config = tiny_config()
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", config, random_hf_weights(config))
    models = tmp_path / "models.yaml"
    models.write_text(f"capped:1m: {{path: {gguf}, context_length: 64}}\n"
                      f"own:1m: {gguf}\n"
                      f"over:1m: {{path: {gguf}, context_length: 200}}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    monkeypatch.setenv("FLM_BACKEND", "cpu")
    registry.reload()
    runtime = api.Runtime()
    monkeypatch.setattr(api, "default_runtime", runtime)
    yield models
    runtime.close()


def test_a_models_file_context_length_caps_the_engine(tiny_tags):
    capped = api.get_engine("capped:1m")
    assert (capped.context_length, api.get_engine("own:1m").context_length) == (64, 128)
    with pytest.raises(litellm.ContextWindowExceededError, match="context length is 64 tokens"):
        litellm.completion(model="flm/capped:1m", messages=MESSAGES, max_tokens=100)
    with pytest.raises(litellm.ContextWindowExceededError, match="context length is 64 tokens") as info:
        litellm.embedding(model="flm/capped:1m", input=[[5] * 65])
    assert info.value.body["param"] == "input[0]"
    assert len(litellm.embedding(model="flm/capped:1m", input=[[5] * 64]).data) == 1


def test_a_context_length_over_the_models_own_is_refused_naming_the_tag_and_the_file(tiny_tags):
    with pytest.raises(ModelFormatError) as info:
        api.get_engine("over:1m")
    assert str(info.value) == (f"over:1m (models file {tiny_tags}): context_length=200 is more than the model's "
                               "128 positions")
    with pytest.raises(litellm.BadRequestError, match="context_length=200"):
        litellm.completion(model="flm/over:1m", messages=MESSAGES, max_tokens=4)


def test_litellm_registers_the_given_context_else_the_gguf_files_own(tiny_tags):
    litellm_flm.register()
    assert litellm.get_model_info("flm/capped:1m")["max_input_tokens"] == 64
    assert litellm.get_model_info("flm/own:1m")["max_input_tokens"] == 128  # read from the file's header
    assert registry.resolve("own:1m").context_length is None


def test_without_its_file_a_tag_registers_no_context(tmp_path, monkeypatch):
    models = tmp_path / "models.yaml"
    models.write_text(f"gone:1m: {tmp_path / 'gone.gguf'}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    registry.reload()
    assert registry.resolve("gone:1m").known_context_length() is None
    litellm_flm.register()
    assert litellm.get_model_info("flm/gone:1m")["max_input_tokens"] is None


def header_only_gguf(path, **keys):
    """A GGUF of no tensor: ``general.architecture`` llama, then a 300-token vocabulary and
    scores, then ``keys`` (name -> uint32)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    for key, value in keys.items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_the_header_read_skips_what_comes_before_the_context_length_and_refuses_a_cut_file(tmp_path):
    """llama.cpp writes the architecture's keys first; in another order the arrays before the
    context length are skipped, not built."""
    late = header_only_gguf(tmp_path / "late.gguf", **{"llama.rope.scaling.original_context_length": 64,
                                                        "llama.context_length": 96})
    assert gguf_context_length(late) == 96
    assert gguf_context_length(header_only_gguf(tmp_path / "none.gguf")) is None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(late.read_bytes()[:200])
    with pytest.raises(ModelFormatError, match="cut.gguf: not a readable GGUF file"):
        gguf_context_length(cut)


def test_the_built_in_tags_state_their_models_own_context_and_the_engine_serves_it(smollm2_engine, smollm2_gguf,
                                                                                    gemma3_gguf):
    for tag, path in (("smollm2:135m", smollm2_gguf), ("gemma3:270m", gemma3_gguf)):
        assert registry.resolve(tag).context_length == gguf_context_length(path)
    assert smollm2_engine.context_length == registry.resolve("smollm2:135m").context_length == 8192
