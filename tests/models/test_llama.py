"""The numpy Llama forward pass: perplexity against an independent reference, path equalities
(chunked prefill, 1-token decode, 8-position verify), and a tiny random model against a naive
per-head implementation written independently in this file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from perplexity import llama_cpp_fixture, llama_perplexity, passage_as_llama_perplexity_reads_it

from flm_runtime.backends import decode, forward, prefill
from flm_runtime.loading.gguf import load_gguf
from flm_runtime.model_config import ModelConfig
from flm_runtime.models.causal_lm import CausalLM

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "wizard_of_oz_ch1.txt"
# Golden value: tests/reference/perplexity_transformers.py (Hugging Face transformers 5.24.0,
# torch 2.13.0 CPU, loading the same GGUF), run 2026-11-30: tokens=338, perplexity=20.2241.
REFERENCE_TOKENS = 338
REFERENCE_PERPLEXITY = 20.2241


def perplexity(model: CausalLM, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, in float64."""
    logits = forward(model, np.array(ids), model.new_cache(), all_logits=True).logits[:-1].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(np.exp(-logprobs[np.arange(len(ids) - 1), ids[1:]].mean()))


# The float32 path and the default (quantized) weights, whose bar is 1% of the float32 path's.
@pytest.mark.parametrize("model", ["smollm2_model", "smollm2_quantized"])
def test_perplexity_matches_transformers_reference(model, request, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PASSAGE.read_text())
    assert len(ids) == REFERENCE_TOKENS
    ppl = perplexity(request.getfixturevalue(model), ids)
    # The issue asks for 10%; we hold 1%: both sides compute in float32 from the same weights.
    assert abs(ppl / REFERENCE_PERPLEXITY - 1) < 0.01, ppl


def test_llama_perplexity_figure_matches_llama_cpps(smollm2_model, smollm2_tokenizer):
    """The way tests/models/perplexity.py computes llama.cpp's figure (chunks, scored halves),
    checked on a model both load: within 1% of llama-perplexity -c 128 on the same GGUF."""
    reference = llama_cpp_fixture("smollm2_135m_llama_cpp_perplexity.json")
    tok = smollm2_tokenizer
    ids = tok.encode(passage_as_llama_perplexity_reads_it())
    ppl, n_chunks = llama_perplexity(smollm2_model, ids, reference["n_ctx"], tok.bos_token_id if tok.add_bos else None)
    assert n_chunks == reference["chunks"]
    assert abs(ppl / reference["perplexity"] - 1) < 0.01, ppl


def test_wrong_rope_convention_fails_perplexity(smollm2_gguf, smollm2_tokenizer):
    """Keeping llama.cpp's interleaved-pair Q/K layout under our rotate-half RoPE breaks the model."""
    raw = load_gguf(smollm2_gguf, unpermute_qk=False)
    ppl = perplexity(CausalLM(raw.config, raw.weights), smollm2_tokenizer.encode(PASSAGE.read_text()))
    assert ppl > 2 * REFERENCE_PERPLEXITY, ppl


def test_prefill_decode_and_verify_paths_agree(smollm2_model, smollm2_tokenizer):
    """Chunked prefill, token-by-token decode and one 8-position forward give the same logits."""
    ids = np.array(smollm2_tokenizer.encode(PASSAGE.read_text())[:300])
    full = forward(smollm2_model, ids, smollm2_model.new_cache(), all_logits=True).logits  # [300, V]

    cache = smollm2_model.new_cache()
    last = prefill(smollm2_model, ids[:292], cache).logits  # two chunks of 256 and 36
    np.testing.assert_allclose(last, full[291], rtol=0, atol=2e-3)
    verify = forward(smollm2_model, ids[292:], cache, all_logits=True).logits  # the 8-position path
    np.testing.assert_allclose(verify, full[292:], rtol=0, atol=2e-3)

    cache.trim(292)  # roll back the 8 positions, then decode them one by one
    for j, token in enumerate(ids[292:]):
        np.testing.assert_allclose(decode(smollm2_model, int(token), cache).logits, full[292 + j], rtol=0, atol=2e-3)
    assert cache.length == 300
    assert np.array_equal(np.argmax(verify, axis=-1), np.argmax(full[292:], axis=-1))


