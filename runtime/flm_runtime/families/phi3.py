"""The Phi-3 family (Phi-3, Phi-3.5 mini and medium, Phi-4-mini without partial rotary).

Its checkpoints hold the fused matrices ours are: ``self_attn.qkv_proj.weight``
``[(H + 2*Hkv) * D, E]`` (q, k, v rows in that order) is ``LayerWeights.wqkv`` and
``mlp.gate_up_proj.weight`` ``[2F, E]`` (gate rows first: ``Phi3MLP`` chunks gate then up) is
``w_gate_up``, taken as they are. GGUF: ``blk.{i}.attn_qkv`` and ``blk.{i}.ffn_up`` hold the same
fused rows (llama.cpp's ``build_phi3`` splits them the same way); Q/K are not permuted.

Hugging Face config keys beyond Llama's: ``original_max_position_embeddings`` (the pretrained
context; LongRoPE's extension is ``max_position_embeddings`` / it), ``rope_scaling``
``longrope`` (or its older name ``su``) with ``short_factor`` / ``long_factor``,
``sliding_window`` (every layer; None: full), ``partial_rotary_factor`` (refused below 1).
GGUF (``phi3.*``): ``rope.scaling.original_context_length``, ``rope.scaling.attn_factor``,
``attention.sliding_window`` and the ``rope_factors_long`` / ``rope_factors_short`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from flm_runtime.families.checkpoint import WeightTaker
from flm_runtime.families.mistral import Mistral, MistralConfig
from flm_runtime.layers.decoder import LayerWeights
from flm_runtime.model_config import ModelConfig


@dataclass(frozen=True)
class Phi3Config(MistralConfig):
    """Mistral's hyper-parameters (a window on every layer, 0: all positions)."""


class Phi3(Mistral):
    """The Phi-3 family (module docstring): Mistral's window, its own fused tensors and RoPE."""

    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    config_class = Phi3Config
    gguf_block_names = {"attn_norm.weight": "input_layernorm.weight", "attn_qkv.weight": "self_attn.qkv_proj.weight",
                        "attn_output.weight": "self_attn.o_proj.weight",
                        "ffn_norm.weight": "post_attention_layernorm.weight",
                        "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
    gguf_permuted = False

    def layer_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        c = config
        e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
        q_rows = c.num_attention_heads * d
        return {"input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
                "self_attn.qkv_proj.weight": (q_rows + 2 * c.num_key_value_heads * d, e),
                "self_attn.o_proj.weight": (e, q_rows), "mlp.gate_up_proj.weight": (2 * f, e),
                "mlp.down_proj.weight": (e, f)}

    def layer_weights(self, take: WeightTaker, config: ModelConfig, prefix: str) -> LayerWeights:
        shapes = self.layer_shapes(config)

        def one(name: str):
            return take(prefix + name, shapes[name])

        return LayerWeights(attn_norm=one("input_layernorm.weight"), wqkv=one("self_attn.qkv_proj.weight"),
                            wo=one("self_attn.o_proj.weight"), ffn_norm=one("post_attention_layernorm.weight"),
                            w_gate_up=one("mlp.gate_up_proj.weight"), w_down=one("mlp.down_proj.weight"))


FAMILY = Phi3()
