"""The Gemma 3 family (text: ``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Against Llama: the embedding rows are scaled by ``sqrt(E)``; four norms per layer (before and
after attention, before and after the FFN) and QK-norm, every one scaling by ``1 + w``; a GeGLU FFN
(tanh GELU); scores scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window layers
interleaved with global ones, the sliding ones on their own RoPE base (``rope_local_base_freq``,
unscaled), the global ones on ``rope_theta`` with ``rope_scaling``; an optional soft-cap of the
final logits.

Hugging Face config keys beyond Llama's: ``query_pre_attn_scalar``, ``sliding_window``,
``layer_types`` (default: every 6th layer global, ``Gemma3TextConfig``), ``rope_local_base_freq``,
``final_logit_softcapping``, ``hidden_activation`` (must be ``gelu_pytorch_tanh``);
``attention_bias``, ``use_bidirectional_attention`` and an ``attn_logit_softcapping`` (Gemma 2's,
null in Gemma 3's configs) are refused. GGUF
(``gemma3.*``): ``attention.sliding_window``, ``attention.sliding_window_pattern`` (one bool per
layer, true = sliding; absent: llama.cpp's period of 6), ``rope.freq_base_swa`` (absent:
llama.cpp's 10000); the score scale is llama.cpp's (``llama-model.cpp``): ``key_length ** -0.5``,
``(E / H) ** -0.5`` for the 62-layer 27B.

Tensors below ``model.layers.{i}.``: Llama's attention and FFN, ``self_attn.{q,k}_norm``,
``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``; GGUF ``attn_q_norm``, ``attn_k_norm``, ``attn_norm``,
``post_attention_norm``, ``ffn_norm``, ``post_ffw_norm``. Norm weights: a Hugging Face checkpoint
stores ``w`` and the loader folds in the 1 (``norm_offset``); llama.cpp's converter already
stored ``1 + w`` (``Gemma3Model.modify_tensors``), which is read as it is. Q/K rows are not
permuted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from flm_runtime.errors import ModelFormatError
from flm_runtime.families.checkpoint import GGUFMetadata, RopePlan, RopeTable, WeightTaker, layer_windows
from flm_runtime.families.llama import Llama, fuse_layer
from flm_runtime.layers.decoder import LayerWeights
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.model_config import COUNT, NON_NEGATIVE, POSITIVE, ROPE_BASE, SIZE, Bound, ModelConfig, require

_PATTERN = 6  # Gemma 3's default: layers 6, 12, ... (1-based) are global
_LOCAL_BASE = 10000.0  # Gemma 3's and llama.cpp's default RoPE base of the sliding layers
_LAYERS_27B = 62  # llama.cpp tells Gemma 3 27B, whose score scale differs, by its layer count


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """Llama's hyper-parameters and Gemma 3's (module docstring).

    Attributes:
        query_pre_attn_scalar: the scores are scaled by its inverse square root.
        layer_windows: ``[L]`` each layer's sliding window (0: global).
        rope_local_base_freq: the sliding layers' RoPE base.
        final_logit_softcapping: the final logits' soft-cap (0: none).
    """

    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float = 256.0
    layer_windows: tuple[int, ...] = ()
    rope_local_base_freq: float = _LOCAL_BASE
    final_logit_softcapping: float = 0.0

    BOUNDS: ClassVar[dict[str, Bound]] = {**ModelConfig.BOUNDS, "query_pre_attn_scalar": POSITIVE,
                                          "rope_local_base_freq": ROPE_BASE, "final_logit_softcapping": NON_NEGATIVE}


class Gemma3(Llama):
    """The Gemma 3 family (module docstring)."""

    model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    config_class = Gemma3Config
    gguf_block_names = {**Llama.gguf_block_names, "attn_q_norm.weight": "self_attn.q_norm.weight",
                        "attn_k_norm.weight": "self_attn.k_norm.weight",
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
    gguf_permuted = False
    norm_offset = 1.0
    gguf_keys = {**Llama.gguf_keys, "rope_local_base_freq": "rope.freq_base_swa",
                 "final_logit_softcapping": "final_logit_softcapping"}

    def hf_values(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        for key in ("use_bidirectional_attention",):
            if config.get(key):
                raise ModelFormatError(f"{source}: gemma3_text with {key}=true is not supported")
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelFormatError(f"{source}: gemma3_text with hidden_activation={act!r} is not supported "
                                   "(gelu_pytorch_tanh)")
        values = super().hf_values({"head_dim": 256, "rope_theta": 1_000_000.0, **config}, source)
        n = values["num_hidden_layers"]
        period = require(config.get("sliding_window_pattern", _PATTERN), COUNT, "sliding_window_pattern")
        default = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
        values["layer_windows"] = layer_windows(config, n, default, source)
        if config.get("attn_logit_softcapping"):
            raise ModelFormatError(f"{source}: gemma3_text with attn_logit_softcapping="
                                   f"{config['attn_logit_softcapping']} is not supported (attention-logit soft-capping)")
        values["final_logit_softcapping"] = config.get("final_logit_softcapping") or 0.0  # null: none
        return values

    def gguf_values(self, meta: GGUFMetadata) -> dict[str, Any]:
        if meta.decimal("attn_logit_softcapping", 0.0):
            raise ModelFormatError(f"{meta.source}: gemma3 with gemma3.attn_logit_softcapping is not supported "
                                   "(attention-logit soft-capping)")
        values = super().gguf_values(meta)
        n, window = values["num_hidden_layers"], meta.count("attention.sliding_window", 0, SIZE)
        pattern = meta.key("attention.sliding_window_pattern", _PATTERN)
        if isinstance(pattern, list):
            sliding = list(map(bool, pattern))
        else:
            period = meta.count("attention.sliding_window_pattern", _PATTERN)
            sliding = [(i + 1) % period != 0 for i in range(n)]
        if len(sliding) != n:
            raise ModelFormatError(f"{meta.source}: gemma3.attention.sliding_window_pattern has {len(sliding)} "
                                   f"layers, the model {n}")
        hidden, heads = values["hidden_size"], values["num_attention_heads"]
        # llama.cpp's score scale: its head width (key_length, else hidden / heads), or hidden / heads for the 27B
        scalar = hidden / heads if n == _LAYERS_27B or values["head_dim"] is None else values["head_dim"]
        key = self.gguf_keys
        return {**values, "layer_windows": tuple(window if s else 0 for s in sliding),
                "query_pre_attn_scalar": float(scalar),
                "rope_local_base_freq": meta.decimal(key["rope_local_base_freq"], _LOCAL_BASE, ROPE_BASE),
                "final_logit_softcapping": meta.decimal(key["final_logit_softcapping"], 0.0)}

    def layer_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(config)
        e, d = config.hidden_size, config.head_dim
        return {**shapes, "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                "pre_feedforward_layernorm.weight": (e,), "post_feedforward_layernorm.weight": (e,)}

    def layer_weights(self, take: WeightTaker, config: ModelConfig, prefix: str) -> LayerWeights:
        shapes = self.layer_shapes(config)

        def one(name: str):
            return take(prefix + name, shapes[name])

        # Llama's post_attention_layernorm is the FFN's norm; Gemma's is the attention output's.
        return replace(fuse_layer(take, config, prefix), ffn_norm=one("pre_feedforward_layernorm.weight"),
                       post_attn_norm=one("post_attention_layernorm.weight"),
                       post_ffn_norm=one("post_feedforward_layernorm.weight"),
                       q_norm=one("self_attn.q_norm.weight"), k_norm=one("self_attn.k_norm.weight"))

    def layer_spec(self, config: Gemma3Config, layer: int) -> LayerSpec:
        window = config.layer_windows[layer]
        return replace(super().layer_spec(config, layer), qk_norm=True, post_norms=True, activation="gelu_tanh",
                       sliding_window=window,
                       attn_scale=config.query_pre_attn_scalar ** -0.5,
                       rope_theta=config.rope_local_base_freq if window else config.rope_theta)

    def rope(self, config: Gemma3Config) -> RopePlan:
        tables = (RopeTable(config.rope_theta, config.rope_scaling), RopeTable(config.rope_local_base_freq, None))
        return RopePlan(tables, tuple(1 if w else 0 for w in config.layer_windows))

    def embed_scale(self, config: ModelConfig) -> float:
        return math.sqrt(config.hidden_size)

    def final_softcap(self, config: Gemma3Config) -> float:
        return config.final_logit_softcapping


FAMILY = Gemma3()