TINY = ModelConfig(
    vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=300, rope_theta=500.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c, d = config, config.head_dim

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size, scale=1.0),
               "model.norm.weight": 1 + w(c.hidden_size), "lm_head.weight": w(c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + w(c.hidden_size),
            p + "post_attention_layernorm.weight": 1 + w(c.hidden_size),
            p + "self_attn.q_proj.weight": w(c.num_attention_heads * d, c.hidden_size),
            p + "self_attn.k_proj.weight": w(c.num_key_value_heads * d, c.hidden_size),
            p + "self_attn.v_proj.weight": w(c.num_key_value_heads * d, c.hidden_size),
            p + "self_attn.o_proj.weight": w(c.hidden_size, c.num_attention_heads * d),
            p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size),
        }
    return weights


def naive_forward(c: ModelConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Float64, position by position and head by head, straight from the Llama paper's equations."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, n = c.head_dim, len(ids)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x) + c.rms_norm_eps) * g

    def rope(vec, pos):
        out = vec.copy()
        for i in range(d // 2):
            angle = pos / c.rope_theta ** (2 * i / d)
            a, b = vec[i], vec[i + d // 2]
            out[i], out[i + d // 2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
        return out

    xs = [w["model.embed_tokens.weight"][t] for t in ids]
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        hs = [norm(x, w[p + "input_layernorm.weight"]) for x in xs]
        qs = [(w[p + "self_attn.q_proj.weight"] @ h).reshape(-1, d) for h in hs]
        ks = [(w[p + "self_attn.k_proj.weight"] @ h).reshape(-1, d) for h in hs]
        vs = [(w[p + "self_attn.v_proj.weight"] @ h).reshape(-1, d) for h in hs]
        new = []
        for t in range(n):
            heads = []
            for head in range(c.num_attention_heads):
                kv = head // c.n_rep
                q = rope(qs[t][head], t)
                scores = np.array([rope(ks[s][kv], s) @ q / np.sqrt(d) for s in range(t + 1)])
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                heads.append(sum(probs[s] * vs[s][kv] for s in range(t + 1)))
            x = xs[t] + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            g, u = w[p + "mlp.gate_proj.weight"] @ h, w[p + "mlp.up_proj.weight"] @ h
            new.append(x + w[p + "mlp.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u))
        xs = new
    return np.stack([w["lm_head.weight"] @ norm(x, w["model.norm.weight"]) for x in xs])


def test_tiny_model_matches_naive_reference():
    weights = tiny_weights(TINY)
    model = CausalLM(TINY, weights)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    expected = naive_forward(TINY, weights, ids)  # [12, V]

    got = forward(model, np.array(ids), model.new_cache(), all_logits=True).logits
    assert got.dtype == np.float32 and got.shape == (len(ids), TINY.vocab_size)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)

    model.prefill_chunk = 5  # chunks of 5, 5, 2 must give the same last logits
    cache = model.new_cache()
    np.testing.assert_allclose(prefill(model, np.array(ids), cache).logits, expected[-1], rtol=0, atol=1e-4)
    assert cache.length == len(ids)


def test_taps_are_the_residual_stream_after_the_layers():
    """Taps (the DFlash draft's context features), checked through the final norm and LM head:
    the last layer's tap gives the model's logits, layer 0's those of a 1-layer model."""
    from dataclasses import replace

    from flm_runtime.kernels.cpu import rms_norm

    weights = tiny_weights(TINY)
    model = CausalLM(TINY, weights)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26])
    e, eps = TINY.hidden_size, TINY.rms_norm_eps
    plain = forward(model, ids, model.new_cache(), all_logits=True).logits  # [12, V]
    out = forward(model, ids, model.new_cache(), all_logits=True, taps=(1, 0))
    np.testing.assert_array_equal(out.logits, plain)
    assert out.taps.dtype == np.float32 and out.taps.shape == (len(ids), 2 * e)
    np.testing.assert_allclose(rms_norm(out.taps[:, :e], model.norm, eps) @ model.lm_head.T, plain, rtol=0, atol=1e-5)
    one = CausalLM(replace(TINY, num_hidden_layers=1), weights)
    np.testing.assert_allclose(rms_norm(out.taps[:, e:], model.norm, eps) @ model.lm_head.T,
                               forward(one, ids, one.new_cache(), all_logits=True).logits, rtol=0, atol=1e-5)

    last = forward(model, ids, model.new_cache(), taps=(0,))  # last-position logits, every position's taps
    assert last.logits.shape == (1, TINY.vocab_size) and last.taps.shape == (len(ids), e)
    model.prefill_chunk = 5  # chunks of 5, 5, 2: taps of every prompt position
    pre = prefill(model, ids, model.new_cache(), taps=(1, 0))
    np.testing.assert_allclose(pre.taps, out.taps, rtol=0, atol=1e-5)
    np.testing.assert_allclose(pre.logits, plain[-1], rtol=0, atol=1e-5)


def test_batched_decode_rows_equal_single_decodes():
    """Sequences at different lengths (one empty) decoded in one ``forward_batch`` step of one
    row each give, row by row, the logits of their own 1-token decode, and each cache grows by
    exactly one position."""
    model = CausalLM(TINY, tiny_weights(TINY))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n) for n in (1, 7, 0, 23, 4)]
    tokens = [5, 17, 42, 95, 0]
    batch_caches, alone_caches, expected = [], [], []
    for prompt, token in zip(prompts, tokens):
        caches = model.new_cache(), model.new_cache()
        for cache in caches:
            if len(prompt):
                prefill(model, prompt, cache)
        batch_caches.append(caches[0])
        alone_caches.append(caches[1])
        expected.append(decode(model, token, caches[1]).logits)  # [V]
    got = model.forward_batch([[t] for t in tokens], batch_caches).logits
    assert got.dtype == np.float32 and got.shape == (len(tokens), TINY.vocab_size)
    np.testing.assert_allclose(got, np.stack(expected), rtol=0, atol=1e-5)
    for batched, alone in zip(batch_caches, alone_caches):
        assert batched.length == alone.length
        np.testing.assert_allclose(batched.keys(), alone.keys(), rtol=0, atol=1e-5)

    # a second batched step over a subset, in another order, still matches
    order = [3, 0, 4]
    got = model.forward_batch([[tokens[b] + 1] for b in order], [batch_caches[b] for b in order]).logits
    expected = [decode(model, tokens[b] + 1, alone_caches[b]).logits for b in order]
    np.testing.assert_allclose(got, np.stack(expected), rtol=0, atol=1e-5)


def test_forward_batch_mixes_prefill_chunks_and_decode_rows():
    """One ``forward_batch`` of a middle prompt chunk (no logits), a last prompt chunk (its last
    row's logits), a decode row and a verify block (all its rows' logits) gives each sequence's
    selected rows and every row's taps as its own ``forward``; each cache grows by its rows."""
    model = CausalLM(TINY, tiny_weights(TINY))
    rng = np.random.default_rng(2)
    held = [0, 9, 5, 3]                                   # prompt tokens already in each cache
    new = [rng.integers(0, TINY.vocab_size, n) for n in (6, 4, 1, 3)]
    logit_rows = [0, 1, 1, 3]
    caches = [[model.new_cache(), model.new_cache()] for _ in held]
    for n, pair in zip(held, caches):
        if n:
            history = rng.integers(0, TINY.vocab_size, n)
            for cache in pair:
                forward(model, history, cache)
    out = model.forward_batch(new, [pair[0] for pair in caches], taps=(0, 1), logit_rows=logit_rows)
    alone = [forward(model, ids, pair[1], all_logits=True, taps=(0, 1)) for ids, pair in zip(new, caches)]
    want_logits = np.concatenate([o.logits[len(o.logits) - n:] for o, n in zip(alone, logit_rows)])
    assert out.logits.shape == (sum(logit_rows), TINY.vocab_size)
    np.testing.assert_allclose(out.logits, want_logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.taps, np.concatenate([o.taps for o in alone]), rtol=0, atol=1e-5)
    assert [pair[0].length for pair in caches] == [n + len(ids) for n, ids in zip(held, new)]


def test_missing_and_misshapen_tensors_are_named():
    from flm_runtime.errors import ModelFormatError

    weights = tiny_weights(TINY)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelFormatError, match="model.layers.1.mlp.up_proj.weight"):
        CausalLM(TINY, weights)
    weights = tiny_weights(TINY)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    with pytest.raises(ModelFormatError, match=r"model.norm.weight.*\(47,\).*\(48,\)"):
        CausalLM(TINY, weights)
