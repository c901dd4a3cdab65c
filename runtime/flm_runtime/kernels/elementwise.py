"""The compiled row-wise ops of a decoder layer: RMSNorm (of rows and of attention heads),
rotate-half RoPE, the gated FFN's activation (SwiGLU, GeGLU), and the float32 ``exp`` they and
attention use.

Each computes one row, in an order fixed by the compiled code alone, the same for any number of
rows (docs/design.md, "Batch invariance"): the compiled step (``flm_runtime.layers.stack``) gives
each thread its rows. Their numpy counterparts (``flm_runtime.kernels.cpu``) are the reference's.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# fastmath without nnan/ninf: reassociation lets LLVM vectorize the reductions (norms, attention
# dots), in an order fixed by the compiled code alone, the same for every row. numpy's error model:
# a division by zero gives inf instead of a check and a branch that stops the loop vectorizing.
_FASTMATH = {"reassoc", "contract", "arcp"}
ELEMENTWISE = {"fastmath": _FASTMATH, "error_model": "numpy"}


@intrinsic
def _pow2(typingctx, n):  # pragma: no cover - compiled
    """``2.0 ** n`` as float32 for an int32 ``n`` in ``[-126, 127]`` (the exponent bits, built)."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always", **ELEMENTWISE)
def exp(x):  # pragma: no cover - compiled
    """``exp(x)`` in float32 within about 2 ulp, clamped to ``[exp(-87), exp(88)]``, in plain
    arithmetic that LLVM vectorizes (a loop of ``np.exp`` calls libm once per element). Cody-Waite
    reduction ``x = n ln2 + f`` and Cephes' ``expf`` polynomial on ``|f| <= ln2 / 2``."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.float32(np.rint(x * np.float32(1.44269504)))
    f = (x - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * f + np.float32(1.3981999507e-3)
    p = p * f + np.float32(8.3334519073e-3)
    p = p * f + np.float32(4.1665795894e-2)
    p = p * f + np.float32(1.6666665459e-1)
    p = p * f + np.float32(5.0000001201e-1)
    return (p * (f * f) + f + np.float32(1.0)) * _pow2(np.int32(n))


@numba.njit(nogil=True, **ELEMENTWISE)
def rms_norm_row(x, weight, eps, out, i):  # pragma: no cover - compiled
    """RMSNorm of row ``i`` of ``x`` ``[R, E]`` into row ``i`` of ``out`` (as ``cpu.rms_norm``;
    ``out`` may be ``x``: the row is read whole first)."""
    e = x.shape[1]
    ss = np.float32(0.0)
    for j in range(e):
        ss += x[i, j] * x[i, j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(e) + np.float32(eps))
    for j in range(e):
        out[i, j] = x[i, j] * inv * weight[j]


@numba.njit(nogil=True)
def rope_row(x, cos, sin, first, heads, d, out, i):  # pragma: no cover - compiled
    """Rotate-half RoPE (as ``cpu.apply_rope``) of ``heads`` heads of width ``d`` starting at
    column ``first`` of row ``i`` of ``x``, at row ``i`` of ``cos``, ``sin`` ``[R, D/2]``, into
    ``out[i]`` ``[heads, D]``."""
    half = d // 2
    for h in range(heads):
        base = first + h * d
        for j in range(half):
            x1, x2, c, s = x[i, base + j], x[i, base + half + j], cos[i, j], sin[i, j]
            out[i, h, j] = x1 * c - x2 * s
            out[i, h, half + j] = x2 * c + x1 * s


@numba.njit(nogil=True, **ELEMENTWISE)
def qk_norm_row(qkv, q_norm, k_norm, h, hkv, d, eps, i):  # pragma: no cover - compiled
    """RMSNorm of each of the ``h`` query heads (weight ``q_norm`` ``[D]``) and ``hkv`` key heads
    (``k_norm``) of row ``i`` of the fused ``qkv`` ``[R, (H + 2 Hkv) D]`` (as ``cpu.qk_norm``), in
    place (a head is read whole before it is written); the values are left as they are."""
    for head in range(h + hkv):
        weight = q_norm if head < h else k_norm
        base = head * d
        ss = np.float32(0.0)
        for j in range(d):
            ss += qkv[i, base + j] * qkv[i, base + j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
        for j in range(d):
            qkv[i, base + j] = qkv[i, base + j] * inv * weight[j]


_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = np.float32(0.044715)  # the cubic term of gelu's tanh approximation (Hendrycks & Gimpel 2016)


@numba.njit(nogil=True, **ELEMENTWISE)
def glu_row(gate_up, out, i, gelu):  # pragma: no cover - compiled
    """The gated FFN's activation times up, ``act(gate) * up``, of row ``i`` of the fused
    ``gate_up`` ``[R, 2F]`` (gate first; as ``cpu.glu``) into row ``i`` of ``out`` ``[R, F]``:
    ``act`` silu (SwiGLU), or with ``gelu`` gelu's tanh approximation (GeGLU). Both activations
    are ``g * sigmoid(s)``: silu with ``s = g``, gelu_tanh with ``s = 2 sqrt(2/pi) (g + 0.044715
    g^3)``, since ``(1 + tanh(y)) / 2 = sigmoid(2y)``; so both run on ``exp`` and vectorize."""
    f = gate_up.shape[1] // 2
    for j in range(f):
        g = gate_up[i, j]
        s = np.float32(2.0) * _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g) if gelu else g
        out[i, j] = g / (np.float32(1.0) + exp(-s)) * gate_up[i, f + j]
