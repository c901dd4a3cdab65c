"""The target (a Llama-family model) in torch, batched, for self-distillation data.

The numpy ``flm_runtime.models.llama.LlamaModel`` decodes one sequence at a time; this module
runs up to a few dozen at once from the *same* float32 weights (Hugging Face names and
rotate-half RoPE, as ``flm_runtime.loading`` returns them), so the responses it generates are the
target's own. ``tests/training/test_target.py`` checks logits and greedy tokens against numpy.

Axis legend: B batch (slots), T new positions, S cache positions, L layers, H query heads,
Hkv key/value heads, D head dim, E hidden size, V vocabulary, n taps.

The cache is per slot: slot ``b`` holds positions ``0 .. lengths[b]-1`` in columns of the same
index, so a finished slot is refilled with a new prompt while the others keep decoding
(continuous batching): no padding and no work spent on finished sequences.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F
from flm_runtime.core import LlamaConfig


def default_tap_layers(num_layers: int, n_taps: int = 5) -> list[int]:
    """The target layers tapped for the draft's context (docs/dflash.md): ``round(1 + i*(L-4)/(n-1))``."""
    return [round(1 + i * (num_layers - 4) / (n_taps - 1)) for i in range(n_taps)]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, computed in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_pos, D/2]`` for rotate-half RoPE (computed in float64 like numpy's tables)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]  # [P, D/2]
    return torch.from_numpy(np.cos(ang).astype(np.float32)), torch.from_numpy(np.sin(ang).astype(np.float32))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x ``[..., T, D]``; cos/sin ``[..., T, D/2]`` broadcastable to x's leading axes."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One new query per slot over that slot's own cached positions (a batched decode step).

    Grouped-query: query head ``h`` reads key/value head ``h // R`` (Hugging Face's ``repeat_kv``
    order). torch's ``scaled_dot_product_attention`` runs this shape (48 slots, R = 3 query rows
    per key/value head, every slot padded to the longest) as many tiny products.
    ``_decode_attention`` reads each slot's K/V once, only up to its own position, with the same
    tokens out (profile: docs/history/training.md, "Generation's decode attention").

    Args:
        q: ``[B, H, 1, D]`` float32 (RoPE applied).
        k, v: ``[B, Hkv, S, D]`` float32 C-contiguous: the whole cache of one layer.
        pos: ``[B]`` int64: slot ``b`` attends its positions ``0 .. pos[b]``.
    Returns:
        ``[B, H, 1, D]`` float32.
    """
    b, h, _, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, d).contiguous()  # [B, Hkv, R, D]
    out = torch.empty_like(qg)
    _decode_attention(qg.numpy(), k.numpy(), v.numpy(), pos.numpy(), out.numpy())
    return out.reshape(b, h, 1, d)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray,
                      out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[b, g, r] = softmax(q[b, g, r] . k[b, g, :n] / sqrt(D)) @ v[b, g, :n]``, ``n = pos[b] + 1``;
    q, out ``[B, Hkv, R, D]``, k, v ``[B, Hkv, S, D]``. Scores and the max-subtracted softmax in
    float32, as numpy's ``cpu.attention`` computes them."""
    nb, hkv, r, d = q.shape
    scale = np.float32(1.0 / np.sqrt(d))
    scores = np.empty((r, k.shape[2]), dtype=np.float32)
    for b in range(nb):
        n = pos[b] + 1
        for g in range(hkv):
            for s in range(n):
                for i in range(r):
                    acc = np.float32(0.0)
                    for j in range(d):
                        acc += q[b, g, i, j] * k[b, g, s, j]
                    scores[i, s] = acc * scale
            for i in range(r):
                m = scores[i, :n].max()
                total = np.float32(0.0)
                for s in range(n):
                    e = np.exp(scores[i, s] - m)
                    scores[i, s] = e
                    total += e
                for j in range(d):
                    out[b, g, i, j] = 0.0
                for s in range(n):
                    p = scores[i, s] / total
                    for j in range(d):
                        out[b, g, i, j] += p * v[b, g, s, j]


