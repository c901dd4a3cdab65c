"""Each model family from its Hugging Face directory and from its GGUF file against transformers'
own logits (``tests/reference/golden_families.npz``, written by
``tests/reference/record_golden.py`` from the checkpoints of ``family_files``), and the loaders'
refusals.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import gguf
import numpy as np
import pytest
from family_files import CASES, GOLDEN_VOCAB, HF_ONLY, golden_tokens, hf_config, hf_tensors, write_gguf, write_hf_dir

from flm_runtime import families
from flm_runtime.errors import ModelFormatError
from flm_runtime.families import rope
from flm_runtime.families.checkpoint import RopeTable
from flm_runtime.loading.gguf import load_gguf
from flm_runtime.loading.safetensors_loader import load_hf_dir
from flm_runtime.models.causal_lm import CausalLM

GOLDEN = dict(np.load(Path(__file__).parents[1] / "reference" / "golden_families.npz"))
F32_TOLERANCE = 1e-4


def _load(tmp_path: Path, case: str, source: str, weights: str = "f32"):
    if source == "hf":
        m = load_hf_dir(write_hf_dir(tmp_path / case, case), weights=weights)
    else:
        m = load_gguf(write_gguf(tmp_path / f"{case}.gguf", case), weights=weights)
    return m.config, m.weights


def _logits(config, weights) -> np.ndarray:
    """Every position's logits of the golden sequence in one prefill, first ``GOLDEN_VOCAB``."""
    model = CausalLM(config, weights)
    return model.forward_batch([golden_tokens()], [model.new_cache()]).logits[:, :GOLDEN_VOCAB]


SOURCES = [pytest.param(c, s, id=f"{c}-{s}") for c in CASES for s in ("hf", "gguf")
           if not (s == "gguf" and c in HF_ONLY)]


@pytest.mark.parametrize("case, source", SOURCES)
def test_float32_logits_match_transformers(tmp_path, case, source):
    """The float32 reference path's logits of every position equal transformers' to 1e-4."""
    config, weights = _load(tmp_path, case, source)
    logits = _logits(config, weights)
    assert logits.shape == GOLDEN[case].shape == (golden_tokens().size, GOLDEN_VOCAB)
    assert np.abs(logits - GOLDEN[case]).max() <= F32_TOLERANCE


LLAMA_ROPES = [c for c in CASES if c.startswith("llama")]
# 8-bit weights in blocks of 32 with float16 scales, and activations quantized to 8 bits before
# each product, move these logits by at most 0.028-0.054 of their standard deviation, the most in
# qwen3 (0.041 against 0.77; qwen2's and gemma3's logits spread ten times wider, and move ten times
# more: 0.31 and 0.24), measured 4 Dec 2026; 0.07 of it leaves a third again, and stays under the
# 0.18 by which the nearest other RoPE scaling moves Llama's, so a wrong table fails.
Q8_TOLERANCE = 0.07  # of the golden logits' standard deviation


@pytest.mark.parametrize("case", CASES)
def test_q8_logits_stay_near_transformers(tmp_path, case):
    """The quantized path (8-bit matrices, the compiled one-call step) within ``Q8_TOLERANCE``
    of the golden logits, and farther than it from every other Llama RoPE scaling's."""
    config, weights = _load(tmp_path, case, "hf", weights="q8")
    model = CausalLM(config, weights)
    assert model.quantized and model.stack is not None
    logits = model.forward_batch([golden_tokens()], [model.new_cache()]).logits[:, :GOLDEN_VOCAB]
    bound = Q8_TOLERANCE * GOLDEN[case].std()
    assert np.abs(logits - GOLDEN[case]).max() <= bound
    assert all(np.abs(logits - GOLDEN[other]).max() > bound for other in LLAMA_ROPES if other != case)


@pytest.mark.parametrize("case", [c for c in CASES if c not in HF_ONLY])
def test_gguf_and_hf_directory_load_the_same_model(tmp_path, case):
    """The GGUF (Q/K permuted by llama.cpp's rule, Gemma's norms stored as 1 + w, LongRoPE and
    llama3 factors as tensors) and the Hugging Face directory give the same weights bit for bit,
    the same config and RoPE tables within float32 rounding: loading runs now for every family."""
    hf_c, hf_w = _load(tmp_path, case, "hf")
    gg_c, gg_w = _load(tmp_path, case, "gguf")
    assert type(hf_c) is type(gg_c) is families.for_model_type(hf_config(case)["model_type"], "").config_class
    assert sorted(hf_w) == sorted(gg_w)
    for name in hf_w:
        np.testing.assert_array_equal(hf_w[name], gg_w[name], err_msg=name)
    assert [f.name for f in fields(hf_c)
            if f.name != "rope_scaling" and getattr(hf_c, f.name) != getattr(gg_c, f.name)] == []
    for scaling in (hf_c.rope_scaling, gg_c.rope_scaling):
        assert (scaling is None) == (hf_c.rope_scaling is None)
    hf_tables = rope.rope_tables(hf_c.head_dim, hf_c.max_position_embeddings, hf_c.rope_theta, hf_c.rope_scaling)
    gg_tables = rope.rope_tables(gg_c.head_dim, gg_c.max_position_embeddings, gg_c.rope_theta, gg_c.rope_scaling)
    for a, b in zip(hf_tables, gg_tables):
        np.testing.assert_allclose(a, b, atol=1e-5)  # llama.cpp's llama3 factors are float32


