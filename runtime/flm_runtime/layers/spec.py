"""What a checkpoint turns on in its decoder layers: ``LayerSpec``.

The composition (``layers.decoder``) reads a layer's geometry and features from here and nothing
else, so a model family that differs from Llama by a feature is a spec, not a new layer. The
features below are the ones the next model families need (Qwen2's Q/K/V bias, Qwen3's QK-norm,
Gemma's ``(1 + w)`` norms, sandwich norms, GeGLU, per-layer sliding window and RoPE base, and
attention-logit soft-capping); only Llama's values run today, and ``LayerSpec.unsupported``
names any other a checkpoint turns on, so that loading it fails instead of running a different
model. The final logits' soft-cap belongs to the model's LM head, not to a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LayerConfig(Protocol):
    """The hyper-parameters one decoder layer reads (``LlamaConfig`` and the draft's ``DFlashConfig``
    both name them as a Hugging Face ``config.json`` does)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's geometry and the features its checkpoint turns on (defaults: Llama's).

    Attributes:
        hidden_size, ffn_size: E and F.
        n_heads, n_kv_heads, head_dim: H, Hkv, D (query head ``h`` reads key/value head
            ``h // (H / Hkv)``).
        rms_norm_eps: the RMSNorms' epsilon.
        rope_theta: the RoPE base of this layer (a model may give its layers different bases).
        causal: each row attends positions up to its own (a target), or all positions of its
            sequence (the DFlash draft's block, docs/dflash.md).
        qkv_bias: the Q/K/V projections add a bias.
        qk_norm: an RMSNorm over each query and key head before RoPE.
        norm_offset: the norms scale by ``1 + w`` instead of ``w``.
        post_norms: a norm on the attention and on the FFN output before each residual add.
        activation: the gated FFN's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
        sliding_window: attend at most this many positions back (0: all).
        attn_softcap: scores become ``c * tanh(s / c)`` before the softmax (0: none).
        attn_scale: the scores' scale (0: ``head_dim ** -0.5``).
    """

    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    causal: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    post_norms: bool = False
    activation: str = "silu"
    sliding_window: int = 0
    attn_softcap: float = 0.0
    attn_scale: float = 0.0

    @classmethod
    def of(cls, config: LayerConfig, *, causal: bool = True) -> LayerSpec:
        """A Llama layer of ``config``'s geometry."""
        c = config
        return cls(hidden_size=c.hidden_size, ffn_size=c.intermediate_size, n_heads=c.num_attention_heads,
                   n_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=float(c.rms_norm_eps),
                   rope_theta=float(c.rope_theta), causal=causal)

    def unsupported(self) -> list[str]:
        """The features this spec turns on that the composition does not run yet (empty for Llama)."""
        llama = LayerSpec(self.hidden_size, self.ffn_size, self.n_heads, self.n_kv_heads, self.head_dim,
                          self.rms_norm_eps, self.rope_theta, self.causal)
        return [name for name in ("qkv_bias", "qk_norm", "norm_offset", "post_norms", "activation",
                                  "sliding_window", "attn_softcap", "attn_scale")
                if getattr(self, name) != getattr(llama, name)]
