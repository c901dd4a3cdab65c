"""numpy kernels of the cpu backend: small pure functions, weights passed in, no hidden state
(``forward_pass`` alone touches process-wide state: OpenBLAS's thread count, around skinny passes).

Axis legend: T positions in this step, N positions attended (cache + new), H query heads,
Hkv key/value heads, R = H / Hkv query heads per key/value head, D head dim, E hidden size,
F FFN width, V vocabulary. All arrays are float32 unless stated.

This backend is the numerical reference every other backend is compared against.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import threadpoolctl

from flm_runtime.kernels import qgemm, quant, skinny_gemm
from flm_runtime.kernels.quant import QuantWeight, Weight


# Rows up to which a forward pass is skinny (decode, a verify pass, a small batched step): its
# products run the skinny kernel; 0 sends every product to BLAS, which benchmarks use to compare.
SKINNY_ROWS = skinny_gemm.MAX_ROWS


def linear(x: np.ndarray, w: Weight) -> np.ndarray:
    """A linear layer without bias, ``x @ w.T``, with ``w`` in Hugging Face layout.

    A quantized ``w`` runs the integer kernels of ``qgemm`` for any number of rows (each row's
    result independent of the others). A float32 ``w`` inside a skinny ``forward_pass``, 1..SKINNY_ROWS
    rows, runs ``skinny_gemm.skinny_linear``, which reads the weight once at close to memory speed
    where OpenBLAS does not (see that module); everything else (prefill chunks, large batches,
    calls outside a pass) runs BLAS. The two float32 paths agree to float32 rounding.

    Args:
        x: ``[T, in]`` float32.
        w: ``[out, in]`` float32 C-contiguous, or a ``QuantWeight``.
    Returns:
        ``[T, out]`` float32.
    """
    if isinstance(w, QuantWeight):
        return qgemm.qlinear(x, w)
    if getattr(_pass, "skinny", False) and 1 <= x.shape[0] <= SKINNY_ROWS:
        return skinny_gemm.skinny_linear(x, w)
    return x @ w.T


def embedding(table: Weight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` ``[T]`` of an embedding table ``[V, E]`` as float32 ``[T, E]`` (a quantized
    table dequantizes only those rows)."""
    return table.dequantize(ids) if isinstance(table, QuantWeight) else table[ids]


def stack_rows(weights: list[Weight]) -> Weight:
    """Matrices of one input width stacked along their output rows (fused QKV, gate/up): one
    product in place of several."""
    if all(isinstance(w, QuantWeight) for w in weights):
        return quant.stack_rows(weights)
    return np.concatenate([as_float32(w) for w in weights])


def take_rows(w: Weight, rows: np.ndarray) -> Weight:
    """Output rows ``rows`` of a matrix (a reduced vocabulary's LM head), in its own format."""
    return w.take_rows(rows) if isinstance(w, QuantWeight) else np.ascontiguousarray(w[rows])


def as_float32(w: Weight) -> np.ndarray:
    """``w`` as a float32 array (a quantized weight dequantized: backends that take float32)."""
    return w.dequantize() if isinstance(w, QuantWeight) else w


def _openblas_thread_setters() -> list:
    """``openblas_set_num_threads`` of each OpenBLAS loaded in the process (found by threadpoolctl),
    to call directly: threadpoolctl's own setter ignores every Python thread but the first one that
    used it (while that one lives), and each engine runs in a thread of its own."""
    setters = []
    for lib in threadpoolctl.ThreadpoolController().select(internal_api="openblas").lib_controllers:
        dll = ctypes.CDLL(lib.filepath)
        names = [f"{pre}openblas_set_num_threads{suf}" for pre in ("", "scipy_") for suf in ("", "64_", "_64")]
        setters += [getattr(dll, name) for name in names if hasattr(dll, name)][:1]
    return setters


