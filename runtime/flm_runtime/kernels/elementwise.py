"""The compiled row-wise ops of a decoder layer: RMSNorm (of rows and of attention heads),
rotate-half RoPE, the gated FFN's activation (SwiGLU, GeGLU), and the float32 ``exp`` they and
attention use.

Each is computed row by row in an order fixed by the compiled code alone, the same for any number
of rows (docs/design.md, "Batch invariance"). ``flm_runtime.layers.ops`` puts them in the
compiled ops table; their numpy counterparts (``flm_runtime.kernels.cpu``) are the reference's.
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


@numba.njit(nogil=True, cache=True, **ELEMENTWISE)
def rms_norm(x, weight, eps):  # pragma: no cover - compiled
    """RMSNorm of each row of ``x`` ``[R, E]`` (as ``cpu.rms_norm``)."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        rms_norm_row(x, weight, eps, out, i)
    return out


@numba.njit(nogil=True, **ELEMENTWISE)
def rms_norm_row(x, weight, eps, out, i):  # pragma: no cover - compiled
    """``rms_norm`` of row ``i`` of ``x`` into row ``i`` of ``out``."""
    e = x.shape[1]
    ss = np.float32(0.0)
    for j in range(e):
        ss += x[i, j] * x[i, j]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(e) + np.float32(eps))
    for j in range(e):
        out[i, j] = x[i, j] * inv * weight[j]


@numba.njit(nogil=True)
def rope(x, cos, sin, first, heads, d):  # pragma: no cover - compiled
    """Rotate-half RoPE of ``heads`` heads of width ``d`` starting at column ``first`` of each
    row of ``x`` (as ``cpu.apply_rope``); ``[R, heads, D]`` float32."""
    out = np.empty((x.shape[0], heads, d), dtype=np.float32)
    for i in range(x.shape[0]):
        rope_row(x, cos, sin, first, heads, d, out, i)
    return out


@numba.njit(nogil=True)
def rope_row(x, cos, sin, first, heads, d, out, i):  # pragma: no cover - compiled
    """``rope`` of row ``i`` into ``out[i]`` ``[heads, D]``."""
    half = d // 2
    for h in range(heads):
        base = first + h * d
        for j in range(half):
            x1, x2, c, s = x[i, base + j], x[i, base + half + j], cos[i, j], sin[i, j]
            out[i, h, j] = x1 * c - x2 * s
            out[i, h, half + j] = x2 * c + x1 * s


@numba.njit(nogil=True, cache=True, **ELEMENTWISE)
def qk_norm(qkv, q_norm, k_norm, h, hkv, d, eps):  # pragma: no cover - compiled
    """RMSNorm of each of the ``h`` query heads (weight ``q_norm`` ``[D]``) and ``hkv`` key heads
    (``k_norm``) of each row of the fused ``qkv`` ``[R, (H + 2 Hkv) D]`` (as ``cpu.qk_norm``); the
    values are copied as they are. ``[R, (H + 2 Hkv) D]``, a new array."""
    out = qkv.copy()
    for i in range(out.shape[0]):
        qk_norm_row(out, q_norm, k_norm, h, hkv, d, eps, i)
    return out


@numba.njit(nogil=True, **ELEMENTWISE)
def qk_norm_row(qkv, q_norm, k_norm, h, hkv, d, eps, i):  # pragma: no cover - compiled
    """``qk_norm`` of row ``i`` of ``qkv``, in place (a head is read whole before it is written)."""
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


@numba.njit(nogil=True, cache=True, **ELEMENTWISE)
def glu(gate_up, gelu):  # pragma: no cover - compiled
    """The gated FFN's activation times up, ``act(gate) * up``, of each row of the fused
    ``gate_up`` ``[R, 2F]`` (gate first; as ``cpu.glu``): ``act`` silu (SwiGLU), or with ``gelu``
    gelu's tanh approximation (GeGLU). ``[R, F]``."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    for i in range(gate_up.shape[0]):
        glu_row(gate_up, out, i, gelu)
    return out


@numba.njit(nogil=True, **ELEMENTWISE)
def glu_row(gate_up, out, i, gelu):  # pragma: no cover - compiled
    """``glu`` of row ``i`` into row ``i`` of ``out``. Both activations are ``g * sigmoid(s)``:
    silu with ``s = g``, gelu_tanh with ``s = 2 sqrt(2/pi) (g + 0.044715 g^3)``, since
    ``(1 + tanh(y)) / 2 = sigmoid(2y)``; so both run on ``exp`` and vectorize."""
    f = gate_up.shape[1] // 2
    for j in range(f):
        g = gate_up[i, j]
        s = np.float32(2.0) * _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g) if gelu else g
        out[i, j] = g / (np.float32(1.0) + exp(-s)) * gate_up[i, f + j]


def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row ``[R, E]`` -> ``[R, E]`` float32, row by row (the compiled layer's): for a call from Python."""
    return rms_norm(np.ascontiguousarray(x, dtype=np.float32), weight, np.float32(eps))

