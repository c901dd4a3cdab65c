"""The DFlash draft in torch, exactly as docs/dflash.md specifies it (the numpy runtime serves it).

Axis legend: B sequences, T context positions, M blocks (anchors) per sequence, K block size (8),
E hidden size, H query heads, Hkv key/value heads, D head dim, V vocabulary, n taps.

Training runs many blocks of a sequence in one pass: every block attends to the context features
at positions strictly before its anchor and to its own K positions (bidirectionally), never to
another block; the attention mask encodes that, so M blocks cost one forward.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flm_runtime.models.dflash import DFlashConfig
from torch import nn


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


class DraftLayer(nn.Module):
    """One Llama decoder layer whose keys/values also cover the injected context features."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        e, h, hkv, d, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(e))
        self.post_attention_layernorm = nn.Parameter(torch.ones(e))
        self.q_proj = nn.Linear(e, h * d, bias=False)
        self.k_proj = nn.Linear(e, hkv * d, bias=False)
        self.v_proj = nn.Linear(e, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, e, bias=False)
        self.gate_proj = nn.Linear(e, f, bias=False)
        self.up_proj = nn.Linear(e, f, bias=False)
        self.down_proj = nn.Linear(f, e, bias=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple, rope_ctx: tuple,
                mask: torch.Tensor) -> torch.Tensor:
        """x ``[B, MK, E]`` block states; ctx ``[B, T, E]`` fused context; mask ``[B, 1, MK, T+MK]`` (True = attend)."""
        c = self.c
        b, q_len, _ = x.shape
        t = ctx.shape[1]
        h_, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hs = rms_norm(x, self.input_layernorm, c.rms_norm_eps)  # [B, MK, E]
        q = apply_rope(self.q_proj(hs).view(b, q_len, h_, d).transpose(1, 2), *rope_q)  # [B, H, MK, D]
        k_blk = apply_rope(self.k_proj(hs).view(b, q_len, hkv, d).transpose(1, 2), *rope_q)  # [B, Hkv, MK, D]
        k_ctx = apply_rope(self.k_proj(ctx).view(b, t, hkv, d).transpose(1, 2), *rope_ctx)  # [B, Hkv, T, D]
        v_blk = self.v_proj(hs).view(b, q_len, hkv, d).transpose(1, 2)
        v_ctx = self.v_proj(ctx).view(b, t, hkv, d).transpose(1, 2)
        k = torch.cat([k_ctx, k_blk], dim=2)  # [B, Hkv, T+MK, D]
        v = torch.cat([v_ctx, v_blk], dim=2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, H, MK, D]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, q_len, h_ * d))
        h2 = rms_norm(x, self.post_attention_layernorm, c.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h2)) * self.up_proj(h2))


