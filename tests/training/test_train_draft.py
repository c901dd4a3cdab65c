"""The torch draft (flm_train.draft) against the numpy draft that serves it (flm_runtime.models.dflash),
on random weights of a tiny geometry: same logits for the same block, through the file format.

Also: the training forward (many anchors in one pass, blocks isolated by the attention mask) equals
one block at a time, and the exported float16 file loads back to the same tensors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [train] extra) is not installed; CI leaves it out, see README")

from flm_runtime.models.dflash import DFlashConfig, read_weights
from flm_runtime.models.dflash import DFlashDraft as NumpyDraft
from flm_train.draft import DFlashDraft
from flm_train.export import write_draft

V, E, T = 101, 64, 23  # vocabulary, hidden size, context positions


def tiny_draft(layers: int = 2, seed: int = 0, draft_vocab: torch.Tensor | None = None) -> DFlashDraft:
    torch.manual_seed(seed)
    c = DFlashConfig(hidden_size=E, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, rope_theta=10000.0, num_hidden_layers=layers, target_layer_ids=(1, 3, 5),
                     block_size=8, mask_token_id=7, max_position_embeddings=256,
                     draft_vocab_size=0 if draft_vocab is None else len(draft_vocab))
    embed = torch.randn(V, E)
    draft = DFlashDraft(c, embed, embed, draft_vocab)  # tied, like SmolLM2
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # norms away from 1, linears away from init scale
    return draft


def numpy_twin(draft: DFlashDraft, tmp_path) -> NumpyDraft:
    out = write_draft(tmp_path / "draft", draft.c, draft.export_state(), target="tiny:test", target_sha256=None,
                      training={"note": "random"})
    config = DFlashConfig.from_dict(json.loads((out / "config.json").read_text()))
    embed = draft.embed.numpy()
    return NumpyDraft(config, read_weights(out / "model.safetensors"), embed=embed, lm_head=embed,
                      max_positions=draft.c.max_position_embeddings)


@pytest.mark.parametrize("layers, draft_vocab", [(1, None), (2, None), (1, torch.tensor([2, 7, 11, 42, 60, 99]))])
def test_torch_and_numpy_drafts_give_the_same_logits(tmp_path, layers, draft_vocab):
    draft = tiny_draft(layers, draft_vocab=draft_vocab)
    # The file is float16: round the torch side's weights the same way before comparing.
    draft.load_export_state({k: v.half().float() for k, v in draft.export_state().items()})
    twin = numpy_twin(draft, tmp_path)
    rng = np.random.default_rng(1)
    taps = rng.standard_normal((T, 3 * E)).astype(np.float32)  # [T, n*E]
    for start in (0, 5, T):
        cache = twin.new_cache()
        twin.add_context(cache, taps[:start], 0)
        want = twin.draft_logits(cache, anchor_id=42, start=start)  # [7, Vd]
        got = draft.block_logits(torch.from_numpy(taps[:start]), 42, start)[1:].detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert (draft.draft_vocab[got.argmax(-1)].numpy() == twin.draft_block(cache, 42, start)).all()


def test_many_anchors_in_one_pass_equal_one_block_at_a_time():
    draft = tiny_draft(2)
    taps = torch.randn(2, T, 3 * E)
    tokens = torch.randint(0, V, (2, T))
    anchors = torch.tensor([[3, 4, 15], [0, 9, 20]])  # overlapping blocks must not see each other
    together = draft.hidden(taps, tokens, anchors)  # [2, 3, 8, E]
    for b in range(2):
        for m in range(3):
            a = int(anchors[b, m])
            alone = draft.hidden(taps[b:b + 1, :a], tokens[b:b + 1, : a + 1], anchors[b:b + 1, m:m + 1])
            torch.testing.assert_close(together[b, m], alone[0, 0], rtol=1e-5, atol=1e-5)


def test_export_roundtrip_float16(tmp_path):
    draft = tiny_draft(1)
    out = write_draft(tmp_path / "d", draft.c, draft.export_state(), target="tiny:test", target_sha256=None,
                      training={})
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "dflash-llama" and config["target_layer_ids"] == [1, 3, 5]
    assert DFlashConfig.from_dict(config) == draft.c
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    back = read_weights(out / "model.safetensors")
    for k, v in draft.export_state().items():
        np.testing.assert_allclose(back[k], v.numpy(), rtol=1e-3, atol=1e-3)


def test_tap_scale_is_folded_into_fc_at_export(tmp_path):
    draft = tiny_draft(1)
    draft.set_tap_scale(torch.rand(3 * E) * 100 + 0.5)
    taps = torch.randn(T, 3 * E) * 50
    want = draft.block_logits(taps, 42, T)[1:].detach().numpy()
    twin = numpy_twin(draft, tmp_path)  # float16 file: compare loosely
    cache = twin.new_cache()
    twin.add_context(cache, taps.numpy(), 0)
    got = twin.draft_logits(cache, anchor_id=42, start=T)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    again = DFlashDraft(draft.c, draft.embed, draft.lm_head)  # fresh weights, same target parts
    scale = torch.rand(3 * E) * 10 + 0.5
    again.set_tap_scale(scale)  # a warm start keeps its own preconditioning
    again.load_export_state(draft.export_state())
    torch.testing.assert_close(again.tap_scale, 1 / scale)
    torch.testing.assert_close(again.block_logits(taps, 42, T), draft.block_logits(taps, 42, T), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("start", [0, 9])
def test_the_torch_draft_layer_equals_the_runtime_layer(start):
    """One torch ``DraftLayer`` and the runtime's decoder layer (``layers.decoder``, non-causal, its
    context K/V in the cache) on the same weights and inputs: the same block states within
    float32 rounding, so the training's layer cannot drift from the one serving runs."""
    from flm_runtime.families.checkpoint import WeightTaker
    from flm_runtime.families.llama import KV_PROJ, fuse_layer, take_fused
    from flm_runtime.kernels import cpu
    from flm_runtime.kv_cache import KVCache
    from flm_runtime.layers.decoder import DecoderLayer, RowSpan, rope_heads
    from flm_runtime.layers.spec import LayerSpec
    from flm_train.draft import DraftLayer

    c = tiny_draft(1).c
    torch.manual_seed(3)
    layer = DraftLayer(c)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    weights = {f"{'self_attn' if n[0] in 'qkvo' else 'mlp'}.{n}.weight": getattr(layer, n).weight.detach().numpy()
               for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    weights |= {f"{n}.weight": getattr(layer, n).detach().numpy() for n in ("input_layernorm", "post_attention_layernorm")}
    rng = np.random.default_rng(4)
    ctx = rng.standard_normal((start, E)).astype(np.float32)  # the fused context features [T, E]
    x = rng.standard_normal((c.block_size, E)).astype(np.float32)  # the block [B, E]
    cos, sin = cpu.rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta)

    mask = torch.ones(1, 1, c.block_size, start + c.block_size, dtype=torch.bool)  # the context and the whole block
    block_rope = (torch.from_numpy(cos[start:start + c.block_size])[None, None],
                  torch.from_numpy(sin[start:start + c.block_size])[None, None])
    ctx_rope = torch.from_numpy(cos[:start])[None, None], torch.from_numpy(sin[:start])[None, None]
    with torch.no_grad():
        want = layer(torch.from_numpy(x)[None], torch.from_numpy(ctx)[None], block_rope, ctx_rope, mask)[0].numpy()

    take = WeightTaker(weights)
    decoder = DecoderLayer(fuse_layer(take, c, ""), LayerSpec.of(c, causal=False))
    cache = KVCache.private(1, c.num_key_value_heads, c.head_dim, c.max_position_embeddings)
    hkv, d = c.num_key_value_heads, c.head_dim
    cache.reserve(start)
    kv = cpu.linear(ctx, take_fused(take, c, "", KV_PROJ))  # the context's K/V, as DFlashDraft.add_context
    cache.write(0, rope_heads(kv, cos[:start], sin[:start], 0, hkv, d).transpose(1, 0, 2),
                kv[:, hkv * d:].reshape(start, hkv, d).transpose(1, 0, 2))
    cache.commit(start)
    cache.reserve(c.block_size)
    got = decoder(0, x, [RowSpan(cache, start, slice(0, c.block_size), 0)], cos[start:start + c.block_size],
                  sin[start:start + c.block_size])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
