"""The weight dictionary every loader produces, and its validation.

Names and layouts are Hugging Face's (``LlamaForCausalLM.state_dict()``): a linear layer's weight
is ``[out_features, in_features]``; ``y = x @ W.T``. A weight is a C-contiguous float32 array or,
for matrices, a ``QuantWeight`` of the cpu backend's block format (``WEIGHT_KINDS`` says which).
RoPE convention: "rotate half" (dimension ``i`` pairs with ``i + D/2`` inside each head).
"""

from __future__ import annotations


import numpy as np

from flm_runtime.kernels.quant import QuantWeight, Weight
from flm_runtime.core import LlamaConfig
from flm_runtime.errors import InvalidRequestError, ModelFormatError
from flm_runtime.settings import Settings, variable

# How a model's matrices are held: "auto" keeps each source tensor's precision class (4-bit
# sources 4-bit, the rest 8-bit); "q4" / "q8" make every matrix 4- / 8-bit; "f32" dequantizes
# everything (the reference path).
WEIGHT_KINDS = ("auto", "q4", "q8", "f32")


def weight_kind(requested: str | None = None) -> str:
    """The weight kind to load: ``requested`` (a models-file entry's ``weights``), else
    ``$FLM_WEIGHTS``, else ``auto``.

    Raises:
        InvalidRequestError: not one of ``WEIGHT_KINDS``; ``param`` names where the value came from
            (``weights`` or ``FLM_WEIGHTS``), as ``$FLM_BACKEND``'s error does.
    """
    value, origin = (requested, "weights") if requested else (Settings.from_env().weights, variable("weights"))
    value = (value or "auto").strip().lower()
    if value not in WEIGHT_KINDS:
        raise InvalidRequestError(f"{origin}={value!r} is not a weight kind; use one of {', '.join(WEIGHT_KINDS)}",
                                  param=origin)
    return value


def llama_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, with its Hugging Face shape.

    ``lm_head.weight`` is listed only when ``config.tie_word_embeddings`` is false (a tied model
    uses ``model.embed_tokens.weight`` as its LM head).

    Returns:
        name -> shape, e.g. ``model.layers.0.self_attn.k_proj.weight -> (Hkv*D, hidden)``.
    """
    hidden, ffn, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out = config.num_attention_heads * d  # H*D
    kv_out = config.num_key_value_heads * d  # Hkv*D
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        })
    return shapes


def stacking_order(config: LlamaConfig) -> list[str]:
    """The matrices of a Llama checkpoint in the order a quantized model stacks them
    (``layers.stack.stack_weights``): each layer's q, k, v, o, gate, up and down projections, then
    the LM head (the embedding when tied). Kept weights laid out in this order are the stacked
    arrays already (``loading.converted``)."""
    layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return [f"model.layers.{i}.{m}.weight" for i in range(config.num_hidden_layers) for m in layer] + [head]


def check_llama_weights(config: LlamaConfig, weights: dict[str, Weight], source: str) -> None:
    """Check that ``weights`` holds exactly the tensors ``config`` asks for, as float32 arrays
    or (matrices) ``QuantWeight``.

    Args:
        config: the model's hyper-parameters.
        weights: name -> weight in Hugging Face layout.
        source: file or directory the weights came from, for error messages.

    Raises:
        ModelFormatError: a tensor is missing, unexpected, of the wrong shape or not float32.
    """
    expected = llama_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise ModelFormatError(f"{source}: missing tensors {missing[:5]} ({len(missing)} in all)")
    if extra:
        raise ModelFormatError(f"{source}: unexpected tensors {extra[:5]} ({len(extra)} in all)")
    for name, shape in expected.items():
        w = weights[name]
        if tuple(w.shape) != shape:
            raise ModelFormatError(
                f"{source}: tensor {name} has shape {tuple(w.shape)}, the config implies {shape}"
            )
        assert isinstance(w, QuantWeight) or w.dtype == np.float32, f"{name}: loaders must produce float32, got {w.dtype}"
