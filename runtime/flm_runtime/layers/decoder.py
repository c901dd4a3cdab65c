"""The decoder layer, written once: ``compose(ops, spec)`` over an ops table (``layers.ops``).

The float32 reference, the quantized path and the DFlash draft's layers all run this one
composition; they differ only in the ops table and the spec. The reference runs it as plain
Python over numpy ops. The quantized path compiles *the same source* with numba
(``parallel=True``) over the compiled ops: the composition is a closure whose free variables are
the ops (numba dispatchers) and the spec's values (ints, floats, bools), and numba takes a
closure's free variables as compile-time constants, so each matrix's product is specialized to
its format and a layer is one compiled call, with no second copy of the layer to keep in step.
The compiled code calls its kernels in a fixed order that does not depend on the rows beside a
row, so a row's result is bit-identical alone, batched or in a verify pass (docs/design.md, "Batch invariance").

A step of one sequence (a decode, a verify pass, a prefill chunk) runs the whole layer in one call
(``Composition.layer``: the K/V write into the cache and attention inside); a step of several
sequences runs ``attention_in``, each sequence's K/V write and attention (``attend_spans``: their
caches are separate arrays, which a compiled call does not take as a list cheaply), then
``attention_out``.

Axis legend: R rows of the step, E hidden size, H / Hkv query / key-value heads, D head dim, F FFN
width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from flm_runtime.kv_cache import KVCache
from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import attention
from flm_runtime.kernels.lock import KERNEL_LOCK
from flm_runtime.kernels.quant import Weight
from flm_runtime.layers.jit import compiled, sources_key
from flm_runtime.layers.ops import REFERENCE, Ops, ops_for
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
        """The four matrices, in the order of an ops table's ``linears``."""
        return self.wqkv, self.wo, self.w_gate_up, self.w_down

    def check(self, spec: LayerSpec) -> None:
        """Raise ``ModelFormatError`` unless the optional vectors are those ``spec``'s features
        read, each of its shape."""
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


# An optional vector a layer does not have, as its compiled composition takes it (never read).
ABSENT = np.zeros(0, dtype=np.float32)


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


class Composition(NamedTuple):
    """A layer composed over one ops table and spec. An optional vector the spec does not read
    is passed as ``ABSENT`` (or None to the reference).

    Attributes:
        attention_in: ``(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin) -> (q [R, H, D],
            k [R, Hkv, D], v [R, Hkv, D])``: norm, QKV product, bias, QK-norm, RoPE on q and k.
        attention_out: ``(x, attn [R, H*D], wo, post_attn_norm, ffn_norm, w_gate_up, w_down,
            post_ffn_norm) -> [R, E]``: O product, its post norm and the residual, norm, gate/up
            product, activation, down product, its post norm and the residual.
        layer: ``(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin, k_pool, v_pool, table,
            start, wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm) -> [R, E]``:
            the whole layer over one sequence's rows, its K/V written into one layer of its cache
            (``attention.cache_arrays``: the pool's layer and the sequence's blocks) at
            ``start ..``; compiled tables only (None for the reference, whose K/V go through
            ``KVCache.write``).
    """

    attention_in: Callable
    attention_out: Callable
    layer: Callable