@dataclass
class SlotCache:
    """K/V of ``B`` slots: ``k``, ``v`` ``[L, B, Hkv, S, D]``; ``lengths`` ``[B]`` valid positions."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor  # [B] int64


class TorchLlama:
    """Llama forward pass in torch from HF-named float32 weights (frozen; inference only).

    Args:
        config: the target's hyper-parameters (``flm_runtime.core.LlamaConfig``).
        weights: HF name -> float32 numpy array (``ModelBundle.weights``); shared, not copied.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray]):
        self.config = c = config
        t = lambda name: torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))
        self.embed = t("model.embed_tokens.weight")  # [V, E]
        self.lm_head = self.embed if c.tie_word_embeddings else t("lm_head.weight")  # [V, E]
        self.norm = t("model.norm.weight")  # [E]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "attn_norm": t(p + "input_layernorm.weight"),
                "wqkv": torch.cat([t(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),  # [(H+2Hkv)D, E]
                "wo": t(p + "self_attn.o_proj.weight"),  # [E, HD]
                "ffn_norm": t(p + "post_attention_layernorm.weight"),
                "w_gate_up": torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]),  # [2F, E]
                "w_down": t(p + "mlp.down_proj.weight"),  # [E, F]
            })
        self.cos, self.sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta)

    def new_cache(self, batch: int, capacity: int) -> SlotCache:
        c = self.config
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, capacity, c.head_dim)
        return SlotCache(torch.zeros(shape), torch.zeros(shape), torch.zeros(batch, dtype=torch.long))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: SlotCache, slot: int | None = None,
                tap_layers: list[int] = (), all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new positions, writing their K/V into the cache at columns ``pos``.

        Two shapes of call (both keep the cache views copy-free):
        - prefill of one slot: ``slot`` = its index, ``ids``/``pos`` ``[1, T]``;
        - a decode step of every slot: ``slot`` None, ``ids``/``pos`` ``[B, 1]`` (an idle slot
          decodes a dummy token at position 0: its column 0 is rewritten when it is refilled).

        Args:
            ids: token ids; pos: their positions (consecutive per row).
            tap_layers: 0-based layers whose output (residual stream after the layer) to return.
            all_logits: logits for every position instead of the last one of each row.
        Returns:
            logits ``[B', T or 1, V]`` float32; taps ``[B', T, n, E]`` (None without tap_layers).
        """
        c = self.config
        b, t = ids.shape
        assert (slot is None and t == 1 and b == cache.k.shape[1]) or (slot is not None and b == 1)
        x = self.embed[ids]  # [B', T, E]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B', 1, T, D/2]
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        if slot is not None:  # the slot's prefill attends its cache up to its last new position
            n_keys = int(pos[0, -1]) + 1
            mask = torch.arange(n_keys)[None, :] <= pos[0, :, None]  # [T, S'] causal

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """Write the new K/V into layer ``i``'s cache, attend the slot's cached positions."""
            ck, cv = cache.k[i], cache.v[i]  # [B, Hkv, S, D]
            if slot is None:
                ar = torch.arange(b)
                ck[ar, :, pos[:, 0]] = k[:, :, 0]  # [B, Hkv, D]
                cv[ar, :, pos[:, 0]] = v[:, :, 0]
                return decode_attention(q, ck, cv, pos[:, 0])  # [B, H, 1, D]
            p0 = int(pos[0, 0])
            ck[slot, :, p0: p0 + t] = k[0]
            cv[slot, :, p0: p0 + t] = v[0]
            keys, vals = ck[rows, :, :n_keys], cv[rows, :, :n_keys]  # [1, Hkv, S', D] (views)
            return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)  # [1, H, T, D]

        taps = []
        for i, w in enumerate(self.layers):
            x = self._layer(w, x, cos, sin, functools.partial(attend, i))  # [B', T, E]
            if i in tap_layers:
                taps.append(x)
        cache.lengths[rows] = pos[:, -1] + 1
        if not all_logits:
            x = x[:, -1:]
        logits = rms_norm(x, self.norm, c.rms_norm_eps) @ self.lm_head.T  # [B', T or 1, V]
        return logits, (torch.stack(taps, dim=2) if taps else None)

    @torch.inference_mode()
    def taps_only(self, ids: torch.Tensor, tap_layers: list[int]) -> torch.Tensor:
        """Taps ``[T, n, E]`` of one sequence ``ids`` ``[T]`` in one causal forward (no cache, no LM head)."""
        t = ids.shape[0]
        x = self.embed[ids][None]  # [1, T, E]
        cos, sin = self.cos[:t][None, None], self.sin[:t][None, None]  # [1, 1, T, D/2]
        taps = []
        for i, w in enumerate(self.layers[: max(tap_layers) + 1]):
            x = self._layer(w, x, cos, sin, _causal_attention)
            if i in tap_layers:
                taps.append(x[0])
        return torch.stack(taps, dim=1)  # [T, n, E]

    def _layer(self, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One decoder layer over ``x`` ``[B', T, E]`` (``cos``, ``sin`` broadcastable to
        ``[B', 1, T, D/2]``), whose attention is ``attend(q, k, v)``: q ``[B', H, T, D]`` and k, v
        ``[B', Hkv, T, D]`` of the new positions (RoPE applied) -> ``[B', H, T, D]``. Returns ``[B', T, E]``."""
        c = self.config
        b, t, _ = x.shape
        h, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = rms_norm(x, w["attn_norm"], c.rms_norm_eps) @ w["wqkv"].T  # [B', T, (H+2Hkv)D]
        q = apply_rope(qkv[..., : h * d].view(b, t, h, d).transpose(1, 2), cos, sin)  # [B', H, T, D]
        k = apply_rope(qkv[..., h * d: (h + hkv) * d].view(b, t, hkv, d).transpose(1, 2), cos, sin)
        v = qkv[..., (h + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)  # [B', Hkv, T, D]
        x = x + attend(q, k, v).transpose(1, 2).reshape(b, t, h * d) @ w["wo"].T
        gu = rms_norm(x, w["ffn_norm"], c.rms_norm_eps) @ w["w_gate_up"].T  # [B', T, 2F]
        g, u = gu.chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ w["w_down"].T  # [B', T, E]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of one sequence's positions among themselves (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
