"""The Llama family (Llama 2/3, SmolLM2): the base every other family extends (``families.checkpoint``).

Hugging Face config keys: ``ModelConfig``'s fields, ``rope_scaling`` (``families.rope``: linear,
dynamic, llama3, yarn), ``attention_bias`` and ``mlp_bias`` (refused: no bias of o_proj or of
the FFN runs here). GGUF: ``llama.*`` keys, ``llama.rope.scaling.*`` and llama.cpp's
``rope_freqs.weight`` (its converter's form of llama3 scaling).

Tensors below ``model.layers.{i}.``: ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm`` (the FFN's norm), ``mlp.{gate,up,down}_proj``; in GGUF
``blk.{i}.attn_norm``, ``attn_{q,k,v,output}``, ``ffn_norm``, ``ffn_{gate,up,down}``. Q/K/V and
gate/up are fused into ``LayerWeights.wqkv`` / ``w_gate_up`` (one product each).

RoPE convention: Hugging Face's "rotate half" (dimension ``i`` pairs with ``i + D/2``).
llama.cpp's converter permutes the rows of each q_proj/k_proj head of this family (and only
of this family among ours) for its interleaved pairs; the GGUF loader undoes it
(``gguf_permuted``).
"""

from __future__ import annotations

from typing import Any

from flm_runtime.errors import ModelFormatError
from flm_runtime.families import rope
from flm_runtime.families.checkpoint import GGUFMetadata, RopePlan, RopeTable, WeightTaker, config_refusals
from flm_runtime.kernels import cpu
from flm_runtime.layers.decoder import LayerWeights
from flm_runtime.layers.spec import LayerConfig, LayerSpec
from flm_runtime.model_config import CONTEXT, HEAD_DIM, LAYERS, POSITIVE, ROPE_BASE, SIZE, ModelConfig, require

KV_PROJ = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
QKV_PROJ = ("self_attn.q_proj.weight", *KV_PROJ)  # LayerWeights.wqkv's rows, in this order
GATE_UP_PROJ = ("mlp.gate_proj.weight", "mlp.up_proj.weight")  # LayerWeights.w_gate_up's rows
RUN_ORDER = ("input_layernorm.weight", *QKV_PROJ, "self_attn.o_proj.weight", "post_attention_layernorm.weight",
             *GATE_UP_PROJ, "mlp.down_proj.weight")