def test_gemma3_norms_are_folded_and_layers_keep_their_rope(tmp_path):
    """Gemma 3's checkpoint norms ``w`` load as ``1 + w``; its sliding layers take the local table
    (base 10000, unscaled), its global one the scaled base-1e6 table."""
    config, weights = _load(tmp_path, "gemma3", "hf")
    stored = hf_tensors("gemma3")
    np.testing.assert_array_equal(weights["model.layers.1.pre_feedforward_layernorm.weight"],
                                  stored["model.layers.1.pre_feedforward_layernorm.weight"] + np.float32(1))
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_norm.weight"],
                                  stored["model.layers.0.self_attn.q_norm.weight"] + np.float32(1))
    family = families.of_config(config)
    plan = family.rope(config)
    assert plan.layer_table == (1, 0, 1)
    assert plan.tables == (RopeTable(1e6, rope.RopeScaling("linear", 8.0)), RopeTable(10000.0, None))
    specs = [family.layer_spec(config, i) for i in range(3)]
    assert [s.sliding_window for s in specs] == [8, 0, 8]
    assert [s.rope_theta for s in specs] == [10000.0, 1e6, 10000.0]
    assert specs[0].attn_scale == 16 ** -0.5 and specs[0].activation == "gelu_tanh"
    assert family.embed_scale(config) == 8.0


def test_dynamic_ntk_serves_the_context_its_factor_extends_to(tmp_path):
    """Dynamic NTK's ``max_position_embeddings`` (24) is the pretrained context, the factor (2)
    extends it: the model serves 48 positions, and rotates positions below 24 as unscaled RoPE."""
    config, _ = _load(tmp_path, "llama_dynamic", "hf")
    assert config.max_position_embeddings == 48
    assert config.rope_scaling == rope.RopeScaling("dynamic", 2.0, 24)
    scaled = rope.rope_tables(16, 48, 10000.0, config.rope_scaling)
    plain = rope.rope_tables(16, 48, 10000.0)
    for a, b in zip(scaled, plain):
        np.testing.assert_array_equal(a[:24], b[:24])
        assert np.abs(a[24:] - b[24:]).max() > 0.01


# -- refusals ---------------------------------------------------------------------------------


def _write_config(path: Path, case: str, **changes) -> Path:
    write_hf_dir(path, case)
    config = {**hf_config(case), **changes}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("case, changes, message", [
    ("llama", {"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ("llama", {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling type 'mrope' is not supported"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}},
     "rope_scaling type 'llama3' needs the key 'low_freq_factor'"),
    ("llama", {"attention_bias": True}, "llama with attention_bias=true is not supported"),
    ("phi3", {"partial_rotary_factor": 0.75}, "phi3 with partial_rotary_factor=0.75 .partial rotary. is not supported"),
    ("llama", {"num_local_experts": 8}, "llama with experts .mixture of experts. is not supported"),
    ("gemma3", {"hidden_activation": "relu"}, "gemma3_text with hidden_activation='relu' is not supported"),
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types .* is not 3 of"),
])
def test_hf_features_we_do_not_run_are_refused_by_name(tmp_path, case, changes, message):
    with pytest.raises(ModelFormatError, match=message):
        load_hf_dir(_write_config(tmp_path / case, case, **changes))


def test_hf_unknown_tensor_is_refused_by_name(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = write_hf_dir(tmp_path / "llama", "llama")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.0.w1.weight"] = np.zeros((4, 64), np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="unexpected tensors .'model.layers.0.mlp.experts.0.w1.weight'"):
        load_hf_dir(path)


def _rewrite_gguf(src: Path, dst: Path, *, kv: dict | None = None, drop: tuple[str, ...] = (),
                  tensors: dict | None = None) -> Path:
    """``src`` copied to ``dst`` with metadata ``kv`` set (key -> (value, GGUFValueType)), keys
    ``drop`` left out and ``tensors`` (name -> float32 array) added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", *drop) or name in (kv or {}):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for name, (value, vtype) in (kv or {}).items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    for name, value in (tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize("case, kv, tensors, message", [
    ("qwen3", {"qwen3.expert_count": (8, U32)}, None, r"qwen3 with qwen3.expert_count=8 \(mixture of experts\)"),
    ("llama", {"llama.rope.dimension_count": (8, U32)}, None,
     r"partial rotary embedding \(llama.rope.dimension_count=8"),
    ("llama", {"llama.rope.scaling.type": ("longrope", STR)}, None,
     "llama.rope.scaling.type 'longrope' is not supported"),
    ("qwen3", None, {"blk.0.attn_q.bias": np.zeros(128, np.float32)},
     "GGUF tensor 'blk.0.attn_q.bias' is not supported by the qwen3 family"),
])
def test_gguf_features_we_do_not_run_are_refused_by_name(tmp_path, case, kv, tensors, message):
    path = _rewrite_gguf(write_gguf(tmp_path / "src.gguf", case), tmp_path / "dst.gguf", kv=kv, tensors=tensors)
    with pytest.raises(ModelFormatError, match=message):
        load_gguf(path)


def test_gguf_gemma3_sliding_window_pattern_as_a_period(tmp_path):
    """A period instead of one flag per layer: every ``period``-th layer is global (llama.cpp's
    rule; its default, 6, when the key is absent)."""
    src = write_gguf(tmp_path / "src.gguf", "gemma3")
    period = _rewrite_gguf(src, tmp_path / "p.gguf", kv={"gemma3.attention.sliding_window_pattern": (2, U32)})
    assert load_gguf(period).config.layer_windows == (8, 0, 8)
    absent = _rewrite_gguf(src, tmp_path / "a.gguf", drop=("gemma3.attention.sliding_window_pattern",))
    assert load_gguf(absent).config.layer_windows == (8, 8, 8)


def test_rope_factors_of_the_wrong_length_are_refused():
    with pytest.raises(ModelFormatError, match="RoPE short_factor has 3 values, the head dim 16 needs 8"):
        rope.rope_tables(16, 8, 10000.0, rope.RopeScaling("freq_factors", short_factor=(1.0, 2.0, 3.0)))