class DFlashDraft(nn.Module):
    """Draft parameters (``fc``, ``hidden_norm``, ``mask_embedding``, ``layers``, ``norm``) plus the
    target's frozen embedding and LM head (buffers, not saved with the draft).

    Args:
        c: the draft's configuration.
        embed: ``[V, E]`` float32 target embedding; lm_head: ``[V, E]`` (the same tensor when tied).
        draft_vocab: ``[Vd]`` int64 target token ids the draft can propose (docs/dflash.md, "Draft
            vocabulary"), ``Vd == c.draft_vocab_size``; None with ``draft_vocab_size == 0`` (all ``V``).
            Saved with the draft (a persistent buffer), so a resumed run keeps the same one.
    """

    def __init__(self, c: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 draft_vocab: torch.Tensor | None = None):
        super().__init__()
        e, n = c.hidden_size, len(c.target_layer_ids)
        self.c = c
        self.fc = nn.Linear(n * e, e, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(e))
        self.mask_embedding = nn.Parameter(embed[c.mask_token_id].clone())
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = nn.Parameter(torch.ones(e))
        # Training-time preconditioning of the taps (see ``set_tap_scale``); folded into fc at export.
        self.register_buffer("tap_scale", torch.ones(n * e))
        self.register_buffer("embed", embed, persistent=False)
        if c.draft_vocab_size:
            assert draft_vocab is not None and draft_vocab.shape == (c.draft_vocab_size,), "draft_vocab != [Vd]"
        else:
            assert draft_vocab is None, "a draft vocabulary needs draft_vocab_size"
            draft_vocab = torch.arange(lm_head.shape[0])
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=bool(c.draft_vocab_size))  # [Vd]
        head = lm_head[self.draft_vocab] if c.draft_vocab_size else lm_head  # [Vd, E] the draft's rows
        self.register_buffer("lm_head", head, persistent=False)
        to_draft = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
        to_draft[self.draft_vocab] = torch.arange(self.draft_vocab.shape[0])
        self.register_buffer("to_draft", to_draft, persistent=False)  # [V] target id -> draft index or -1
        cos, sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._head_bf16: torch.Tensor | None = None

    # -- file names of docs/dflash.md -----------------------------------------------------------

    def set_tap_scale(self, tap_rms: torch.Tensor) -> None:
        """Train on ``taps / tap_rms`` (per column ``[n*E]``), exported as ``fc.weight / tap_rms``.

        The target's residual stream has a few "massive" dimensions (RMS ~1500 where the median is
        ~5 in SmolLM2's later layers): unscaled, they dominate ``taps @ fc^T`` and Adam's equal
        per-weight steps move the output mostly along them. Dividing by the per-column RMS is an
        exact reparametrisation: ``(taps / s) @ fc^T == taps @ (fc / s)^T``.
        """
        with torch.no_grad():
            self.tap_scale.copy_(1.0 / tap_rms.clamp(min=1e-3))

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The live parameters under their file-format names (docs/dflash.md, "Files");
        ``fc.weight`` without the tap scale."""
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm,
               "mask_embedding": self.mask_embedding, "norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for n in "qkvo":
                out[p + f"self_attn.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
            for n in ("gate", "up", "down"):
                out[p + f"mlp.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
        return out

    def export_state(self) -> dict[str, torch.Tensor]:
        """The draft's tensors under the file-format names (float32, contiguous; tap scale folded in),
        plus ``draft_vocab`` (int64) when the draft has its own vocabulary."""
        out = self.file_tensors()
        out["fc.weight"] = self.fc.weight * self.tap_scale[None, :]
        out = {k: v.detach().float().contiguous() for k, v in out.items()}
        if self.c.draft_vocab_size:
            out["draft_vocab"] = self.draft_vocab.clone()
        return out

    def load_export_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``export_state``'s tensors (a draft file's), keeping this draft's tap scale: ``fc``
        becomes the file's ``fc.weight / tap_scale``, so the draft computes what the file does and
        a warm start from a shipped draft trains with the same preconditioning as a fresh one.

        Raises:
            AssertionError: a different draft vocabulary, tensor names or shapes.
        """
        own = self.file_tensors()
        state = dict(state)
        if self.c.draft_vocab_size:
            assert torch.equal(state.pop("draft_vocab").long(), self.draft_vocab), "a different draft vocabulary"
        assert set(own) == set(state), f"tensor names differ: {set(own) ^ set(state)}"
        with torch.no_grad():
            for k, v in state.items():
                assert own[k].shape == v.shape, f"{k}: {tuple(v.shape)} != {tuple(own[k].shape)}"
                own[k].copy_(v.float())
            self.fc.weight.div_(self.tap_scale[None, :])  # the file's fc has the scale folded in

    # -- forward --------------------------------------------------------------------------------

    def hidden(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Final-normed block states.

        Args:
            taps: ``[B, T, n*E]`` context taps (positions 0..T-1); tokens: ``[B, >=T]`` the sequence's
                ids; anchors: ``[B, M]`` anchor positions (>= 1; the block's first position).
        Returns:
            ``[B, M, K, E]``: block index k of block m predicts the token at ``anchors[:, m] + k``.
        """
        c, kk = self.c, self.c.block_size
        b, t, _ = taps.shape
        m = anchors.shape[1]
        ctx = rms_norm(self.fc(taps * self.tap_scale), self.hidden_norm, c.rms_norm_eps)  # [B, T, E]
        first = self.embed[torch.gather(tokens, 1, anchors)]  # [B, M, E]
        x = torch.cat([first[:, :, None], self.mask_embedding.expand(b, m, kk - 1, -1)], dim=2)  # [B, M, K, E]
        x = x.reshape(b, m * kk, -1)  # [B, MK, E]
        qpos = (anchors[:, :, None] + torch.arange(kk)).reshape(b, m * kk)  # [B, MK]
        rope_q = (self.cos[qpos][:, None], self.sin[qpos][:, None])  # [B, 1, MK, D/2]
        rope_ctx = (self.cos[:t][None, None], self.sin[:t][None, None])  # [1, 1, T, D/2]
        blk_anchor = anchors.repeat_interleave(kk, dim=1)  # [B, MK]
        to_ctx = torch.arange(t)[None, None, :] < blk_anchor[:, :, None]  # [B, MK, T] strictly before
        blk_id = torch.arange(m).repeat_interleave(kk)  # [MK]
        to_blk = (blk_id[:, None] == blk_id[None, :]).expand(b, -1, -1)  # [B, MK, MK] own block only
        mask = torch.cat([to_ctx, to_blk], dim=2)[:, None]  # [B, 1, MK, T+MK]
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_ctx, mask)
        return rms_norm(x, self.norm, c.rms_norm_eps).view(b, m, kk, -1)

    def logits(self, h: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """``h`` ``[..., E]`` -> float32 logits ``[..., Vd]`` over the draft vocabulary, with the
        target's frozen LM head rows (bf16 matmul if asked)."""
        if not bf16:
            return h @ self.lm_head.T
        if self._head_bf16 is None:
            self._head_bf16 = self.lm_head.to(torch.bfloat16)
        return (h.to(torch.bfloat16) @ self._head_bf16.T).float()

    def block_logits(self, taps: torch.Tensor, anchor_token: int, start: int) -> torch.Tensor:
        """Serving semantics for one block: context ``taps`` ``[start, n*E]``, anchor at ``start``.

        Returns ``[K, Vd]`` float32 logits over the draft vocabulary (rows 1..K-1 give the drafted
        tokens ``draft_vocab[argmax]``).
        """
        assert taps.shape[0] == start
        tokens = torch.zeros(1, start + 1, dtype=torch.long)
        tokens[0, start] = anchor_token
        h = self.hidden(taps[None].float(), tokens, torch.tensor([[start]]))  # [1, 1, K, E]
        return self.logits(h[0, 0])