def layer_weight_shapes(config: LayerConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one Llama decoder layer, by Hugging Face name below the layer's prefix,
    with their ``[out, in]`` shapes."""
    c = config
    e, f = c.hidden_size, c.intermediate_size
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
            "self_attn.q_proj.weight": (q_rows, e), "self_attn.k_proj.weight": (kv_rows, e),
            "self_attn.v_proj.weight": (kv_rows, e), "self_attn.o_proj.weight": (e, q_rows),
            "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e), "mlp.down_proj.weight": (e, f)}


def take_fused(take: WeightTaker, config: LayerConfig, prefix: str, names: tuple[str, ...]) -> cpu.Weight:
    """The tensors ``prefix + name`` of one layer (names of ``layer_weight_shapes``) stacked by rows,
    in that order: one matrix product instead of one per tensor (a weight fusion).

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape.
    """
    shapes = layer_weight_shapes(config)
    return cpu.stack_rows([take(prefix + name, shapes[name]) for name in names])


def fuse_layer(take: WeightTaker, config: LayerConfig, prefix: str) -> LayerWeights:
    """One Llama decoder layer's weights (the tensors of ``layer_weight_shapes`` below ``prefix``)
    as a ``LayerWeights``.

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape.
    """
    shapes = layer_weight_shapes(config)

    def one(name: str) -> cpu.Weight:
        return take(prefix + name, shapes[name])

    return LayerWeights(
        attn_norm=one("input_layernorm.weight"),
        wqkv=take_fused(take, config, prefix, QKV_PROJ),
        wo=one("self_attn.o_proj.weight"),
        ffn_norm=one("post_attention_layernorm.weight"),
        w_gate_up=take_fused(take, config, prefix, GATE_UP_PROJ),
        w_down=one("mlp.down_proj.weight"),
    )


# The tensors every family names alike, GGUF -> Hugging Face.
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                     "output.weight": "lm_head.weight"}


class Llama:
    """The Llama family (module docstring); its methods are what a family says
    (``families.checkpoint``), overridden by the families that differ."""

    model_types: tuple[str, ...] = ("llama",)
    gguf_architectures: tuple[str, ...] = ("llama",)
    config_class: type[ModelConfig] = ModelConfig
    # GGUF tensor name below ``blk.{i}.`` -> Hugging Face name below ``model.layers.{i}.``
    gguf_block_names: dict[str, str] = {
        "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
    # Config field -> its GGUF key below ``{arch}.``: read there, and named when the config refuses it.
    gguf_keys: dict[str, str] = {
        "vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv", "max_position_embeddings": "context_length",
        "rope_theta": "rope.freq_base", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
        "head_dim": "attention.key_length"}
    gguf_permuted = True  # llama.cpp's converter permutes q_proj / k_proj rows (module docstring)
    norm_offset = 0.0  # a Hugging Face checkpoint's norms scale by ``norm_offset + w``

    @property
    def name(self) -> str:
        return self.model_types[0]

    # -- config -------------------------------------------------------------------------------

    def config_from_hf(self, values: dict[str, Any], source: str) -> ModelConfig:
        """The config of a ``config.json`` mapping of this family.

        Args:
            source: the config.json file, for error messages.

        Raises:
            ModelFormatError: a feature this runtime does not run (named with its key), missing
                keys, or a value of the wrong type or out of range (``model_config.ModelConfig``), naming
                the key and the value.
        """
        with config_refusals(source, "key", str):
            values = self.hf_values(values, source)
            try:
                return self.config_class.from_dict(values)
            except TypeError as e:
                raise ModelFormatError(f"{source}: incomplete {self.name} config ({e})") from e

    def hf_values(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        """``config``'s values as this family's config class takes them (defaults filled,
        ``rope_scaling`` parsed); a family extends it with its keys and refusals.

        Raises:
            ModelFormatError: a feature this runtime does not run, naming its key.
            ConfigValueError: a value this reading computes with of the wrong type or out of range.
        """
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ModelFormatError(f"{source}: {self.name} with {key}=true is not supported (no bias of "
                                       "o_proj or of the FFN runs here)")
        rotary = config.get("partial_rotary_factor")  # null: all of each head
        if rotary is not None and require(rotary, POSITIVE, "partial_rotary_factor") != 1.0:
            raise ModelFormatError(f"{source}: {self.name} with partial_rotary_factor="
                                   f"{config['partial_rotary_factor']} (partial rotary) is not supported")
        if config.get("num_local_experts") or config.get("num_experts"):
            raise ModelFormatError(f"{source}: {self.name} with experts (mixture of experts) is not supported")
        values = dict(config)
        values.setdefault("num_key_value_heads", values.get("num_attention_heads"))
        # a family lists each layer's window from it: bounded before any list is made
        values["num_hidden_layers"] = require(values.get("num_hidden_layers"), LAYERS, "num_hidden_layers")
        # 2048: transformers' ModelConfig default
        positions = require(values.get("max_position_embeddings", 2048), CONTEXT, "max_position_embeddings")
        scaling = rope.scaling_from_hf(config.get("rope_scaling"), positions,
                                       original_max_position_embeddings=require(
                                           config.get("original_max_position_embeddings") or 0, SIZE,
                                           "original_max_position_embeddings"),
                                       source=source)
        values["rope_scaling"] = scaling
        values["max_position_embeddings"] = require(rope.context_length(positions, scaling), CONTEXT,
                                                    "max_position_embeddings × rope_scaling.factor")
        return values

    def config_from_gguf(self, meta: GGUFMetadata) -> ModelConfig:
        """The config of a GGUF file of this family (its ``{arch}.*`` keys).

        ``head_dim`` is ``{arch}.attention.key_length`` if present, else
        ``{arch}.rope.dimension_count``, else hidden / heads. The embedding is tied to the LM head
        exactly when the file has no ``output.weight`` (llama.cpp then reuses the embedding).

        Raises:
            ModelFormatError: a missing key, partial rotary embedding, mixture of experts, a
                RoPE scaling we lack, or a value of the wrong type or out of range (``model_config.ModelConfig``),
                naming the key (and the value).
        """
        def key(field: str) -> str:  # a config field's GGUF key; a GGUF key refused as read is named already
            return f"{meta.arch}.{self.gguf_keys[field]}" if field in self.gguf_keys else field

        with config_refusals(meta.source, "metadata key", key):
            return self.config_class(**self.gguf_values(meta))

    def gguf_values(self, meta: GGUFMetadata) -> dict[str, Any]:
        """The config values of a GGUF file (``config_from_gguf``); a family extends them."""
        if meta.count("expert_count", 0, SIZE) > 0:
            raise ModelFormatError(f"{meta.source}: {meta.arch} with {meta.arch}.expert_count="
                                   f"{meta.key('expert_count')} (mixture of experts) is not supported")
        key = self.gguf_keys
        dims = [meta.count(name, bound=HEAD_DIM) for name in (key["head_dim"], "rope.dimension_count")
                if meta.has(name)]
        if len(set(dims)) > 1:
            raise ModelFormatError(f"{meta.source}: {meta.arch} with partial rotary embedding ({meta.arch}.rope."
                                   f"dimension_count={dims[1]} < head_dim={dims[0]}) is not supported")
        tokens = meta.values.get("tokenizer.ggml.tokens") or []
        context = meta.count(key["max_position_embeddings"], bound=CONTEXT)
        return dict(
            vocab_size=meta.count(key["vocab_size"], len(tokens) or None), hidden_size=meta.count(key["hidden_size"]),
            intermediate_size=meta.count(key["intermediate_size"]),
            num_hidden_layers=meta.count(key["num_hidden_layers"], bound=LAYERS),
            num_attention_heads=(heads := meta.count(key["num_attention_heads"])),
            num_key_value_heads=meta.count(key["num_key_value_heads"], heads), max_position_embeddings=context,
            rope_theta=meta.decimal(key["rope_theta"], 10000.0, ROPE_BASE),
            rms_norm_eps=meta.decimal(key["rms_norm_eps"], 1e-5, POSITIVE),
            tie_word_embeddings="output.weight" not in meta.tensor_names, head_dim=dims[0] if dims else None,
            rope_scaling=self.gguf_rope_scaling(meta, context))

    def gguf_rope_scaling(self, meta: GGUFMetadata, context: int) -> rope.RopeScaling | None:
        """The RoPE scaling of a GGUF file: ``{arch}.rope.scaling.type`` (linear, yarn), or
        llama.cpp's factor tensors (``rope_freqs.weight``: per-frequency divisors;
        ``rope_factors_long/short.weight``: LongRoPE).

        Raises:
            ModelFormatError: another scaling type, naming it and its key; a factor tensor with a
                divisor not above 0, naming it.
            ConfigValueError: a scaling key's value of the wrong type or out of range.
        """
        kind = meta.key("rope.scaling.type", "none")
        factors = meta.rope_tensors
        for name, divisors in factors.items():
            if divisors.size and not divisors.min() > 0:  # inv_freq / 0 is no frequency
                raise ModelFormatError(f"{meta.source}: tensor {name} holds {divisors.min()}, not divisors above 0")
        if "rope_factors_long.weight" in factors:
            original = meta.count("rope.scaling.original_context_length")
            return rope.RopeScaling("longrope", context / original, original,
                                    attention_factor=meta.decimal("rope.scaling.attn_factor", 0.0),
                                    short_factor=tuple(factors["rope_factors_short.weight"].tolist()),
                                    long_factor=tuple(factors["rope_factors_long.weight"].tolist()))
        if "rope_freqs.weight" in factors:
            return rope.RopeScaling("freq_factors", short_factor=tuple(factors["rope_freqs.weight"].tolist()))
        if kind == "none":
            return None
        if kind == "linear":
            return rope.RopeScaling("linear", meta.decimal("rope.scaling.factor", bound=POSITIVE))
        if kind == "yarn":
            return rope.RopeScaling(
                "yarn", meta.decimal("rope.scaling.factor", bound=POSITIVE),
                meta.count("rope.scaling.original_context_length"),
                beta_fast=meta.decimal("rope.scaling.yarn_beta_fast", 32.0, POSITIVE),
                beta_slow=meta.decimal("rope.scaling.yarn_beta_slow", 1.0, POSITIVE),
                attention_factor=meta.decimal("rope.scaling.attn_factor", 0.0))
        raise ModelFormatError(f"{meta.source}: {meta.arch}.rope.scaling.type {kind!r} is not supported "
                               "(supported: none, linear, yarn, and llama.cpp's rope factor tensors)")

    # -- tensors ------------------------------------------------------------------------------

    def layer_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The tensors of one layer of a checkpoint of this family, by Hugging Face name below
        ``model.layers.{i}.``, with their shapes, in the order a layer's modules run."""
        shapes = layer_weight_shapes(config)
        return {name: shapes[name] for name in RUN_ORDER}

    def checkpoint_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this family must hold, by Hugging Face name, with its
        shape (``lm_head.weight`` only when the config does not tie it to the embedding)."""
        e = config.hidden_size
        shapes = {"model.embed_tokens.weight": (config.vocab_size, e), "model.norm.weight": (e,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, e)
        for i in range(config.num_hidden_layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in self.layer_shapes(config).items()})
        return shapes

    def stacking_order(self, config: ModelConfig) -> list[str]:
        """The checkpoint's matrices in the order a quantized model stacks them
        (``layers.stack.stack_weights``): each layer's in ``layer_shapes``' order, then the LM
        head (the embedding when tied). Kept weights laid out in this order are the stacked arrays
        already (``loading.converted``)."""
        matrices = [name for name, shape in self.layer_shapes(config).items() if len(shape) == 2]
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        return [f"model.layers.{i}.{name}" for i in range(config.num_hidden_layers) for name in matrices] + [head]

    def fused_matrices(self, config: ModelConfig) -> list[tuple[str, ...]]:
        """The checkpoint's matrices a model holds stacked by rows into one (``take_fused``), one
        tuple each, by full name: each layer's Q, K and V and its gate and up (none where the
        checkpoint has them fused already). Kept in one format, their kept weights are the fused
        matrix already (``loading.gguf``)."""
        shapes = self.layer_shapes(config)
        return [tuple(f"model.layers.{i}.{name}" for name in group) for i in range(config.num_hidden_layers)
                for group in (QKV_PROJ, GATE_UP_PROJ) if all(name in shapes for name in group)]

    def hf_name(self, gguf_name: str, source: str) -> str:
        """The Hugging Face name of a GGUF tensor of this family (``blk.3.attn_q.weight`` ->
        ``model.layers.3.self_attn.q_proj.weight``).

        Raises:
            ModelFormatError: a tensor this family has no place for, naming it.
        """
        if gguf_name in GGUF_GLOBAL_NAMES:
            return GGUF_GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.gguf_block_names:
            return f"model.layers.{parts[1]}.{self.gguf_block_names[parts[2]]}"
        raise ModelFormatError(f"{source}: GGUF tensor {gguf_name!r} is not supported by the {self.name} family")

    def permuted_heads(self, hf_name: str, config: ModelConfig) -> int:
        """The heads whose rows llama.cpp's converter permuted in this tensor (0: none)."""
        if not self.gguf_permuted:
            return 0
        return {"self_attn.q_proj.weight": config.num_attention_heads,
                "self_attn.k_proj.weight": config.num_key_value_heads}.get(hf_name.split(".", 3)[-1], 0)

    def layer_weights(self, take: WeightTaker, config: ModelConfig, prefix: str) -> LayerWeights:
        """One layer's ``LayerWeights`` from the tensors below ``prefix``.

        Raises:
            ModelFormatError: a tensor is missing or has the wrong shape.
        """
        return fuse_layer(take, config, prefix)

    # -- what the layers run ------------------------------------------------------------------

    def layer_spec(self, config: ModelConfig, layer: int) -> LayerSpec:
        """Layer ``layer``'s spec."""
        return LayerSpec.of(config)

    def rope(self, config: ModelConfig) -> RopePlan:
        """The RoPE tables and each layer's (one table here)."""
        return RopePlan((RopeTable(config.rope_theta, config.rope_scaling),), (0,) * config.num_hidden_layers)

    def embed_scale(self, config: ModelConfig) -> float:
        """What the embedding rows are multiplied by (1: none)."""
        return 1.0

    def final_softcap(self, config: ModelConfig) -> float:
        """The final logits' soft-cap ``c * tanh(z / c)`` (0: none)."""
        return 0.0


FAMILY = Llama()
