"""The Qwen3 family (dense Qwen3): Llama with QK-norm, an RMSNorm over each query and key head
before RoPE.

Hugging Face config keys beyond Llama's: ``head_dim`` (its own default, 128),
``attention_bias`` (refused: it would bias o_proj too), and Qwen2's sliding-window keys.
GGUF: ``qwen3.*`` (``qwen3.attention.key_length`` is the head dim).

Tensors: Llama's, plus ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight`` ``[D]``
(GGUF ``blk.{i}.attn_q_norm.weight`` / ``attn_k_norm.weight``), weights used as they are. Q/K
rows are not permuted by llama.cpp's converter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flm_runtime.families.checkpoint import WeightTaker
from flm_runtime.families.llama import Llama
from flm_runtime.families.qwen2 import Qwen2Config, qwen_layer_windows
from flm_runtime.layers.decoder import LayerWeights
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.model_config import ModelConfig


@dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    """Qwen2's hyper-parameters (Llama's and each layer's sliding window)."""


class Qwen3(Llama):
    """The Qwen3 family (module docstring)."""

    model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    config_class = Qwen3Config
    gguf_block_names = {**Llama.gguf_block_names, "attn_q_norm.weight": "self_attn.q_norm.weight",
                        "attn_k_norm.weight": "self_attn.k_norm.weight"}
    gguf_permuted = False

    def hf_values(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        values = super().hf_values({"head_dim": 128, **config}, source)
        values["layer_windows"] = qwen_layer_windows(config, values["num_hidden_layers"], source)
        return values

    def layer_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        d = config.head_dim
        return {**super().layer_shapes(config), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}

    def layer_weights(self, take: WeightTaker, config: ModelConfig, prefix: str) -> LayerWeights:
        shapes = self.layer_shapes(config)
        return replace(super().layer_weights(take, config, prefix),
                       q_norm=take(prefix + "self_attn.q_norm.weight", shapes["self_attn.q_norm.weight"]),
                       k_norm=take(prefix + "self_attn.k_norm.weight", shapes["self_attn.k_norm.weight"]))

    def layer_spec(self, config: Qwen3Config, layer: int) -> LayerSpec:
        return replace(super().layer_spec(config, layer), qk_norm=True, sliding_window=config.window(layer))


FAMILY = Qwen3()