@functools.cache
def compose(ops: Ops, spec: LayerSpec) -> Composition:
    """The decoder layer of ``spec`` over ``ops`` (module docstring). The spec's features are
    constants of the composition: a feature it does not turn on is not in the compiled code.

    Raises:
        ModelFormatError: ``spec`` asks what the composition does not run (``LayerSpec.unsupported``).
    """
    if unsupported := spec.unsupported():
        raise ModelFormatError(f"the checkpoint's layers ask for {'; '.join(unsupported)}, which this runtime "
                               "does not run")
    norm, qk_norm, rope, glu = ops.norm, ops.qk_norm, ops.rope, ops.glu
    qkv_linear, o_linear, gate_up_linear, down_linear = ops.linears
    store_kv, attend = attention.store_kv, attention.attend
    h, hkv, d, causal = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.causal
    has_bias, has_qk_norm, post_norms = spec.qkv_bias, spec.qk_norm, spec.post_norms
    gelu, scale = spec.activation == "gelu_tanh", spec.softmax_scale
    # an int64, not a Python int (a literal to numba): ``attend`` compiles once for every path,
    # while a literal would compile a variant whose reductions may vectorize in another order
    window = np.int64(spec.sliding_window)
    eps = np.float32(spec.rms_norm_eps)

    def attention_in(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin):
        qkv = qkv_linear(norm(x, attn_norm, eps), wqkv)  # [R, (H+2Hkv)*D]
        if has_bias:
            qkv = qkv + qkv_bias
        if has_qk_norm:
            qkv = qk_norm(qkv, q_norm, k_norm, h, hkv, d, eps)
        q = rope(qkv, cos, sin, 0, h, d)
        k = rope(qkv, cos, sin, h * d, hkv, d)
        v = qkv[:, (h + hkv) * d:].copy().reshape(x.shape[0], hkv, d)
        return q, k, v

    def attention_out(x, attn, wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm):
        o = o_linear(attn, wo)
        if post_norms:
            o = norm(o, post_attn_norm, eps)
        x = x + o
        down = down_linear(glu(gate_up_linear(norm(x, ffn_norm, eps), w_gate_up), gelu), w_down)
        if post_norms:
            down = norm(down, post_ffn_norm, eps)
        return x + down

    if not ops.compiled:
        return Composition(attention_in, attention_out, None)
    key = f"{ops.key} {spec!r} {sources_key()}"
    attention_in = compiled(attention_in, key, parallel=True, nogil=True)
    attention_out = compiled(attention_out, key, parallel=True, nogil=True)

    def layer(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin, k_pool, v_pool, table, start, wo,
              post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm):
        q, k, v = attention_in(x, attn_norm, wqkv, qkv_bias, q_norm, k_norm, cos, sin)
        store_kv(k, v, k_pool, v_pool, table, start)
        attn = np.empty((x.shape[0], h * d), dtype=np.float32)
        attend(q, k_pool, v_pool, table, start, causal, window, scale, attn)
        return attention_out(x, attn, wo, post_attn_norm, ffn_norm, w_gate_up, w_down, post_ffn_norm)

    return Composition(attention_in, attention_out, compiled(layer, key, nogil=True))


class DecoderLayer:
    """One decoder layer: its weights, its spec, its ops table (``ops_for`` its matrices) and the
    composition over them.

    Args:
        weights: the layer's weights.
        spec: its geometry and features (``causal`` False for the DFlash draft's block).

    Raises:
        ModelFormatError: the spec asks what the composition does not run, or the weights lack
            a vector its features read (``LayerWeights.check``).
    """

    def __init__(self, weights: LayerWeights, spec: LayerSpec):
        weights.check(spec)
        self.weights, self.spec = weights, spec
        self.ops = ops_for(*weights.matrices)
        self._in, self._out, self._layer = compose(self.ops, spec)
        wqkv, wo, w_gate_up, w_down = (self.ops.operand(w) for w in weights.matrices)
        w = weights
        self._in_weights = (w.attn_norm, wqkv, *(ABSENT if v is None else v for v in (w.qkv_bias, w.q_norm, w.k_norm)))
        self._out_weights = (wo, ABSENT if w.post_attn_norm is None else w.post_attn_norm, w.ffn_norm, w_gate_up,
                             w_down, ABSENT if w.post_ffn_norm is None else w.post_ffn_norm)
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
        if not self.ops.compiled:  # its products take the kernel lock themselves (skinny_gemm, qgemm)
            q, k, v = self._in(x, *self._in_weights, cos, sin)
            with KERNEL_LOCK:
                attn = attention.attend_spans(index, q, k, v, spans, *self._attention)
            return self._out(x, attn, *self._out_weights)
        with KERNEL_LOCK:
            if len(spans) == 1:  # one sequence: one call
                s = spans[0]
                return self._layer(x, *self._in_weights, cos, sin, *attention.cache_arrays(s.cache, index), s.start,
                                   *self._out_weights)
            q, k, v = self._in(x, *self._in_weights, cos, sin)
            attn = attention.attend_spans(index, q, k, v, spans, *self._attention)
            return self._out(x, attn, *self._out_weights)


class StackArithmetic(NamedTuple):
    """What a model's stack of layers decides once for the whole model (``stack_arithmetic``).

    Attributes:
        quantized: every layer runs on the compiled ops (all its matrices quantized).
        kv_dtype: the KV cache's element type: float16 for a quantized stack (half the bytes
            attention reads), float32 for the reference.
        final_norm: the RMSNorm before the LM head, ``(x [R, E], w [E], eps) -> [R, E]``, in the
            stack's arithmetic.
    """

    quantized: bool
    kv_dtype: type
    final_norm: Callable


def stack_arithmetic(decoders: list[DecoderLayer]) -> StackArithmetic:
    """The arithmetic of a model whose layers are ``decoders`` (the target's and the draft's
    alike): quantized only when every layer is."""
    quantized = all(d.ops.compiled for d in decoders)
    ops = decoders[-1].ops if quantized else REFERENCE
    return StackArithmetic(quantized, np.float16 if quantized else np.float32, ops.norm_rows)