_OPENBLAS_SETTERS = _openblas_thread_setters()  # numpy is loaded (imported above)
# BLAS's thread count outside skinny passes: numpy's own at import (OPENBLAS_NUM_THREADS, or the cores).
_BLAS_THREADS = max((lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"),
                    default=1)
_SKINNY_PASS = threading.Lock()
_pass = threading.local()  # .skinny: this thread is inside a skinny forward_pass


@contextmanager
def forward_pass(rows: int) -> Iterator[None]:
    """Wrap one forward pass of ``rows`` rows (a model's ``forward`` / ``forward_batch``).

    A skinny pass (1..SKINNY_ROWS rows) runs its products (``linear``) on the skinny kernel's
    threads, BLAS single-threaded meanwhile (docs/design.md, "Backends"); skinny passes of
    concurrent engines take turns (one lock); larger passes (prefill) run as they come, with
    BLAS's own threads.

    OpenBLAS's thread count is process-wide: after a skinny pass it is set back to numpy's count
    at import, whatever another library set meanwhile (a brief limit to 1 thread in another
    thread, as scikit-learn makes, must not stick). To run BLAS on one thread, set
    ``OPENBLAS_NUM_THREADS=1``.
    """
    if not 1 <= rows <= SKINNY_ROWS:
        yield
        return
    with _SKINNY_PASS:
        for setter in _OPENBLAS_SETTERS:
            setter(1)
        _pass.skinny = True
        try:
            yield
        finally:
            _pass.skinny = False
            for setter in _OPENBLAS_SETTERS:
                setter(_BLAS_THREADS)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        x: ``[T, E]``.
        weight: ``[E]``.
    Returns:
        ``[T, E]``.
    """
    ms = np.einsum("te,te->t", x, x)[:, None] / x.shape[-1]  # [T, 1]
    return x * (1.0 / np.sqrt(ms + eps)) * weight


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Cosine and sine tables of rotary position embeddings (Su et al. 2021, RoFormer).

    Frequencies ``theta^(-2i/D)`` for ``i in 0..D/2-1``, as Hugging Face's Llama computes them.

    Returns:
        ``(cos, sin)``, each ``[max_positions, D/2]`` float32.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [P, D/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs ``(i, i + D/2)`` ("rotate half", Hugging Face's convention).

    Args:
        x: ``[T, heads, D]``.
        cos, sin: ``[T, D/2]`` rows of ``rope_tables`` at the positions of ``x``.
    Returns:
        ``[T, heads, D]``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, *, causal: bool = True) -> np.ndarray:
    """Grouped-query attention of ``T`` new queries over ``N = start + T`` cached positions.

    Causal (the target): query ``t`` sits at position ``start + t`` and attends keys
    ``0 .. start + t``. Non-causal (the DFlash draft's block, docs/dflash.md): every query attends
    all ``N`` keys, i.e. the whole context and the whole block (bidirectional inside the block).
    Query head ``h`` reads key/value head ``h // R`` (Hugging Face's ``repeat_kv`` order).

    Args:
        q: ``[T, H, D]`` (RoPE applied).
        k, v: ``[Hkv, N, D]`` (keys with RoPE applied).
        start: position of the first query (tokens already in the cache before this step).
        causal: mask keys after each query's own position.
    Returns:
        ``[T, H * D]``.
    """
    t, h, d = q.shape
    hkv, n, _ = k.shape
    r = h // hkv
    qg = q.reshape(t, hkv, r, d).transpose(1, 2, 0, 3).reshape(hkv, r * t, d)  # [Hkv, R*T, D]
    scores = np.matmul(qg, k.transpose(0, 2, 1)) * np.float32(d**-0.5)  # [Hkv, R*T, N]
    if causal and t > 1:  # mask the new keys after each query's own position: the last T columns
        scores = scores.reshape(hkv, r, t, n)  # [Hkv, R, T, N]
        scores[..., start:] += np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)  # [T, T]
        scores = scores.reshape(hkv, r * t, n)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)  # [Hkv, R*T, D]
    return out.reshape(hkv, r, t, d).transpose(2, 0, 1, 3).reshape(t, h * d)


def qk_norm(qkv: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, h: int, hkv: int, d: int,
            eps: float) -> np.ndarray:
    """QK-norm (Qwen3, Gemma 3): RMSNorm of each query head and each key head of the fused QKV
    product, over the head dimension, with its own weight.

    Args:
        qkv: ``[T, (H + 2 Hkv) D]``: ``H`` query heads, then ``Hkv`` key heads, then the values.
        q_norm, k_norm: ``[D]``.
    Returns:
        ``[T, (H + 2 Hkv) D]``, the values copied as they are.
    """
    t = qkv.shape[0]
    q = rms_norm(qkv[:, :h * d].reshape(t * h, d), q_norm, eps).reshape(t, h * d)
    k = rms_norm(qkv[:, h * d:(h + hkv) * d].reshape(t * hkv, d), k_norm, eps).reshape(t, hkv * d)
    return np.concatenate([q, k, qkv[:, (h + hkv) * d:]], axis=1)


def glu(gate_up: np.ndarray, gelu: bool) -> np.ndarray:
    """The gated FFN's activation (Shazeer 2020, "GLU Variants Improve Transformer"): ``act(gate)
    * up``, ``act`` silu (SwiGLU) or, with ``gelu``, gelu's tanh approximation (GeGLU: ``g / 2 *
    (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, Hugging Face's ``gelu_pytorch_tanh``).

    Args:
        gate_up: ``[T, 2F]``, the fused gate and up projections (gate first).
    Returns:
        ``[T, F]``.
    """
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :f], gate_up[:, f:]
    if gelu:
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (gate + np.float32(0.044715) * gate ** 3)
        return np.float32(0.5) * gate * (1.0 + np.tanh(inner)) * up
    return gate / (1.0 + np.exp(-gate)) * up
