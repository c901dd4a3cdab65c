"""The decoder layer's numpy reference: ``compose(spec)`` and ``DecoderLayer``.

A layer's arithmetic has two definitions, one per kind of weights: this numpy one, for float32
matrices (the numerical reference; its products on BLAS, the skinny kernel, or ``qgemm`` for a
quantized matrix of a model whose layers are not all quantized), and the compiled step of
``layers.stack`` for a model whose layers' matrices are all quantized (a target's layers and an
8-bit DFlash draft's, non-causal, compile from it alike), run on the kernel team. Both take
``LayerWeights`` and ``RowSpan``; tests hold both to the formulas
(tests/models/test_layer_features.py).

A step of several sequences runs ``attention_in`` over all their rows, each sequence's K/V write
and attention over its own cache (``attention.attend_spans``), then ``attention_out`` over all
the rows.

Axis legend: R rows of the step, E hidden size, H / Hkv query / key-value heads, D head dim, F FFN
width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import attention, cpu
from flm_runtime.kernels.lock import KERNEL_LOCK
from flm_runtime.kernels.quant import QuantWeight, Weight
from flm_runtime.kv_cache import KVCache
from flm_runtime.layers.spec import LayerSpec


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, fused for fewer matrix products per step. Matrices are
    ``kernels.quant.Weight``: float32 arrays or quantized blocks; vectors are float32.

    Attributes:
        attn_norm, ffn_norm: ``[E]`` RMSNorm weights.
        wqkv: ``[(H + 2*Hkv) * D, E]`` q, k and v projections stacked (rows in that order).
        wo: ``[E, H * D]`` attention output projection.
        w_gate_up: ``[2F, E]`` gate and up projections stacked (gate first).
        w_down: ``[E, F]``.
        qkv_bias: ``[(H + 2*Hkv) * D]``, the q, k and v biases stacked (``LayerSpec.qkv_bias``), or None.
        q_norm, k_norm: ``[D]`` QK-norm weights (``LayerSpec.qk_norm``), or None.
        post_attn_norm, post_ffn_norm: ``[E]`` post-norm weights (``LayerSpec.post_norms``), or None.
    """

    attn_norm: np.ndarray
    wqkv: Weight
    wo: Weight
    ffn_norm: np.ndarray
    w_gate_up: Weight
    w_down: Weight
    qkv_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None

    @property
    def matrices(self) -> tuple[Weight, Weight, Weight, Weight]:
        """The four matrices: QKV, O, gate/up, down."""
        return self.wqkv, self.wo, self.w_gate_up, self.w_down

    def check(self, spec: LayerSpec) -> None:
        """Raise ``ModelFormatError`` unless ``spec`` is a layer this runtime runs
        (``LayerSpec.check``) and the optional vectors are those its features read, each of its
        shape."""
        spec.check()
        h, hkv, d, e = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.hidden_size
        for feature, names, shape in (("qkv_bias", ("qkv_bias",), ((h + 2 * hkv) * d,)),
                                      ("qk_norm", ("q_norm", "k_norm"), (d,)),
                                      ("post_norms", ("post_attn_norm", "post_ffn_norm"), (e,))):
            for name in names:
                w = getattr(self, name)
                if getattr(spec, feature) != (w is not None):
                    raise ModelFormatError(f"the layer's {feature} is {getattr(spec, feature)} but its {name} is "
                                           f"{'missing' if w is None else 'given'}")
                if w is not None and w.shape != shape:
                    raise ModelFormatError(f"the layer's {name} has shape {w.shape}, expected {shape}")


class RowSpan(NamedTuple):
    """The rows ``rows`` of a step that belong to one sequence: new positions ``start ..`` of its
    ``cache`` (``start`` = the cache's length before the step), of which the last ``n_logits``
    need logits."""

    cache: KVCache
    start: int
    rows: slice
    n_logits: int

    @property
    def n_rows(self) -> int:
        return self.rows.stop - self.rows.start


def quantized(layers: list[LayerWeights]) -> bool:
    """Every matrix of every layer is quantized: the layers run as one compiled step
    (``layers.stack``), else on the numpy reference (``DecoderLayer``)."""
    return all(isinstance(m, QuantWeight) for layer in layers for m in layer.matrices)


