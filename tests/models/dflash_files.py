"""Random DFlash draft directories in the format of docs/dflash.md, written from scratch for tests.

The weights are random (no trained draft exists in the test suite): a random draft proposes
near-random tokens, so speculative output must still equal the target's own, only slower.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from flm_runtime.model_config import ModelConfig


def tap_layers(n_layers: int, n_taps: int) -> list[int]:
    """docs/dflash.md's default taps: ``round(1 + i*(L-4)/(n-1))`` with Python's ``round``."""
    return [round(1 + i * (n_layers - 4) / (n_taps - 1)) for i in range(n_taps)]


def draft_config_dict(target: ModelConfig, *, layers: int = 1, taps: list[int] | None = None,
                      mask_token_id: int = 1, target_tag: str = "tiny:test",
                      target_sha256: str | None = None, **overrides) -> dict:
    """A ``config.json`` mapping for a draft of ``target`` (geometry copied from it)."""
    config = {
        "architecture": "dflash-llama", "target": target_tag, "target_sha256": target_sha256,
        "block_size": 8, "mask_token_id": mask_token_id,
        "target_layer_ids": taps if taps is not None else tap_layers(target.num_hidden_layers, 5),
        "num_hidden_layers": layers, "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "training": {"note": "random weights for tests"},
    }
    return config | overrides


def random_draft_weights(config: dict, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """float32 tensors with the names and shapes of docs/dflash.md for ``config`` (a dict)."""
    rng = np.random.default_rng(seed)
    e, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    hq, hkv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    n = len(config["target_layer_ids"])

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    weights = {"fc.weight": w(e, n * e, s=scale / np.sqrt(n)), "hidden_norm.weight": 1 + w(e),
               "mask_embedding": w(e, s=1.0), "norm.weight": 1 + w(e)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + w(e), p + "post_attention_layernorm.weight": 1 + w(e),
            p + "self_attn.q_proj.weight": w(hq, e), p + "self_attn.k_proj.weight": w(hkv, e),
            p + "self_attn.v_proj.weight": w(hkv, e), p + "self_attn.o_proj.weight": w(e, hq),
            p + "mlp.gate_proj.weight": w(f, e), p + "mlp.up_proj.weight": w(f, e),
            p + "mlp.down_proj.weight": w(e, f),
        }
    return weights


def write_draft_dir(path: Path, config: dict, weights: dict[str, np.ndarray], dtype=np.float16) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float tensors cast to ``dtype``) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file({k: np.ascontiguousarray(v, dtype=dtype if v.dtype.kind == "f" else v.dtype) for k, v in weights.items()},
              str(path / "model.safetensors"))
    return path
