"""The two ops tables a decoder layer runs on, and the one place that chooses between them.

The composition (``layers.decoder``) calls its ops by role: ``norm(x, w, eps)`` (RMSNorm of each
row), ``qk_norm(qkv, q_norm, k_norm, h, hkv, d, eps)`` (RMSNorm of each query and key head of the
fused QKV product), ``rope(qkv, cos, sin, first, heads, d)`` (rotate-half RoPE of ``heads`` heads
from column ``first``, ``[R, heads, D]``), ``glu(gate_up, gelu)`` (the gated FFN's activation
times up: SwiGLU, or GeGLU with ``gelu``) and one ``linear(x, w)`` per matrix (``x @ w.T``).
Swapping the table swaps the arithmetic, as mlx-lm gets quantization by swapping ``Linear`` for
``QuantizedLinear``:

- ``REFERENCE``: numpy (``kernels.cpu``), run as plain Python; matrices float32 (products on
  BLAS or the skinny kernel) or quantized (``qgemm``). The numerical reference.
- ``compiled_ops(formats)``: the compiled kernels (``kernels.elementwise``, ``qgemm``) for a layer
  whose matrices are all quantized, each matrix's product specialized to its format; the
  composition is compiled over them (``parallel=True``), one call per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np

from flm_runtime.kernels import cpu, elementwise, qgemm
from flm_runtime.kernels.quant import QuantWeight, Weight


class Ops(NamedTuple):
    """An ops table (module docstring).

    Attributes:
        key: names the table and its matrix formats (the compiled composition's cache key).
        compiled: the composition is compiled over these ops (numba), else run as Python.
        norm, qk_norm, rope, glu: the row-wise ops, callable from the composition.
        linears: the products of the layer's four matrices, in ``LayerWeights``' order (QKV, O,
            gate/up, down).
        norm_rows: RMSNorm callable from Python (a model's final norm).
        operand: a matrix as its ``linear`` takes it.
    """

    key: str
    compiled: bool
    norm: Callable
    qk_norm: Callable
    rope: Callable
    glu: Callable
    linears: tuple[Callable, Callable, Callable, Callable]
    norm_rows: Callable
    operand: Callable


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, first: int, heads: int, d: int) -> np.ndarray:
    """``heads`` heads of width ``d`` from column ``first`` of each row of ``x``, RoPE applied
    (``cpu.apply_rope``): ``[R, heads, D]``."""
    return cpu.apply_rope(x[:, first:first + heads * d].reshape(x.shape[0], heads, d), cos, sin)


REFERENCE = Ops("reference", False, cpu.rms_norm, cpu.qk_norm, _rope, cpu.glu, (cpu.linear,) * 4, cpu.rms_norm,
                lambda w: w)


class Product(NamedTuple):
    """A quantized matrix as a compiled ``linear`` takes it: ``qgemm.operands``, its padded input
    width and its output width."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    padded: int  # Kp
    n_out: int  # N

    @classmethod
    def of(cls, w: QuantWeight) -> Product:
        return cls(*qgemm.operands(w), w.padded_in_features, w.out_features)


@functools.cache
def _quantized_linear(isa: int, bits: int, has_mins: bool):
    """``linear(x, w)`` of a ``Product`` of format ``(isa, bits, has_mins)``, the format bound as
    constants (the integer kernels specialize on them); inlined into its parallel caller."""

    @numba.njit(inline="always")
    def linear(x, w):  # pragma: no cover - compiled
        return qgemm.compiled_linear(isa, bits, has_mins, w[0], w[1], w[2], w[3], w[4], x)

    return linear


@functools.cache
def compiled_ops(formats: tuple[qgemm.Format, ...]) -> Ops:
    """The compiled ops table of a layer whose four matrices have ``formats`` (``qgemm.Format``)."""
    return Ops(f"compiled {tuple(tuple(f) for f in formats)}", True, elementwise.rms_norm, elementwise.qk_norm,
               elementwise.rope, elementwise.glu, tuple(_quantized_linear(*f) for f in formats),
               elementwise.rms_norm_rows, Product.of)


def ops_for(*matrices: Weight) -> Ops:
    """The ops table of a layer with ``matrices`` (in ``LayerWeights``' order): compiled when
    every one is quantized, else the reference. The one place a layer's arithmetic is chosen."""
    if all(isinstance(w, QuantWeight) for w in matrices):
        return compiled_ops(tuple(qgemm.format_of(w) for w in matrices))
    return REFERENCE
