"""What a checkpoint turns on in its decoder layers: ``LayerSpec``.

The layers (the numpy reference, ``layers.decoder``, and the compiled step, ``layers.stack``)
read a layer's geometry and features from here and nothing else, so a model family that differs
from Llama by a feature is a spec, not a new layer: Qwen2's Q/K/V bias, Qwen3's and Gemma 3's
QK-norm, Gemma's sandwich norms, GeGLU, a softmax scale of its own and sliding-window layers,
Mistral's sliding window. A Gemma checkpoint's ``(1 + w)`` norm weights are folded into ``w`` at
load (as llama.cpp's converter does for GGUF), so the layer has one kind of norm.
``LayerSpec.unsupported`` names what the layers do not run, so that loading such a checkpoint
fails instead of running a different model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from flm_runtime.errors import ModelFormatError

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated FFN's activations: SwiGLU, GeGLU


class LayerConfig(Protocol):
    """The hyper-parameters one decoder layer reads (``ModelConfig`` and the draft's ``DFlashConfig``
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
        rms_norm_eps: the epsilon of every RMSNorm of the layer (QK-norm and post norms too).
        rope_theta: the RoPE base of this layer (a model may give its layers different bases;
            the model computes the tables and says which one each layer reads).
        causal: each row attends positions up to its own (a target), or all positions of its
            sequence (the DFlash draft's block, docs/dflash.md).
        qkv_bias: the QKV product adds a bias ``[(H + 2 Hkv) D]`` (Qwen2), before RoPE.
        qk_norm: an RMSNorm over each query and key head ``[D]`` after the bias, before RoPE
            (Qwen3, Gemma 3).
        post_norms: an RMSNorm of the attention output (after the O product) and of the FFN
            output (after the down product) before each residual add (Gemma's sandwich norms).
        activation: the gated FFN's activation on the gate, times up: ``"silu"`` (SwiGLU) or
            ``"gelu_tanh"`` (GeGLU: gelu's tanh approximation, Hugging Face's ``gelu_pytorch_tanh``).
        sliding_window: ``W > 0``: a row at position ``p`` attends positions ``max(0, p - W + 1)
            .. p``, W positions with its own (transformers masks key ``k`` when ``p - k >= W``,
            Mistral's and Gemma 3's ``sliding_window``); 0: all positions up to its own.
        attn_scale: the scores' scale before the softmax (Gemma 3: ``query_pre_attn_scalar **
            -0.5``); 0: ``D ** -0.5``.
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
    post_norms: bool = False
    activation: str = "silu"
    sliding_window: int = 0
    attn_scale: float = 0.0

    @classmethod
    def of(cls, config: LayerConfig, *, causal: bool = True) -> LayerSpec:
        """A Llama layer of ``config``'s geometry."""
        c = config
        return cls(hidden_size=c.hidden_size, ffn_size=c.intermediate_size, n_heads=c.num_attention_heads,
                   n_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=float(c.rms_norm_eps),
                   rope_theta=float(c.rope_theta), causal=causal)

    @property
    def softmax_scale(self) -> np.float32:
        """The scores' scale: ``attn_scale``, or ``1 / sqrt(D)`` when it is 0."""
        return np.float32(self.attn_scale or 1.0 / math.sqrt(self.head_dim))

    def unsupported(self) -> list[str]:
        """What this spec asks that the layers do not run (empty when they run it all)."""
        problems = []
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation {self.activation!r} (runs {', '.join(ACTIVATIONS)})")
        if self.sliding_window < 0:
            problems.append(f"sliding_window {self.sliding_window} (a window is >= 0)")
        if self.sliding_window and not self.causal:
            problems.append("a sliding window on a non-causal layer")
        if self.attn_scale < 0:
            problems.append(f"attn_scale {self.attn_scale} (a scale is >= 0)")
        return problems

    def check(self) -> None:
        """Raise ``ModelFormatError`` naming what this spec asks that the layers do not run
        (``unsupported``)."""
        if unsupported := self.unsupported():
            raise ModelFormatError(f"the checkpoint's layers ask for {'; '.join(unsupported)}, which this runtime "
                                   "does not run")
