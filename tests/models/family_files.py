"""Tiny random checkpoints of each model family we run, written the way their producers write them:
a Hugging Face directory (``config.json`` and ``model.safetensors`` through ``safetensors.numpy``,
tensors as ``save_pretrained`` names them) and a GGUF file (``gguf.GGUFWriter``, tensors and
metadata as llama.cpp's ``convert_hf_to_gguf.py`` names and lays them out: Llama's and Mistral's
Q/K rows permuted, Gemma's norms stored as ``1 + w``, Phi-3's LongRoPE factors as tensors).

Everything comes from a numpy seed, so ``tests/reference/record_golden.py`` (transformers, run
offline) and the tests build the same checkpoints. This module imports numpy, safetensors and
gguf only: the reference environment has no ``flm_runtime``.

Every case: vocabulary 256, hidden 64, 2 layers (Gemma 3: 3), 4 query and 2 key/value heads,
head dim 16 (Qwen3: 32), and a sequence of ``SEQUENCE`` tokens longer than every window,
original context and dynamic-NTK threshold below, so that each feature changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

SEQUENCE = 40  # tokens of the golden sequence
GOLDEN_VOCAB = 64  # logits columns kept in the golden file: 64 projections of a 64-wide hidden state
VOCAB = 256

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0)

# case -> (model_type, HF architecture, config.json values beyond _BASE)
CASES: dict[str, tuple[str, str, dict]] = {
    "llama": ("llama", "LlamaForCausalLM", {}),
    "llama_linear": ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama_dynamic": ("llama", "LlamaForCausalLM", {"max_position_embeddings": 24,
                                                   "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama_llama3": ("llama", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_yarn": ("llama", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                                            "rope_theta": 1000000.0}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"head_dim": 32, "rms_norm_eps": 1e-6, "attention_bias": False}),
    "mistral": ("mistral", "MistralForCausalLM", {"sliding_window": 8}),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", {
        "num_hidden_layers": 3, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None}),
    "phi3": ("phi3", "Phi3ForCausalLM", {"original_max_position_embeddings": 16, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5, 3.0],
        "long_factor": [1.0, 1.5, 2.2, 3.3, 4.8, 7.0, 10.0, 14.0]}}),
}
# Cases a GGUF cannot hold: llama.cpp has no dynamic-NTK scaling (its converter drops it).
HF_ONLY = ("llama_dynamic",)


def hf_config(case: str) -> dict:
    """The config.json mapping of ``case``."""
    model_type, arch, extra = CASES[case]
    return {**_BASE, **extra, "model_type": model_type, "architectures": [arch], "torch_dtype": "float32"}


def golden_tokens() -> np.ndarray:
    """The golden sequence: ``[SEQUENCE]`` int64 token ids."""
    return np.random.default_rng(1234).integers(3, VOCAB, SEQUENCE)


def hf_tensors(case: str, seed: int = 0) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under Hugging Face's names and layout (float32; Gemma's norms as
    its checkpoints store them, ``w`` of ``1 + w``)."""
    c = hf_config(case)
    model_type = c["model_type"]
    rng = np.random.default_rng(seed)
    e, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    gemma = model_type == "gemma3_text"

    def matrix(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):  # a multiplier near 1 (Gemma stores it less 1)
        return ((0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, e)).astype(np.float32),
         "model.norm.weight": norm(e)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = matrix(VOCAB, e)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(e)
        t[p + "post_attention_layernorm.weight"] = norm(e)
        if model_type == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = matrix(q + 2 * kv, e)
            t[p + "mlp.gate_up_proj.weight"] = matrix(2 * f, e)
        else:
            t.update({p + "self_attn.q_proj.weight": matrix(q, e), p + "self_attn.k_proj.weight": matrix(kv, e),
                      p + "self_attn.v_proj.weight": matrix(kv, e), p + "mlp.gate_proj.weight": matrix(f, e),
                      p + "mlp.up_proj.weight": matrix(f, e)})
        t[p + "self_attn.o_proj.weight"] = matrix(e, q)
        t[p + "mlp.down_proj.weight"] = matrix(e, f)
        if model_type == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                t[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if model_type in ("qwen3", "gemma3_text"):
            t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = norm(d), norm(d)
        if gemma:
            t[p + "pre_feedforward_layernorm.weight"] = norm(e)
            t[p + "post_feedforward_layernorm.weight"] = norm(e)
    return t


def write_hf_dir(path: Path, case: str) -> Path:
    """``case`` as a Hugging Face directory: ``config.json`` and ``model.safetensors``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(case), indent=1))
    save_file(hf_tensors(case), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# Hugging Face name below model.layers.{i}. -> llama.cpp's below blk.{i}. (its tensor_mapping.py)
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GEMMA_BLOCK = {**_GGUF_BLOCK, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
              "phi3": "phi3"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``CausalLM.permute``: rotate-half row order -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, model_type: str) -> str:
    """llama.cpp's name of a Hugging Face tensor of ``model_type``."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    block = _GGUF_GEMMA_BLOCK if model_type == "gemma3_text" else _GGUF_BLOCK
    return f"blk.{layer}.{block[stem]}.{kind}"


def write_gguf(path: Path, case: str) -> Path:
    """``case`` as llama.cpp's converter writes it (F32 tensors; module docstring), no tokenizer."""
    c = hf_config(case)
    model_type = c["model_type"]
    arch = _GGUF_ARCH[model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_vocab_size(c["vocab_size"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_dimension_count(c["head_dim"])
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(c))
    elif kind == "longrope":
        original = c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], np.float32))
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    if model_type == "gemma3_text":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
        w.add_rope_freq_base_swa(c["rope_local_base_freq"])
    for name, t in hf_tensors(case).items():
        if model_type in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_cpp_permute(t, c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"])
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # Gemma3Model.modify_tensors: the multiplier 1 + w
        w.add_tensor(gguf_name(name, model_type), np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_freq_factors(c: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a llama3-scaled config (``CausalLM.generate_extra_tensors``):
    per frequency, the divisor of its base frequency; float32 ``[D/2]``."""
    s = c["rope_scaling"]
    d = c["head_dim"]
    freqs = 1.0 / c["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)