def rope_heads(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, first: int, heads: int, d: int) -> np.ndarray:
    """``heads`` heads of width ``d`` from column ``first`` of each row of ``x`` ``[R, *]``, RoPE
    applied (``cpu.apply_rope``; ``cos``, ``sin`` ``[R, D/2]``): ``[R, heads, D]``."""
    return cpu.apply_rope(x[:, first:first + heads * d].reshape(x.shape[0], heads, d), cos, sin)


class Composition(NamedTuple):
    """A layer composed for one spec, in numpy. An optional vector the spec does not read is
    passed as None.

    Attributes:
        attention_in: ``(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin) -> (q [R, H, D],
            k [R, Hkv, D], v [R, Hkv, D])``: norm, QKV product, bias, QK-norm, RoPE on q and k.
        attention_out: ``(x, attn [R, H*D], wo, post_attn_norm, ffn_norm, w_gate_up, w_down,
            post_ffn_norm) -> [R, E]``: O product, its post norm and the residual, norm, gate/up
            product, activation, down product, its post norm and the residual.
    """

    attention_in: Callable
    attention_out: Callable


@functools.cache
def compose(spec: LayerSpec) -> Composition:
    """The decoder layer of ``spec`` in numpy (module docstring); ``x`` ``[R, E]`` float32, the
    matrices any ``kernels.quant.Weight`` (``cpu.linear``).

    Raises:
        ModelFormatError: ``spec`` asks what the layers do not run (``LayerSpec.check``).
    """
    spec.check()
    h, hkv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    has_bias, has_qk_norm, post_norms = spec.qkv_bias, spec.qk_norm, spec.post_norms
    gelu, eps, linear, norm = spec.activation == "gelu_tanh", np.float32(spec.rms_norm_eps), cpu.linear, cpu.rms_norm

    def attention_in(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin):
        qkv = linear(norm(x, attn_norm, eps), wqkv)  # [R, (H+2Hkv)*D]
        if has_bias:
            qkv = qkv + qkv_bias
        if has_qk_norm:
            qkv = cpu.qk_norm(qkv, q_norm, k_norm, h, hkv, d, eps)
        q = rope_heads(qkv, cos, sin, 0, h, d)
        k = rope_heads(qkv, cos, sin, h * d, hkv, d)
        v = qkv[:, (h + hkv) * d:].copy().reshape(x.shape[0], hkv, d)
        return q, k, v

    def attention_out(x, attn, wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm):
        o = linear(attn, wo)
        if post_norms:
            o = norm(o, post_attn_norm, eps)
        x = x + o
        down = linear(cpu.glu(linear(norm(x, ffn_norm, eps), w_gate_up), gelu), w_down)
        if post_norms:
            down = norm(down, post_ffn_norm, eps)
        return x + down

    return Composition(attention_in, attention_out)


class DecoderLayer:
    """One decoder layer on the numpy reference: its weights, its spec and ``compose(spec)``.

    Args:
        weights: the layer's weights.
        spec: its geometry and features (``causal`` False for the DFlash draft's block).

    Raises:
        ModelFormatError: the spec asks what the layers do not run, or the weights lack a vector
            its features read (``LayerWeights.check``).
    """

    def __init__(self, weights: LayerWeights, spec: LayerSpec):
        weights.check(spec)
        self.weights, self.spec = weights, spec
        self._in, self._out = compose(spec)
        w = weights
        self._in_weights = (w.attn_norm, w.wqkv, w.qkv_bias, w.q_norm, w.k_norm)
        self._out_weights = (w.wo, w.post_attn_norm, w.ffn_norm, w.w_gate_up, w.w_down, w.post_ffn_norm)
        self._attention = (spec.causal, spec.sliding_window, spec.softmax_scale)

    def __call__(self, index: int, x: np.ndarray, spans: list[RowSpan], cos: np.ndarray,
                 sin: np.ndarray) -> np.ndarray:
        """The layer over the rows ``x`` ``[R, E]`` (``cos``, ``sin`` ``[R, D/2]`` at their
        positions): span ``s`` writes its rows' K/V into layer ``index`` of its cache at
        positions ``s.start ..`` and attends its cache (positions ``0 .. s.start + s.n_rows -
        1``, up to each row's own when causal). Nothing is committed to a cache.

        Returns:
            ``[R, E]``, a new array.
        """
        q, k, v = self._in(x, *self._in_weights, cos, sin)  # its products take the kernel lock themselves
        with KERNEL_LOCK:
            attn = attention.attend_spans(index, q, k, v, spans, *self._attention)
        return self._out(x, attn, *self._out_weights)
