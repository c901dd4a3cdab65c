"""What each kernel role of ``xclbins/flm_xclbins/manifest.json`` computes, in numpy, over the roles' buffers.

These are the semantics a kernel build must reproduce (to bfloat16 rounding): a kernel developer
can fill the buffers as the manifest lays them out, run the role here and compare. The tests run
the npu backend against a fake ``pyxrt`` whose kernels are these functions, which checks the host
side (buffer layouts, argument order, runlists, syncs) against the cpu backend; it says nothing
about a real kernel or device.

Axis legend as in ``flm_runtime.kernels.cpu``; R rows of the activation buffers, S KV capacity.
Buffers arrive as numpy arrays viewing the buffer's bytes: activations float32 ``[R, E]``, KV
``uint16`` (bfloat16 bits) ``[2, Hkv, S, D]``, step int32 ``[4]``, weights as ``unpack``ed dicts.
"""

from __future__ import annotations

import numpy as np

from flm_runtime.backends.npu.layout import from_bf16, to_bf16
from flm_runtime.kernels import cpu
from flm_runtime.layers.decoder import compose
from flm_runtime.layers.spec import LayerSpec


def decoder_layer(x_in: np.ndarray, x_out: np.ndarray, weights: dict[str, np.ndarray], kv: np.ndarray,
                  step: np.ndarray, geometry: dict) -> None:
    """Roles ``decode_layer``, ``verify_layer``, ``prefill_layer``: one Llama decoder layer, the
    runtime's own composition (``layers.decoder``) over numpy ops with keys and values stored as
    bfloat16.

    Args:
        x_in: ``[R, E]`` float32; rows ``0..T-1`` are the new positions ``start..start+T-1``.
        x_out: ``[R, E]`` float32, written rows ``0..T-1``.
        weights: the ``layer_weights`` tensors (float32 from bfloat16).
        kv: ``[2, Hkv, S, D]`` bfloat16 bits; keys (RoPE applied) and values of positions
            ``start..start+T-1`` are written, positions ``0..start+T-1`` attended.
        step: int32 ``[start, T, S, first_row]``.
        geometry: the build's geometry (``H``, ``Hkv``, ``D``, ``rope_theta``, ``rms_norm_eps``).
    """
    start, t, s, _ = (int(v) for v in step)
    h, hkv, d = int(geometry["H"]), int(geometry["Hkv"]), int(geometry["D"])
    assert kv.shape[2] == s and start + t <= s, f"step {step} does not fit a KV buffer of {kv.shape}"
    spec = LayerSpec(hidden_size=x_in.shape[1], ffn_size=weights["w_down"].shape[1], n_heads=h, n_kv_heads=hkv,
                     head_dim=d, rms_norm_eps=float(geometry["rms_norm_eps"]),
                     rope_theta=float(geometry["rope_theta"]))
    layer = compose(spec)  # the runtime's own layer, attention over the bfloat16 cache
    x = x_in[:t]  # [T, E]
    cos, sin = cpu.rope_tables(d, start + t, spec.rope_theta)
    cos, sin = cos[start:], sin[start:]  # [T, D/2]
    # a Llama layer: no Q/K/V bias, no QK-norm, no post norms
    q, k, v = layer.attention_in(x, weights["attn_norm"], weights["wqkv"], None, None, None, cos,
                                 sin)  # [T, H | Hkv, D]
    kv[0, :, start : start + t] = to_bf16(k.transpose(1, 0, 2))
    kv[1, :, start : start + t] = to_bf16(v.transpose(1, 0, 2))
    keys = from_bf16(kv[0, :, : start + t])  # [Hkv, N, D]
    values = from_bf16(kv[1, :, : start + t])
    attn = cpu.attention(q, keys, values, start)  # [T, H*D]
    x_out[:t] = layer.attention_out(x, attn, weights["wo"], None, weights["ffn_norm"], weights["w_gate_up"],
                                    weights["w_down"], None)


def lm_head(x_in: np.ndarray, weights: dict[str, np.ndarray], logits: np.ndarray, step: np.ndarray,
            geometry: dict) -> None:
    """Role ``lm_head``: ``logits[r] = RMSNorm(x_in[first_row + r]) @ lm_head^T``, r = 0..T-1-first_row.

    Args:
        x_in: ``[R, E]`` float32, the last layer's output.
        weights: the ``lm_head_weights`` tensors (``norm`` ``[E]``, ``lm_head`` ``[V, E]``).
        logits: ``[R, V]`` float32, written rows ``0..T-1-first_row``.
        step: int32 ``[start, T, S, first_row]``.
    """
    _, t, _, first = (int(v) for v in step)
    assert 0 <= first < t, f"first_row {first} outside 0..{t - 1}"
    h = cpu.rms_norm(x_in[first:t], weights["norm"], float(geometry["rms_norm_eps"]))  # [T-first, E]
    logits[: t - first] = h @ weights["lm_head"].T
