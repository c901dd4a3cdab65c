"""The DFlash draft (``models/dflash.py``): against a naive float64 implementation written
independently here from docs/dflash.md, its cache (context added in pieces, block scratch never
committed), the 8-bit draft of a quantized target (batch invariant, near the float32 draft, on the
kernel team), loading a draft directory (float16, shared target arrays) and refusing drafts that do
not fit the target."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dflash_files import draft_config_dict, random_draft_weights, tap_layers, write_draft_dir
from test_llama import TINY, tiny_weights
from test_quantized import TINY_Q

from flm_runtime.backends import forward
from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import quant
from flm_runtime.kernels.team import Team, default_team
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.models.dflash import DFlashConfig, DFlashDraft, read_config


def naive_draft_logits(cfg: dict, w: dict, embed: np.ndarray, lm_head: np.ndarray, taps: np.ndarray,
                       anchor: int, start: int, masks: int = 7) -> np.ndarray:
    """Rows 1..masks of a block of the anchor and ``masks`` masks, float64, position by position
    and head by head (docs/dflash.md)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, h, eps, theta = cfg["head_dim"], cfg["num_attention_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
    rep = h // cfg["num_key_value_heads"]

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x) + eps) * g

    def rope(vec, pos):
        out = vec.copy()
        for i in range(d // 2):
            angle = pos / theta ** (2 * i / d)
            a, b = vec[i], vec[i + d // 2]
            out[i], out[i + d // 2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
        return out

    context = [norm(w["fc.weight"] @ taps[p].astype(np.float64), w["hidden_norm.weight"]) for p in range(start)]
    xs = [embed[anchor].astype(np.float64)] + [w["mask_embedding"]] * masks
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        wq, wk, wv = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        hs = [norm(x, w[p + "input_layernorm.weight"]) for x in xs]
        sources = [(c, pos) for pos, c in enumerate(context)] + [(hb, start + b) for b, hb in enumerate(hs)]
        keys = [np.stack([rope(k, pos) for k in (wk @ s).reshape(-1, d)]) for s, pos in sources]  # [Hkv, D] each
        values = [(wv @ s).reshape(-1, d) for s, _ in sources]
        new = []
        for b in range(len(xs)):
            q = (wq @ hs[b]).reshape(-1, d)
            heads = []
            for head in range(h):
                qr = rope(q[head], start + b)
                scores = np.array([k[head // rep] @ qr / np.sqrt(d) for k in keys])  # all keys: no mask
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                heads.append(sum(pr * v[head // rep] for pr, v in zip(probs, values)))
            x = xs[b] + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h2 = norm(x, w[p + "post_attention_layernorm.weight"])
            g, u = w[p + "mlp.gate_proj.weight"] @ h2, w[p + "mlp.up_proj.weight"] @ h2
            new.append(x + w[p + "mlp.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u))
        xs = new
    return np.stack([lm_head.astype(np.float64) @ norm(x, w["norm.weight"]) for x in xs[1:]])


@pytest.fixture(scope="module")
def tiny_target() -> CausalLM:
    return CausalLM(TINY, tiny_weights(TINY))


def tiny_draft(target: CausalLM, layers: int = 2, seed: int = 1) -> tuple[dict, dict, DFlashDraft]:
    cfg = draft_config_dict(TINY, layers=layers, taps=[1, 0], mask_token_id=5)
    weights = random_draft_weights(cfg, seed=seed, scale=0.3)
    draft = DFlashDraft(DFlashConfig.from_dict(cfg), weights, embed=target.embed, lm_head=target.lm_head,
                        max_positions=TINY.max_position_embeddings)
    return cfg, weights, draft


def test_draft_matches_naive_reference(tiny_target):
    cfg, weights, draft = tiny_draft(tiny_target)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 53, 58])
    taps = forward(tiny_target, ids, tiny_target.new_cache(), taps=(1, 0)).taps  # [14, 2E]
    cache = draft.new_cache()
    draft.add_context(cache, taps[:6], 0)  # context added in two pieces, as decoding does
    draft.add_context(cache, taps[6:10], 6)
    expected = naive_draft_logits(cfg, weights, tiny_target.embed, tiny_target.lm_head, taps, int(ids[10]), 10)
    got = draft.draft_logits(cache, int(ids[10]), 10)
    assert got.dtype == np.float32 and got.shape == (7, TINY.vocab_size)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    assert np.array_equal(draft.draft_block(cache, int(ids[10]), 10), np.argmax(expected, axis=-1))
    # K = 3: a block of the anchor and 3 masks, which drafts otherwise than the whole block.
    cut = naive_draft_logits(cfg, weights, tiny_target.embed, tiny_target.lm_head, taps, int(ids[10]), 10, masks=3)
    np.testing.assert_allclose(draft.draft_logits_batch([cache], [int(ids[10])], 3)[0], cut, rtol=0, atol=1e-4)
    assert np.abs(cut - expected[:3]).max() > 1e-2

    # The block's K/V are scratch: drafting again, or adding context over them, sees no trace.
    np.testing.assert_allclose(draft.draft_logits(cache, int(ids[10]), 10), got, rtol=0, atol=1e-6)
    assert cache.length == 10
    draft.add_context(cache, taps[10:13], 10)
    expected = naive_draft_logits(cfg, weights, tiny_target.embed, tiny_target.lm_head, taps, int(ids[13]), 13)
    np.testing.assert_allclose(draft.draft_logits(cache, int(ids[13]), 13), expected, rtol=0, atol=1e-4)


def test_batched_blocks_equal_one_at_a_time(tiny_target):
    """``draft_logits_batch`` / ``draft_blocks`` over sequences of different context lengths (one
    of them empty) equal each sequence's own block, and leave every cache's length as it was; a
    proposal's confidence is the softmax probability of each drafted token."""
    _, _, draft = tiny_draft(tiny_target)
    rng = np.random.default_rng(3)
    caches, anchors = [], []
    for n in (9, 0, 4):
        ids = rng.integers(0, TINY.vocab_size, n + 1)
        cache = draft.new_cache()
        if n:
            draft.add_context(cache, forward(tiny_target, ids[:n], tiny_target.new_cache(), taps=(1, 0)).taps, 0)
        caches.append(cache)
        anchors.append(int(ids[n]))
    got = draft.draft_logits_batch(caches, anchors)  # [3, 7, V]
    assert got.shape == (3, 7, TINY.vocab_size) and [c.length for c in caches] == [9, 0, 4]
    for s, (cache, anchor) in enumerate(zip(caches, anchors)):  # float32 rounding: the batch runs other kernels
        np.testing.assert_allclose(got[s], draft.draft_logits(cache, anchor, cache.length), rtol=2e-5, atol=2e-5)
    proposal = draft.draft_blocks(caches, anchors)
    np.testing.assert_array_equal(proposal.ids, np.argmax(got, axis=-1))
    probs = np.exp(got - got.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(proposal.confidence, (probs / probs.sum(axis=-1, keepdims=True)).max(axis=-1), rtol=1e-5)
    # K < 7: the block cut to the anchor and K masks.
    first3 = draft.draft_logits_batch(caches, anchors, n_drafts=3)
    assert first3.shape == (3, 3, TINY.vocab_size) and [c.length for c in caches] == [9, 0, 4]
    for s, (cache, anchor) in enumerate(zip(caches, anchors)):
        np.testing.assert_allclose(first3[s], draft.draft_logits_batch([cache], [anchor], 3)[0], rtol=2e-5, atol=2e-5)
    first1 = draft.draft_blocks(caches, anchors, 1)
    np.testing.assert_array_equal(first1.ids, np.argmax(draft.draft_logits_batch(caches, anchors, 1), axis=-1))


def test_draft_with_empty_context(tiny_target):
    """At position 0 the block attends only to itself."""
    cfg, weights, draft = tiny_draft(tiny_target, layers=1, seed=2)
    expected = naive_draft_logits(cfg, weights, tiny_target.embed, tiny_target.lm_head,
                                  np.zeros((0, 2 * TINY.hidden_size)), 7, 0)
    np.testing.assert_allclose(draft.draft_logits(draft.new_cache(), 7, 0), expected, rtol=0, atol=1e-4)


def test_draft_vocabulary_scores_only_its_rows(tiny_target, tmp_path):
    """A draft vocabulary (docs/dflash.md): the logits are the full ones at those columns, and the
    proposals are the best of those tokens, as target ids."""
    vocab = np.array([0, 3, 5, 17, 40, 41, 90, 96], dtype=np.int64)
    cfg = draft_config_dict(TINY, layers=1, taps=[1, 0], mask_token_id=5, draft_vocab_size=len(vocab))
    weights = random_draft_weights(cfg, seed=4, scale=0.3) | {"draft_vocab": vocab}
    draft = DFlashDraft.load(write_draft_dir(tmp_path / "d", cfg, weights), tiny_target)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    taps = forward(tiny_target, ids, tiny_target.new_cache(), taps=(1, 0)).taps  # [10, 2E]
    cache = draft.new_cache()
    draft.add_context(cache, taps[:9], 0)
    stored = {k: v.astype(np.float16).astype(np.float32) for k, v in weights.items() if k != "draft_vocab"}
    full = naive_draft_logits(cfg, stored, tiny_target.embed, tiny_target.lm_head, taps, int(ids[9]), 9)  # [7, V]
    got = draft.draft_logits(cache, int(ids[9]), 9)
    assert got.shape == (7, len(vocab))
    np.testing.assert_allclose(got, full[:, vocab], rtol=0, atol=1e-4)
    proposed = draft.draft_block(cache, int(ids[9]), 9)
    np.testing.assert_array_equal(proposed, vocab[np.argmax(full[:, vocab], axis=-1)])
    assert not np.array_equal(proposed, np.argmax(full, axis=-1))  # the restriction mattered here


@pytest.mark.parametrize("vocab, message", [
    (np.array([3, 1, 5, 7]), "ascending distinct"),
    (np.array([1, 3, 5, 97]), r"ascending distinct token ids in \[0, 97\)"),
    (np.array([1.0, 3.0, 5.0, 7.0], dtype=np.float32), "expected integer"),
    (None, "'draft_vocab' is missing"),
])
def test_load_refuses_a_bad_draft_vocabulary(tiny_target, tmp_path, vocab, message):
    cfg = draft_config_dict(TINY, taps=[0, 1], draft_vocab_size=4)
    weights = random_draft_weights(cfg) | ({} if vocab is None else {"draft_vocab": vocab})
    with pytest.raises(ModelFormatError, match=message):
        DFlashDraft.load(write_draft_dir(tmp_path / "d", cfg, weights, dtype=np.float32), tiny_target)


def test_tap_layers_formula_matches_the_contract():
    assert tap_layers(30, 5) == [1, 8, 14, 20, 27]  # docs/dflash.md's example for SmolLM2's 30 layers


def test_config_ignores_unknown_keys_and_names_problems():
    cfg = DFlashConfig.from_dict(draft_config_dict(TINY, taps=[0, 1], something_new=True))
    assert cfg.target_layer_ids == (0, 1) and cfg.n_taps == 2 and cfg.n_draft == 7
    with pytest.raises(ValueError, match="architecture"):
        DFlashConfig.from_dict(draft_config_dict(TINY, architecture="eagle3"))
    no_mask = draft_config_dict(TINY)
    del no_mask["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(no_mask)


@pytest.mark.parametrize("key, value, why", [
    ("block_size", "eight", "key 'block_size' is 'eight', expected an integer"),
    ("block_size", 8.0, "key 'block_size' is 8.0, expected an integer"),
    ("num_hidden_layers", True, "key 'num_hidden_layers' is True, expected an integer"),
    ("target_layer_ids", 3, "key 'target_layer_ids' is 3, expected a list of integers"),
    ("target_layer_ids", ["1", 2], "key 'target_layer_ids' is ['1', 2], expected a list of integers"),
    ("rope_theta", "1e4", "key 'rope_theta' is '1e4', expected a number"),
    ("hidden_size", {"value": 64}, "key 'hidden_size' is {'value': 64}, expected an integer"),
    ("architecture", ["dflash-llama"], "key 'architecture' is ['dflash-llama'], expected a string"),
    ("training", "notes", "key 'training' is 'notes', expected an object"),
])
def test_a_config_value_of_the_wrong_type_is_a_format_error_naming_the_key(tmp_path, key, value, why):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(draft_config_dict(TINY, **{key: value})))
    with pytest.raises(ModelFormatError) as info:
        read_config(path)
    assert str(info.value) == f"{path}: {why}"


def test_an_8_bit_draft_is_batch_invariant_and_near_the_float32_draft(tmp_path, monkeypatch):
    """The draft of a quantized target runs 8-bit layers as one compiled step on the kernel team,
    over float16 caches: a block's logits are the same bits alone or beside other sequences, and
    close to the float32 draft's."""
    weights = tiny_weights(TINY_Q)
    target = CausalLM(TINY_Q, {k: quant.quantize(v, 8) if v.ndim == 2 else v for k, v in weights.items()})
    cfg = draft_config_dict(TINY_Q, layers=2, taps=[1, 0], mask_token_id=5)
    draft_weights = random_draft_weights(cfg, seed=4, scale=0.3)
    q8 = DFlashDraft.load(write_draft_dir(tmp_path / "d", cfg, draft_weights, dtype=np.float32), target)
    f32 = DFlashDraft(DFlashConfig.from_dict(cfg), draft_weights, embed=target.embed, lm_head=target.lm_head,
                      max_positions=TINY_Q.max_position_embeddings)
    assert q8.quantized and q8.kv_dtype == np.float16 and q8.new_cache().pool.dtype == np.float16
    assert not f32.quantized and f32.new_cache().pool.dtype == np.float32
    blocks, taps = {}, {}
    for name, draft in (("q8", q8), ("f32", f32)):
        caches, anchors = [], []
        for n in (30, 12):
            ids = np.random.default_rng(n).integers(0, TINY_Q.vocab_size, n + 1)
            cache = draft.new_cache()
            taps[n] = forward(target, ids[:n], target.new_cache(), taps=(1, 0)).taps
            draft.add_context(cache, taps[n], 0)
            caches.append(cache)
            anchors.append(int(ids[n]))
        batched = draft.draft_logits_batch(caches, anchors)  # [2, 7, V]
        alone = np.stack([draft.draft_logits(c, a, c.length) for c, a in zip(caches, anchors)])
        blocks[name] = (batched, alone)
    assert np.array_equal(*blocks["q8"])  # bit for bit
    got, want = blocks["q8"][1].reshape(14, -1), blocks["f32"][1].reshape(14, -1)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.mean() > 0.998 and cos.min() > 0.99, (cos.mean(), cos.min())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 12 / 14

    # The 8-bit draft runs on the kernel team the target's steps run on (one set of threads for
    # all the compiled work): each context product a step, then the block's layers as one step
    # and the head's product.
    team, steps = default_team(), []
    monkeypatch.setattr(team, "run", lambda fn, *args: (steps.append(fn), Team.run(team, fn, *args))[1])
    cache = q8.new_cache()
    q8.add_context(cache, taps[12], 0)
    assert len(steps) == 3 and q8.stack._step not in steps  # fc, then each layer's context K/V
    q8.draft_blocks([cache], [3])
    assert len(steps) == 5 and steps[3] is q8.stack._step and steps[4] is not q8.stack._step


def test_load_float16_dir_shares_the_target_arrays(tiny_target, tmp_path):
    cfg = draft_config_dict(TINY, taps=[0, 1])
    weights = random_draft_weights(cfg)
    draft = DFlashDraft.load(write_draft_dir(tmp_path / "d", cfg, weights, dtype=np.float16), tiny_target)
    assert draft.embed is tiny_target.embed and draft.head is tiny_target.lm_head  # shared, not copied
    assert draft.vocab is None
    assert draft.fc.dtype == np.float32
    np.testing.assert_array_equal(draft.fc, weights["fc.weight"].astype(np.float16).astype(np.float32))
    assert draft.config.target_layer_ids == (0, 1)


@pytest.mark.parametrize("change, message", [
    ({"intermediate_size": 81}, "intermediate_size is 81"),
    ({"rope_theta": 10000.0}, "rope_theta"),
    ({"target_layer_ids": [0, 2]}, "target_layer_ids"),
    ({"mask_token_id": 97}, "mask_token_id"),
    ({"target_sha256": "ab" * 32}, "sha256"),
])
def test_load_refuses_a_draft_that_does_not_fit(tiny_target, tmp_path, change, message):
    cfg = draft_config_dict(TINY, taps=[0, 1]) | change
    path = write_draft_dir(tmp_path / "d", cfg, random_draft_weights(cfg))
    with pytest.raises(ModelFormatError, match=message):
        DFlashDraft.load(path, tiny_target, target_sha256="cd" * 32)


def test_load_names_missing_and_unexpected_tensors(tiny_target, tmp_path):
    cfg = draft_config_dict(TINY, taps=[0, 1])
    weights = random_draft_weights(cfg)
    del weights["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ModelFormatError, match="layers.0.mlp.up_proj.weight"):
        DFlashDraft.load(write_draft_dir(tmp_path / "a", cfg, weights), tiny_target)
    weights = {f"model.{k}": v for k, v in random_draft_weights(cfg).items()}
    with pytest.raises(ModelFormatError, match="unexpected tensors.*model.fc.weight"):
        DFlashDraft.load(write_draft_dir(tmp_path / "b", cfg, weights), tiny_target)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg)[:-3])
    with pytest.raises(ModelFormatError, match="not a JSON file"):
        DFlashDraft.load(tmp_path / "c", tiny_target)
