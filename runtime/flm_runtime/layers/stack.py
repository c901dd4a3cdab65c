"""The compiled decoder layers: a quantized model's whole stack (every decoder layer, the final norm
and, unless the caller runs its own, the LM head) as one compiled call per step, run by the
kernel thread team (``kernels.team``). A target's layers and an 8-bit DFlash draft's (the same
layers, non-causal, without a head) compile from this one definition; ``layers.decoder`` is the
numpy reference of the same layer.

Every thread of the team runs ``step`` at once: for each layer, its rows of each norm and
activation quantization, its tiles of each matrix product (with the residual add of its own
columns), its rows of RoPE and the K/V write, its (row, key-value head) items of attention,
meeting the others at a ``barrier`` wherever an op needs another's whole output (nine a layer,
eleven with post norms). A token pays one fork and one join, not a parallel region per op. Each
op is a row's or an item's compiled kernel (``quantize_row``, ``product_tile``,
``rms_norm_row``, ``qk_norm_row``, ``rope_row``, ``store_kv_row``, ``attend_item``,
``glu_row``) whose arithmetic depends on that row alone, and a product's tiles are the ones
``qgemm.qlinear`` makes. So a row's result is bit-identical alone or beside other rows, in a
decode or a verify pass, whatever the number of threads (docs/design.md, "Batch invariance"), and
a head the caller runs with ``qlinear`` on the final norm's rows gives the bits the step's own
head would.

The layers share one spec but for their sliding window and the RoPE table they read (Gemma 3
interleaves sliding-window layers with global ones, each kind with its RoPE base): the windows
are constants of the compiled step, the tables an argument (``cos``, ``sin`` ``[T, R, D/2]``
and each layer's table). The spec's features are constants too (``causal`` among them): a
feature the layers do not turn on is not in the compiled code.

The weights are stacked per kind (``StackWeights``): the codes, scales and mins of every matrix in
one array each, a table of where each matrix starts and which format it has, the norms in one
array, the QK-norms and the Q/K/V biases in one each, so that a step takes a handful of arguments
whatever the depth, and the layers' own weights are views into them (no second copy).

Each sequence's rows find its KV cache through the step's span table: the addresses and size of
its pool's key and value arrays and where its block table starts in the step's one array of
block tables (``kv_cache``), so one call serves every sequence of a batched step, whether they
share the engine's pool or each has its own (a DFlash draft's caches).

Axis legend: R rows of the step, E hidden size, H / Hkv query / key-value heads, D head dim, F FFN
width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import attention, qgemm
from flm_runtime.kernels.elementwise import glu_row, qk_norm_row, rms_norm_row, rope_row
from flm_runtime.kernels.jit import compiled, sources_key
from flm_runtime.kernels.quant import BLOCK, TILE, QuantWeight, joined
from flm_runtime.kernels.team import Team, barrier, default_team
from flm_runtime.kv_cache import KEY_TILE
from flm_runtime.layers.decoder import LayerWeights, RowSpan
from flm_runtime.layers.spec import LayerSpec

# Columns of a ``StackWeights.matrices`` row: where a matrix's codes, scales and mins start in the
# stacked arrays, its tiles (16 output rows each), its blocks (32 inputs each) and its format's
# slot in ``StackWeights.formats``.
CODES, SCALES, MINS, TILES, BLOCKS, FORMAT = range(6)
# Slots of a layer's row of ``StackWeights.norms``: its RMSNorms' weights (the post norms' only
# with ``LayerSpec.post_norms``).
ATTN_NORM, FFN_NORM, POST_ATTN_NORM, POST_FFN_NORM = range(4)
_WORKSPACES = 8  # step shapes whose work arrays are kept (decode, verify, prefill chunks, batches)


class StackWeights(NamedTuple):
    """A quantized model's matrices and norms stacked per kind (module docstring).

    Attributes:
        codes: uint8 ``[*]``, every matrix's ``QuantWeight.codes`` one after the other.
        scales, mins: uint16 ``[*]``: their float16 scales and mins as bits (mins: only of the
            matrices that store them).
        matrices: int64 ``[L + 1, 4, 6]``: row ``l`` the QKV, O, gate/up and down matrices of
            layer ``l`` (columns ``CODES .. FORMAT``); row ``L``, role 0, the LM head (zeros
            without one).
        norms: float32 ``[L + 1, 2 or 4, E]``: layer ``l``'s norms in the slots ``ATTN_NORM ..
            POST_FFN_NORM`` (4 slots with post norms); row ``L``, slot 0: the final norm.
        qk_norms: float32 ``[L, 2, D]``: layer ``l``'s query and key head norms, or ``[0, 2, 0]``
            without QK-norm.
        biases: float32 ``[L, (H + 2 Hkv) D]``: layer ``l``'s Q/K/V bias, or ``[0, 0]`` without.
        formats: the distinct ``qgemm.Format`` of the matrices (at most 5: 4- and 8-bit with and
            without mins, 6-bit), the slots of ``FORMAT``.
    """

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    matrices: np.ndarray
    norms: np.ndarray
    qk_norms: np.ndarray
    biases: np.ndarray
    formats: tuple[qgemm.Format, ...]


def stack_weights(layers: list[LayerWeights], final_norm: np.ndarray,
                  lm_head: QuantWeight | None) -> tuple[StackWeights, list[LayerWeights], QuantWeight | None]:
    """The stacked weights of a quantized model, and its layers and LM head rebuilt as views
    into them (so that the originals can be freed). The matrices' arrays are not copied when they
    already lie one after the other, layer by layer (QKV, O, gate/up, down), then the LM head
    (``quant.joined``; kept weights are laid out so: ``loading.converted``). Without ``lm_head``
    the table's head row is empty: a stack whose caller runs its own head (``Stack``).

    Raises:
        ValueError: a matrix is not quantized, or the layers differ in which optional vectors they
            have.
    """
    matrices = [m for layer in layers for m in layer.matrices] + ([] if lm_head is None else [lm_head])
    if not all(isinstance(m, QuantWeight) for m in matrices):
        raise ValueError("a stacked model's matrices are all quantized")
    formats = tuple(dict.fromkeys(qgemm.format_of(m) for m in matrices))
    codes = joined([m.codes for m in matrices])
    scales = joined([m.scales for m in matrices]).view(np.uint16)
    mins = joined([m.mins for m in matrices if m.mins is not None] or [np.zeros(0, np.float16)]).view(np.uint16)
    table = np.zeros((len(layers) + 1, 4, 6), dtype=np.int64)
    offsets = np.zeros(3, dtype=np.int64)
    views = []
    for i, m in enumerate(matrices):
        at = table[i // 4, i % 4] if i < 4 * len(layers) else table[len(layers), 0]
        at[:] = (*offsets, m.codes.shape[0], m.scales.shape[1] // TILE, formats.index(qgemm.format_of(m)))
        view = (codes[offsets[0]:offsets[0] + m.codes.size].reshape(m.codes.shape),
                scales[offsets[1]:offsets[1] + m.scales.size].view(np.float16).reshape(m.scales.shape),
                None if m.mins is None else mins[offsets[2]:offsets[2] + m.mins.size].view(np.float16).reshape(m.mins.shape))
        views.append(QuantWeight(m.bits, *view, m.in_features, m.out_features))
        offsets += (m.codes.size, m.scales.size, 0 if m.mins is None else m.mins.size)
    optional = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
    has = {name: getattr(layers[0], name) is not None for name in optional}
    if any((getattr(layer, name) is not None) != has[name] for layer in layers for name in optional):
        raise ValueError(f"a stacked model's layers all have or all lack each of {optional}")
    post = has["post_attn_norm"]
    norms = np.zeros((len(layers) + 1, 4 if post else 2, final_norm.shape[0]), dtype=np.float32)
    for i, layer in enumerate(layers):
        norms[i] = (layer.attn_norm, layer.ffn_norm, layer.post_attn_norm, layer.post_ffn_norm)[:norms.shape[1]]
    norms[len(layers), 0] = final_norm
    if has["q_norm"]:
        qk_norms = np.stack([np.stack([layer.q_norm, layer.k_norm]) for layer in layers]).astype(np.float32)
    else:
        qk_norms = np.zeros((0, 2, 0), dtype=np.float32)
    if has["qkv_bias"]:
        biases = np.stack([layer.qkv_bias for layer in layers]).astype(np.float32)
    else:
        biases = np.zeros((0, 0), dtype=np.float32)
    rebuilt = [LayerWeights(norms[i, ATTN_NORM], views[4 * i], views[4 * i + 1], norms[i, FFN_NORM], views[4 * i + 2],
                            views[4 * i + 3], qkv_bias=biases[i] if has["qkv_bias"] else None,
                            q_norm=qk_norms[i, 0] if has["q_norm"] else None,
                            k_norm=qk_norms[i, 1] if has["q_norm"] else None,
                            post_attn_norm=norms[i, POST_ATTN_NORM] if post else None,
                            post_ffn_norm=norms[i, POST_FFN_NORM] if post else None)
               for i in range(len(layers))]
    head = None if lm_head is None else views[-1]
    return StackWeights(codes, scales, mins, table, norms, qk_norms, biases, formats), rebuilt, head


def shared_spec(specs: Sequence[LayerSpec]) -> LayerSpec:
    """What a stack's layers share: their spec with no sliding window and no RoPE base (the stack
    takes those per layer).

    Raises:
        ModelFormatError: a spec asks what the layers do not run (``LayerSpec.check``), or the
            layers differ in anything else, named.
    """
    for spec in specs:
        spec.check()
    shared = [dataclasses.replace(s, sliding_window=0, rope_theta=0.0) for s in specs]
    differ = [f.name for f in dataclasses.fields(LayerSpec) if len({getattr(s, f.name) for s in shared}) > 1]
    if differ:
        raise ModelFormatError(f"the model's layers differ in {', '.join(differ)}; a stack's layers may differ "
                               "only in their sliding window and RoPE table")
    return shared[0]


@numba.njit(inline="always")
def _matrix_views(codes, scales, mins, matrix, bits, has_mins):  # pragma: no cover - compiled
    """A stacked matrix's ``(codes, scales, mins)`` as ``qgemm.operands`` gives them, views into
    the stacked arrays (``matrix``: its row of ``StackWeights.matrices``; ``bits``, ``has_mins``:
    its format's)."""
    tiles, blocks = matrix[TILES], matrix[BLOCKS]
    width = blocks * qgemm.compiled_block_bytes(bits)
    # views from pointers, not reshaped slices: the same arrays, without reshape's shape check,
    # whose error message numba compiles for seconds in every process that compiles a step
    c = numba.carray(_element_pointer(codes, matrix[CODES]), (tiles, width))
    s = numba.carray(_element_pointer(scales, matrix[SCALES]), (tiles, blocks * TILE))
    m = numba.carray(_element_pointer(mins, matrix[MINS]), (tiles, blocks * TILE) if has_mins else (0, TILE))
    return c, s, m


def _format_products(formats: tuple[qgemm.Format, ...]):
    """``linear(codes, scales, mins, matrix, acts, out, tid, n_threads) -> (first, stop)``: this
    thread's tiles ``first .. stop-1`` of the product of ``acts`` (``quantize_row``'s five
    arrays) and the stacked matrix ``matrix`` (a row of ``StackWeights.matrices``) into ``out``,
    on the kernel of the matrix's format (``qgemm.format_product``: a call, so that each format's
    kernel is compiled once, not at each of a step's five products). The formats are constants:
    one branch per distinct format."""

    def product(fmt: qgemm.Format):
        _, bits, has_mins = fmt
        kernel = qgemm.format_product(fmt)

        @numba.njit(inline="always")
        def tiles(codes, scales, mins, matrix, acts, out, first, stop):  # pragma: no cover - compiled
            xq, xw, step, sx, s = acts
            c, sc, mn = _matrix_views(codes, scales, mins, matrix, bits, has_mins)
            kernel(c, sc, mn, xq, xw, step, sx, s, out, first, stop)

        return tiles

    def dispatch(slot: int, here, rest):
        @numba.njit(inline="always")
        def tiles(codes, scales, mins, matrix, acts, out, first, stop):  # pragma: no cover - compiled
            if matrix[FORMAT] == slot:
                here(codes, scales, mins, matrix, acts, out, first, stop)
            else:
                rest(codes, scales, mins, matrix, acts, out, first, stop)

        return tiles

    tiles = product(formats[-1])
    for slot in range(len(formats) - 2, -1, -1):
        tiles = dispatch(slot, product(formats[slot]), tiles)

    @numba.njit(inline="always")
    def linear(codes, scales, mins, matrix, acts, out, tid, n_threads):  # pragma: no cover - compiled
        first, stop = matrix[TILES] * tid // n_threads, matrix[TILES] * (tid + 1) // n_threads
        tiles(codes, scales, mins, matrix, acts, out, first, stop)
        return first, stop

    return linear


# Columns of a step's span table: per sequence, its first row and row count, the positions its
# cache held before the step, the addresses of its pool's keys and values, the pool's blocks and
# positions per block, and where the sequence's blocks start in the step's block tables.
FIRST, ROWS, START, K_ADDRESS, V_ADDRESS, POOL_BLOCKS, BLOCK_TOKENS, TABLE = range(8)


@intrinsic
def _element_pointer(typingctx, array, index):  # pragma: no cover - compiled
    """``&array[index]`` of a 1-D contiguous array, as a pointer to its dtype, for ``numba.carray``."""
    sig = types.CPointer(array.dtype)(array, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.gep(data, [args[1]])

    return sig, codegen


@intrinsic
def _half_pointer(typingctx, address):  # pragma: no cover - compiled
    """The int64 ``address`` as a pointer to float16 bits (uint16), for ``numba.carray``."""
    sig = types.CPointer(types.uint16)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@functools.cache
def compile_step(spec: LayerSpec, windows: tuple[int, ...], formats: tuple[qgemm.Format, ...], head: bool):
    """The compiled step of a stack of layers of ``spec`` (``shared_spec``) and sliding windows
    ``windows`` (one a layer, 0: none) whose matrices have ``formats``, with the LM head or
    without (``head``):

    ``step(tid, n_threads, sync, codes, scales, mins, matrices, norms, qk_norms, biases, x, cos,
    sin, rope, spans, tables, row_span, logit_rows, taps, tapped, normed, logits, work)``, run by
    every thread of a ``Team``: the rows ``x`` ``[R, E]`` (updated in place: the residual stream)
    through every layer, layer ``l`` reading the RoPE table ``rope[l]`` of ``cos``, ``sin`` ``[T,
    R, D/2]`` (T tables at the rows' positions). ``spans`` ``[S, 8]`` int64 says which rows belong
    to which sequence (``FIRST .. TABLE``: its rows ``FIRST .. FIRST+ROWS-1`` take positions
    ``START ..`` of its float16 cache, in the blocks ``tables[TABLE ..]`` of a pool whose keys
    ``[L, POOL_BLOCKS, Hkv, BLOCK_TOKENS/16, D, 16]`` and values ``[L, POOL_BLOCKS, Hkv,
    BLOCK_TOKENS, D]`` are at the given addresses), ``row_span`` ``[R]`` the span of each row. Each
    row's K/V is written into its sequence's cache; the residual stream after layer ``taps[j]``
    goes to columns ``j*E ..`` of ``tapped`` ``[R, n*E]``; the final norm of the rows
    ``logit_rows`` ``[N]`` goes to ``normed`` ``[N, E]``, and with ``head`` the LM head's logits
    of them to ``logits`` ``[N, V]`` (not read without). ``work`` is ``Workspace``'s arrays.
    """
    linear = _format_products(formats)
    h, hkv, d, causal = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.causal
    has_bias, has_qk_norm, post_norms = spec.qkv_bias, spec.qk_norm, spec.post_norms
    gelu, scale = spec.activation == "gelu_tanh", spec.softmax_scale
    eps = np.float32(spec.rms_norm_eps)
    store_kv_row, attend_item = attention.store_kv_row, attention.attend_item

    @numba.njit(inline="always")
    def caches(spans, tables, b, layers):  # pragma: no cover - compiled
        """Sequence ``b``'s pool (keys and values, every layer) and its blocks."""
        blocks, block = spans[b, POOL_BLOCKS], spans[b, BLOCK_TOKENS]
        k = numba.carray(_half_pointer(spans[b, K_ADDRESS]), (layers, blocks, hkv, block // KEY_TILE, d, KEY_TILE))
        v = numba.carray(_half_pointer(spans[b, V_ADDRESS]), (layers, blocks, hkv, block, d))
        return k, v, tables[spans[b, TABLE]:]

    @numba.njit(inline="always")
    def normed_product(x, weight, xn, acts, codes, scales, mins, matrix, out, sync, tid,
                       n_threads):  # pragma: no cover - compiled
        """``out = rms_norm(x, weight) @ matrix.T``: this thread's rows of the norm and their
        quantization, then (past a barrier) its tiles of the product; returns past the next."""
        for r in range(tid, x.shape[0], n_threads):
            rms_norm_row(x, weight, eps, xn, r)
            qgemm.quantize_row(xn, r, acts[1].shape[1], *acts)
        barrier(sync, n_threads)
        linear(codes, scales, mins, matrix, acts, out, tid, n_threads)
        barrier(sync, n_threads)

    @numba.njit(inline="always")
    def residual(x, out, first, stop, post_norm, xn, sync, tid, n_threads):  # pragma: no cover - compiled
        """``x += out`` after a product whose tiles ``first .. stop-1`` this thread made: its own
        columns; with post norms (past a barrier) its rows of ``rms_norm(out, post_norm)`` (via
        ``xn``; ``post_norm`` is not read without). Every row of ``x`` is whole past the barrier
        it returns behind."""
        if post_norms:
            barrier(sync, n_threads)
            for r in range(tid, x.shape[0], n_threads):
                rms_norm_row(out, post_norm, eps, xn, r)
                for c in range(x.shape[1]):
                    x[r, c] += xn[r, c]
        else:
            _add_columns(x, out, first * TILE, min(stop * TILE, x.shape[1]))
        barrier(sync, n_threads)

    def step(tid, n_threads, sync, codes, scales, mins, matrices, norms, qk_norms, biases, x, cos, sin, rope, spans,
             tables, row_span, logit_rows, taps, tapped, normed, logits, work):  # pragma: no cover - compiled
        xn, qkv, q, k, v, attn, out, gate_up, act, acts_e, acts_attn, acts_f, acts_last = work
        rows, e = x.shape
        layers = matrices.shape[0] - 1
        for layer in range(layers):
            mats = matrices[layer]
            cos_l, sin_l = cos[rope[layer]], sin[rope[layer]]
            normed_product(x, norms[layer, ATTN_NORM], xn, acts_e, codes, scales, mins, mats[0], qkv, sync, tid,
                           n_threads)
            for r in range(tid, rows, n_threads):
                if has_bias:
                    for j in range(qkv.shape[1]):
                        qkv[r, j] += biases[layer, j]
                if has_qk_norm:
                    qk_norm_row(qkv, qk_norms[layer, 0], qk_norms[layer, 1], h, hkv, d, eps, r)
                rope_row(qkv, cos_l, sin_l, 0, h, d, q, r)
                rope_row(qkv, cos_l, sin_l, h * d, hkv, d, k, r)
                for j in range(hkv * d):
                    v[r, j // d, j % d] = qkv[r, (h + hkv) * d + j]
                b = row_span[r]
                kc, vc, table = caches(spans, tables, b, layers)
                # row r is position START + (r - FIRST) of its sequence: store_kv_row writes row t at start + t
                store_kv_row(k, v, kc[layer], vc[layer], table, spans[b, START] - spans[b, FIRST], r)
            barrier(sync, n_threads)
            items = rows * hkv
            window = windows[layer]
            for item in range(items * tid // n_threads, items * (tid + 1) // n_threads):
                b = row_span[item // hkv]
                first, n = spans[b, FIRST], spans[b, ROWS]
                kc, vc, table = caches(spans, tables, b, layers)
                attend_item(q[first:first + n], kc[layer], vc[layer], table, spans[b, START], causal, window, scale,
                            attn[first:first + n], item - first * hkv)
            barrier(sync, n_threads)
            for r in range(tid, rows, n_threads):
                qgemm.quantize_row(attn, r, acts_attn[1].shape[1], *acts_attn)
            barrier(sync, n_threads)
            first, stop = linear(codes, scales, mins, mats[1], acts_attn, out, tid, n_threads)
            residual(x, out, first, stop, norms[layer, POST_ATTN_NORM if post_norms else ATTN_NORM], xn, sync, tid,
                     n_threads)
            normed_product(x, norms[layer, FFN_NORM], xn, acts_e, codes, scales, mins, mats[2], gate_up, sync, tid,
                           n_threads)
            for r in range(tid, rows, n_threads):
                glu_row(gate_up, act, r, gelu)
                qgemm.quantize_row(act, r, acts_f[1].shape[1], *acts_f)
            barrier(sync, n_threads)
            first, stop = linear(codes, scales, mins, mats[3], acts_f, out, tid, n_threads)
            residual(x, out, first, stop, norms[layer, POST_FFN_NORM if post_norms else FFN_NORM], xn, sync, tid,
                     n_threads)
            for j in range(taps.shape[0]):
                if taps[j] == layer:
                    for r in range(tid, rows, n_threads):
                        tapped[r, j * e:(j + 1) * e] = x[r]
        for i in range(tid, logit_rows.shape[0], n_threads):
            normed[i] = x[logit_rows[i]]
            rms_norm_row(normed, norms[layers, 0], eps, normed, i)  # in place: a row is read whole first
            if head:
                qgemm.quantize_row(normed, i, acts_last[1].shape[1], *acts_last)
        barrier(sync, n_threads)
        if head:
            linear(codes, scales, mins, matrices[layers, 0], acts_last, logits, tid, n_threads)
            barrier(sync, n_threads)

    # No fastmath here: the residual adds and biases keep the exact arithmetic of the reference;
    # the fastmath ops (norm, activation, attention) are calls.
    return compiled(step, f"stack {formats!r} {spec!r} {windows!r} head={head} {sources_key(Path(__file__).parent)}",
                    nogil=True)


@numba.njit(inline="always")
def _add_columns(x, out, first, stop):  # pragma: no cover - compiled
    """``x[:, first:stop] += out[:, first:stop]``: a thread's residual add over its own columns."""
    for r in range(x.shape[0]):
        for c in range(first, stop):
            x[r, c] += out[r, c]


class Workspace(NamedTuple):
    """The arrays a step of ``R`` rows writes between its ops, shared by the team's threads."""

    xn: np.ndarray  # [R, E] a norm's output
    qkv: np.ndarray  # [R, (H + 2 Hkv) D]
    q: np.ndarray  # [R, H, D] RoPE applied
    k: np.ndarray  # [R, Hkv, D] RoPE applied
    v: np.ndarray  # [R, Hkv, D]
    attn: np.ndarray  # [R, H D]
    out: np.ndarray  # [R, E] the O and down products' output
    gate_up: np.ndarray  # [R, 2F]
    act: np.ndarray  # [R, F]
    acts_e: tuple  # quantized activations of width E, of H D and of F (``qgemm.new_activations``)
    acts_attn: tuple
    acts_f: tuple
    acts_last: tuple  # the final norm's rows quantized for the LM head

    @classmethod
    def of(cls, spec: LayerSpec, rows: int, logit_rows: int) -> Workspace:
        h, hkv, d, e, f = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.hidden_size, spec.ffn_size

        def empty(*shape):
            return np.empty(shape, dtype=np.float32)

        def acts(m, width):  # its Python source: compiling it would cost every process a second
            return qgemm.new_activations.py_func(m, -(-width // BLOCK) * BLOCK)

        return cls(empty(rows, e), empty(rows, (h + 2 * hkv) * d), empty(rows, h, d), empty(rows, hkv, d),
                   empty(rows, hkv, d), empty(rows, h * d), empty(rows, e), empty(rows, 2 * f), empty(rows, f),
                   acts(rows, e), acts(rows, h * d), acts(rows, f), acts(logit_rows, e))


class Stack:
    """A quantized model's stack as one compiled step (module docstring).

    Args:
        weights: the stacked weights (``stack_weights``).
        specs: each layer's spec; they may differ only in ``sliding_window`` and ``rope_theta``.
        vocab: the LM head's output width (V); None when the weights hold no head (the caller
            runs its own on the final norm's rows: a DFlash draft scoring the target's head, a
            model whose head is not quantized).
        team: the threads that run its steps; None: the process's (``default_team``, looked up
            at each step, so that a forked child uses its own).
        rope: int ``[L]``, the RoPE table each layer reads of a step's ``cos``, ``sin``; None: the
            first for every layer.

    Raises:
        ModelFormatError: a spec asks what the layers do not run or the specs differ in more
            (``shared_spec``), or the weights lack a vector their features read.
    """

    def __init__(self, weights: StackWeights, specs: Sequence[LayerSpec], vocab: int | None,
                 team: Team | None = None, *, rope: Sequence[int] | None = None):
        layers = weights.matrices.shape[0] - 1
        assert len(specs) == layers, f"{len(specs)} specs for {layers} layers"
        assert (vocab is None) == (weights.matrices[layers, 0, TILES] == 0), "a vocabulary is a head's"
        self.spec = spec = shared_spec(specs)
        present = {"qkv_bias": weights.biases.shape[0] == layers, "qk_norm": weights.qk_norms.shape[0] == layers,
                   "post_norms": weights.norms.shape[1] == 4}
        if wrong := [name for name, has in present.items() if getattr(spec, name) != has]:
            raise ModelFormatError(f"the stacked weights do not hold what the layers' {', '.join(wrong)} read")
        self.weights, self.specs, self.vocab, self.team = weights, tuple(specs), vocab, team
        self.rope = np.zeros(layers, dtype=np.int64) if rope is None else np.asarray(rope, dtype=np.int64)
        assert self.rope.shape == (layers,) and self.rope.min(initial=0) >= 0, f"rope tables {rope}"
        self._step = compile_step(spec, tuple(s.sliding_window for s in specs), weights.formats, vocab is not None)
        self._workspaces: dict[tuple[int, int], Workspace] = {}  # by (rows, logit rows), least recently used first
        self._workspaces_lock = threading.Lock()  # two engines (a tag and its DFlash tag) share a target

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, spans: list[RowSpan],
                 taps: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows ``x`` ``[R, E]`` float32 (modified: the residual stream) of the sequences
        ``spans`` (their caches' room reserved, float16) through the stack, at their positions
        (``cos``, ``sin`` ``[T, R, D/2]`` float32 C-contiguous: the T RoPE tables ``rope`` names,
        at the rows' positions); each row's K/V is written into its cache, nothing is committed.

        Returns:
            logits ``[sum n_logits, V]`` float32 of each span's last ``n_logits`` rows, span after
            span (a new array), or without a head (``vocab`` None) the final norm of those rows
            ``[sum n_logits, E]``; the residual stream after the layers ``taps`` ``[R, len(taps)
            * E]``, or None.
        """
        rows, e = x.shape
        assert cos.shape == sin.shape and cos.ndim == 3 and cos.shape[0] > self.rope.max(initial=0) and (
            cos.shape[1] == rows and cos.flags.c_contiguous and sin.flags.c_contiguous), f"RoPE tables {cos.shape}"
        logit_rows = np.concatenate([np.arange(s.rows.stop - s.n_logits, s.rows.stop) for s in spans])
        key = (rows, logit_rows.size)
        with self._workspaces_lock:  # the arrays are used under the team's lock, one step at a time
            work = self._workspaces.pop(key, None) or Workspace.of(self.spec, *key)
            self._workspaces[key] = work  # most recently used last
            if len(self._workspaces) > _WORKSPACES:
                del self._workspaces[next(iter(self._workspaces))]
        tables = [s.cache.table for s in spans]
        offsets = np.cumsum([0] + [t.size for t in tables[:-1]])
        table = np.array([(s.rows.start, s.n_rows, s.start, s.cache.pool.k.ctypes.data, s.cache.pool.v.ctypes.data,
                           s.cache.pool.n_blocks, s.cache.pool.block_tokens, offset)
                          for s, offset in zip(spans, offsets)], dtype=np.int64)
        assert all(s.cache.pool.k.dtype == np.float16 and s.cache.pool.k.flags.c_contiguous for s in spans)
        row_span = np.repeat(np.arange(len(spans)), [s.n_rows for s in spans])
        normed = np.empty((logit_rows.size, e), dtype=np.float32)
        logits = np.empty((logit_rows.size, self.vocab or 0), dtype=np.float32)
        tapped = np.empty((rows, len(taps) * e), dtype=np.float32)
        w = self.weights
        (self.team or default_team()).run(self._step, w.codes, w.scales, w.mins, w.matrices, w.norms, w.qk_norms,
                                          w.biases, x, cos, sin, self.rope, table, np.concatenate(tables), row_span,
                                          logit_rows, np.asarray(taps, dtype=np.int64), tapped, normed, logits,
                                          tuple(work))
        return (normed if self.vocab is None else logits), (tapped if taps else None)
