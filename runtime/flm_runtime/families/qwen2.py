"""The Qwen2 family (Qwen2, Qwen2.5): Llama with a bias on the q, k and v projections.

Hugging Face config keys beyond Llama's: ``use_sliding_window``, ``sliding_window``,
``max_window_layers`` and ``layer_types`` (a sliding window on the layers from
``max_window_layers`` on, when ``use_sliding_window``). GGUF: ``qwen2.*``, no sliding window.

Tensors: Llama's, plus ``self_attn.{q,k,v}_proj.bias`` (GGUF ``blk.{i}.attn_{q,k,v}.bias``),
stacked into ``LayerWeights.qkv_bias`` in the rows' order. llama.cpp's converter leaves this
family's Q/K rows as they are (its rope is the rotate-half "neox" kind).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from flm_runtime.families.checkpoint import WeightTaker, layer_windows
from flm_runtime.families.llama import Llama
from flm_runtime.layers.decoder import LayerWeights
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.model_config import SIZE, ModelConfig, require, require_flag

QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def qwen_layer_windows(config: dict[str, Any], n_layers: int, source: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) by Qwen's rule: ``layer_types`` if the
    config has them, else a window on layers ``max_window_layers ..`` when ``use_sliding_window``
    (``Qwen2Config.__init__``); empty when no layer has one (as a GGUF, which has no window).

    Raises:
        ModelFormatError: ``layer_types`` of another length or with another type, naming it.
        ConfigValueError: ``use_sliding_window`` not a flag, or ``sliding_window`` or
            ``max_window_layers`` not an integer of at least 0.
    """
    use = require_flag(config.get("use_sliding_window") or False, "use_sliding_window")
    use = use and bool(config.get("sliding_window"))
    first = require(config.get("max_window_layers", n_layers), SIZE, "max_window_layers")
    default = ["sliding_attention" if use and i >= first else "full_attention" for i in range(n_layers)]
    windows = layer_windows({**config, "sliding_window": config.get("sliding_window") if use else 0}, n_layers,
                            default, source)
    return windows if any(windows) else ()


@dataclass(frozen=True)
class Qwen2Config(ModelConfig):
    """Llama's hyper-parameters and each layer's sliding window (``layer_windows``: 0 for full
    attention; empty: none anywhere)."""

    rms_norm_eps: float = 1e-6
    layer_windows: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0


class Qwen2(Llama):
    """The Qwen2 family (module docstring)."""

    model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)
    config_class = Qwen2Config
    gguf_block_names = {**Llama.gguf_block_names, "attn_q.bias": "self_attn.q_proj.bias",
                        "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias"}
    gguf_permuted = False

    def hf_values(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        # the q/k/v biases are the family's own, not Llama's attention_bias (which biases o_proj too)
        values = super().hf_values({k: v for k, v in config.items() if k != "attention_bias"}, source)
        values["layer_windows"] = qwen_layer_windows(config, values["num_hidden_layers"], source)
        return values

    def layer_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(config)
        d = config.head_dim
        shapes.update({"self_attn.q_proj.bias": (config.num_attention_heads * d,),
                       "self_attn.k_proj.bias": (config.num_key_value_heads * d,),
                       "self_attn.v_proj.bias": (config.num_key_value_heads * d,)})
        return shapes

    def layer_weights(self, take: WeightTaker, config: ModelConfig, prefix: str) -> LayerWeights:
        shapes = self.layer_shapes(config)
        bias = np.concatenate([take(prefix + name, shapes[name]) for name in QKV_BIAS])
        return replace(super().layer_weights(take, config, prefix), qkv_bias=bias)

    def layer_spec(self, config: Qwen2Config, layer: int) -> LayerSpec:
        return replace(super().layer_spec(config, layer), qkv_bias=True, sliding_window=config.window(layer))


FAMILY = Qwen2()
