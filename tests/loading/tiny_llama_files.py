"""Tiny random Llama checkpoints written from scratch: a GGUF file and a Hugging Face directory.

The Q/K permutation here is written out index by index from llama.cpp's description (row ``i`` of
each head goes to ``2i``, row ``D/2 + i`` to ``2i + 1``), independently of the loader's reshape.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from flm_runtime.model_config import ModelConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges as "a b" strings, GGUF token types): 3 specials, 256 bytes, 7 merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte characters (Rust side)
    tokens = SPECIALS + alphabet + ["".join(m) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, [f"{a} {b}" for a, b in MERGES], types


def tiny_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True)
    values.update(overrides)
    return ModelConfig(**values)


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names, in Hugging Face layout."""
    from flm_runtime.families.llama import FAMILY as LLAMA

    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in LLAMA.checkpoint_shapes(config).items()}


def hand_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved order, one row at a time."""
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_BLOCK[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path: Path, config: ModelConfig, weights: dict[str, np.ndarray], *,
                    qtype=gguf.GGMLQuantizationType.F32, arch: str = "llama",
                    pre: str = "smollm", extra_tensors: dict | None = None,
                    replace: dict | None = None, extra_kv: dict | None = None,
                    chat_template: str | None = CHATML) -> Path:
    """Write ``weights`` (HF names/layout) as a llama.cpp-style GGUF, Q/K permuted.

    Matrices are stored as ``qtype`` (quantized with gguf-py); 1-D norms stay F32.
    ``extra_tensors``: GGUF name -> (array, qtype) written as is; ``replace``: the same, in
    place of the tensor of that GGUF name. ``chat_template`` None: none (a base model).
    """
    writer = llama_gguf_writer(path, config, arch=arch, pre=pre, chat_template=chat_template)
    for key, value in (extra_kv or {}).items():
        if key == gguf.Keys.General.ALIGNMENT:  # the writer aligns the tensors' offsets to it too
            writer.add_custom_alignment(value[0])
        else:
            writer.add_key_value(key, value[0], value[1])
    for name, w in weights.items():
        if name.endswith("q_proj.weight"):
            w = hand_permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = hand_permute(w, config.num_key_value_heads)
        name = gguf_name(name)
        if name in (replace or {}):
            _add_tensor(writer, name, *replace[name])
        else:
            _add_tensor(writer, name, w, qtype if w.ndim == 2 else gguf.GGMLQuantizationType.F32)
    for name, (w, t) in (extra_tensors or {}).items():
        _add_tensor(writer, name, w, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_gguf_writer(path: Path, config: ModelConfig, *, arch: str = "llama", pre: str = "smollm",
                      chat_template: str | None = CHATML) -> gguf.GGUFWriter:
    """A ``GGUFWriter`` of ``path`` holding a Llama's metadata (``config``) and the tiny tokenizer's
    (``chat_template`` None: none); the caller adds the tensors and writes the file."""
    writer = gguf.GGUFWriter(str(path), arch)
    _add_llama_kv(writer, config, arch)
    _add_tokenizer_kv(writer, pre, chat_template)
    return writer


def _add_tensor(writer, name: str, w: np.ndarray, qtype) -> None:
    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif w.dtype == np.uint8:  # already quantized bytes
        writer.add_tensor(name, w, raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def _add_llama_kv(writer, c: ModelConfig, arch: str) -> None:
    writer.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_uint32(f"{arch}.rope.dimension_count", c.head_dim)


def _add_tokenizer_kv(writer, pre: str, chat_template: str | None) -> None:
    tokens, merges, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def tiny_tokenizer_json() -> str:
    """tokenizer.json text for the tiny vocabulary (GPT-2 style, built with ``tokenizers``)."""
    tokens, _, _ = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Write a safetensors file by hand (F32, F16 or BF16; BF16 by truncating float32)."""
    header, chunks, offset = {}, [], 0
    for name, w in tensors.items():
        w32 = np.ascontiguousarray(w, dtype=np.float32)
        raw = {"F32": lambda: w32.tobytes(), "F16": lambda: w32.astype("<f2").tobytes(),
               "BF16": lambda: (w32.view(np.uint32) >> 16).astype("<u2").tobytes()}[dtype]()
        header[name] = {"dtype": dtype, "shape": list(w.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def write_tiny_hf_dir(path: Path, config: ModelConfig, weights: dict[str, np.ndarray], *,
                      dtype: str = "F32", shards: int = 1, chat_template: str = CHATML) -> Path:
    """A Hugging Face style directory: config.json, safetensors (sharded if asked), tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(weights)
    if shards == 1:
        write_safetensors(path / "model.safetensors", weights, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::shards]}
            write_safetensors(path / file, part, dtype)
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf_config = {f: getattr(config, f) for f in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rope_theta",
        "rms_norm_eps", "tie_word_embeddings", "head_dim")}
    hf_config.update(model_type="llama", architectures=["LlamaForCausalLM"], eos_token_id=2)
    (path / "config.json").write_text(json.dumps(hf_config))
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return path
