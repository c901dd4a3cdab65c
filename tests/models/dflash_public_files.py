"""Tiny drafts in the public DFlash format (the ``dflash`` package's ``DFlashDraftModel``: a Hugging
Face Qwen3 ``config.json`` with the DFlash keys, bfloat16 ``model.safetensors`` with QK-norm and
no embedding, LM head or mask embedding of its own) for the tiny ``qwen3`` and ``llama_llama3``
targets of ``family_files``.

Everything comes from a numpy seed, so ``tests/reference/record_dflash_golden.py`` (the ``dflash``
package's torch reference, run offline) and ``tests/models/test_dflash_published.py`` build the
same drafts. This module imports numpy, safetensors and ``family_files`` only: the reference
environment has no ``flm_runtime``.

The two cases differ where the format lets a draft differ: the ``qwen3`` draft keeps its DFlash
keys in a ``dflash_config`` object, has two layers and scales its input rows
(``input_embedding_scale``); the ``llama_llama3`` draft keeps them at the top level, has one layer
of its own geometry (2 heads of 32, not the target's 4 of 16), Llama 3.1's RoPE scaling, an
``output_multiplier`` and a logit soft-cap.

A draft of random weights agrees with its target by chance only. Each case's prompt makes its
tiny target repeat one token for a while (found by running the target), and its
``mask_token_id`` is a token whose embedding, through a draft whose layers add little to the
residual stream (``scale``), predicts that token: those steps accept several tokens, the others
one, so the golden acceptance lengths test the draft's drafted tokens, not only its rejections.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from family_files import hf_config
from safetensors import TensorSpec, serialize_file

BLOCK_SIZE = 16
NEW_TOKENS = 40  # the golden generation's max_new_tokens
CONTEXT = 24  # context positions of the golden draft logits: taps of positions 0 .. 23, anchor at 24


@dataclass(frozen=True)
class PublicCase:
    """One tiny public draft.

    Attributes:
        target: its target's case in ``family_files.CASES``.
        layers: draft layers.
        taps: ``target_layer_ids``.
        heads, kv_heads, head_dim, ffn: the draft's own layer geometry.
        mask_token_id: the target id whose embedding fills the block's masks.
        prompt: the golden generation's prompt.
        seed, scale: the numpy seed and the standard deviation of the matrices.
        in_dflash_config: the DFlash keys sit in a ``dflash_config`` object (else at the top level).
        extra: further DFlash keys (scales, soft-cap), where the DFlash keys sit.
    """

    target: str
    layers: int
    taps: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    mask_token_id: int
    prompt: tuple[int, ...]
    seed: int
    scale: float
    in_dflash_config: bool
    extra: dict = field(default_factory=dict)


CASES = {
    "qwen3": PublicCase("qwen3", layers=2, taps=(0, 1), heads=4, kv_heads=2, head_dim=32, ffn=96,
                        mask_token_id=198, prompt=(73, 209, 172, 3, 73, 209, 172, 3), seed=11, scale=0.02,
                        in_dflash_config=True, extra={"input_embedding_scale": 1.5}),
    "llama_llama3": PublicCase("llama_llama3", layers=1, taps=(1,), heads=2, kv_heads=1, head_dim=32, ffn=80,
                               mask_token_id=198, prompt=(10, 20, 30, 40, 10, 20, 30, 40), seed=12, scale=0.02,
                               in_dflash_config=False,
                               extra={"output_multiplier": 0.8, "final_logit_softcapping": 20.0}),
}


def draft_config(name: str) -> dict:
    """The ``config.json`` mapping of draft ``name`` (a Qwen3 config, as the dflash package saves one)."""
    case, target = CASES[name], hf_config(CASES[name].target)
    dflash = {"target_layer_ids": list(case.taps), "mask_token_id": case.mask_token_id, "block_size": BLOCK_SIZE,
              **case.extra}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "vocab_size": target["vocab_size"], "hidden_size": target["hidden_size"], "intermediate_size": case.ffn,
        "num_hidden_layers": case.layers, "num_target_layers": target["num_hidden_layers"],
        "num_attention_heads": case.heads, "num_key_value_heads": case.kv_heads, "head_dim": case.head_dim,
        "rms_norm_eps": target["rms_norm_eps"], "rope_theta": target["rope_theta"],
        "rope_scaling": target.get("rope_scaling"), "max_position_embeddings": target["max_position_embeddings"],
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
    }
    return config | ({"dflash_config": dflash} if case.in_dflash_config else dflash)


def bfloat16_values(w: np.ndarray) -> np.ndarray:
    """``w`` truncated to bfloat16 (the upper 16 bits of each float32), as float32."""
    return (np.ascontiguousarray(w, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def draft_tensors(name: str) -> dict[str, np.ndarray]:
    """The draft's tensors under the dflash package's names, float32 holding bfloat16 values."""
    case, config = CASES[name], draft_config(name)
    rng = np.random.default_rng(case.seed)
    e, f, d = config["hidden_size"], case.ffn, case.head_dim
    q, kv = case.heads * d, case.kv_heads * d

    def matrix(*shape):
        return case.scale * rng.standard_normal(shape)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    t = {"fc.weight": 0.3 * rng.standard_normal((e, len(case.taps) * e)) / np.sqrt(len(case.taps)),
         "hidden_norm.weight": norm(e), "norm.weight": norm(e)}
    for i in range(case.layers):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(e), p + "post_attention_layernorm.weight": norm(e),
              p + "self_attn.q_proj.weight": matrix(q, e), p + "self_attn.k_proj.weight": matrix(kv, e),
              p + "self_attn.v_proj.weight": matrix(kv, e), p + "self_attn.o_proj.weight": matrix(e, q),
              p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
              p + "mlp.gate_proj.weight": matrix(f, e), p + "mlp.up_proj.weight": matrix(f, e),
              p + "mlp.down_proj.weight": matrix(e, f)}
    return {k: bfloat16_values(v) for k, v in t.items()}


def write_draft_dir(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """Write ``config.json`` and a bfloat16 ``model.safetensors`` into ``path`` (``safetensors.serialize_file``
    over each tensor's upper 16 bits: numpy has no bfloat16 for ``safetensors.numpy``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    halves = {k: (bfloat16_values(v).view(np.uint32) >> 16).astype("<u2") for k, v in tensors.items()}
    serialize_file({k: TensorSpec(dtype="bfloat16", shape=h.shape, data_ptr=h.ctypes.data, data_len=h.nbytes)
                    for k, h in halves.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_case(path: Path, name: str) -> Path:
    """Draft ``name`` as a directory."""
    return write_draft_dir(path, draft_config(name), draft_tensors(name))
