"""Hugging Face directories (config.json + safetensors + tokenizer.json) and load_model_files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from flm_runtime.errors import ModelFormatError
from flm_runtime.loading import ModelBundle, load_model_files
from flm_runtime.loading.safetensors_loader import load_hf_dir
from flm_runtime.safetensors_file import read_safetensors


def _bf16(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("dtype,shards", [("F32", 1), ("F16", 1), ("BF16", 1), ("BF16", 3)])
def test_hf_dir_loads_every_dtype_and_shards(tmp_path, dtype, shards):
    config = tiny_config(tie_word_embeddings=False)
    weights = random_hf_weights(config)
    path = write_tiny_hf_dir(tmp_path / "m", config, weights, dtype=dtype, shards=shards)

    model = load_hf_dir(path)

    assert model.config == config
    assert set(model.weights) == set(weights)
    cast = {"F32": lambda w: w, "F16": lambda w: w.astype(np.float16).astype(np.float32),
            "BF16": _bf16}[dtype]
    for name, w in weights.items():
        got = model.weights[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
        np.testing.assert_array_equal(got, cast(w), err_msg=name)


def test_reader_agrees_with_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float16), "c": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "np"})
    got = read_safetensors(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v.astype(np.float32))
        assert got[k].shape == v.shape


def test_tied_checkpoint_drops_redundant_lm_head_and_ignores_inv_freq(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    weights = random_hf_weights(config)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    path = write_tiny_hf_dir(tmp_path / "m", config, weights)
    assert set(load_hf_dir(path).weights) == set(random_hf_weights(config))


def test_wrong_model_type_and_bad_shapes(tmp_path):
    config = tiny_config()
    weights = random_hf_weights(config)
    path = write_tiny_hf_dir(tmp_path / "m", config, weights)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, model_type="gemma")))
    with pytest.raises(ModelFormatError, match="gemma"):
        load_hf_dir(path)
    (path / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=128)))
    with pytest.raises(ModelFormatError, match="gate_proj"):
        load_hf_dir(path)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    config = tiny_config()
    path = write_tiny_hf_dir(tmp_path / "m", config, random_hf_weights(config))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(path)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_model_files(tmp_path / "nothing-here")


def test_load_model_files_gives_the_same_bundle_from_gguf_and_hf_dir(tmp_path):
    config = tiny_config()
    weights = random_hf_weights(config)
    gguf_bundle = load_model_files(write_tiny_gguf(tmp_path / "m.gguf", config, weights))
    hf_bundle = load_model_files(write_tiny_hf_dir(tmp_path / "hf", config, weights))
    for bundle in (gguf_bundle, hf_bundle):
        assert isinstance(bundle, ModelBundle) and bundle.config == config
        for name, w in weights.items():
            np.testing.assert_array_equal(bundle.weights[name], w, err_msg=name)
        tok = bundle.tokenizer
        assert tok.encode("<|im_start|> the") == [1, tok.token_to_id("Ġthe")]
    assert gguf_bundle.source == tmp_path / "m.gguf"


def test_load_model_files_on_smollm2(smollm2_gguf, smollm2_bundle):
    bundle = smollm2_bundle
    assert bundle.source == smollm2_gguf
    assert bundle.config.num_hidden_layers == 30 and bundle.tokenizer.vocab_size == 49152
    assert "model.layers.29.mlp.down_proj.weight" in bundle.weights
