"""The batched torch target (flm_train.target) against the numpy LlamaModel it stands in for.

Tiny random model: logits and taps of every path (prefill of one slot, batched decode of all slots,
one causal forward) against numpy. SmolLM2-135M: logits allclose and the same greedy tokens as the
numpy model on a few chat prompts, so the self-distilled responses are the target's own.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flm_train", reason="flm_train (the training/ directory) is not installed")

from flm_runtime.backends import decode, forward, prefill
from flm_runtime.core import LlamaConfig
from flm_runtime.models.llama import LlamaModel
from flm_train.generate import TOP_K, generate_shard
from flm_train.target import TorchLlama, default_tap_layers

TAPS = [0, 2, 3]


def tiny_weights(c: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    hq, hkv = c.num_attention_heads * d, c.num_key_value_heads * d
    w = {"model.embed_tokens.weight": rng.standard_normal((c.vocab_size, e)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(e)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, shape in [("input_layernorm", (e,)), ("post_attention_layernorm", (e,))]:
            w[p + name + ".weight"] = 1 + 0.1 * rng.standard_normal(shape)
        for name, shape in [("self_attn.q_proj", (hq, e)), ("self_attn.k_proj", (hkv, e)), ("self_attn.v_proj", (hkv, e)),
                            ("self_attn.o_proj", (e, hq)), ("mlp.gate_proj", (f, e)), ("mlp.up_proj", (f, e)),
                            ("mlp.down_proj", (e, f))]:
            w[p + name + ".weight"] = 0.15 * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.fixture(scope="module")
def tiny():
    c = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
                    num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True)
    w = tiny_weights(c)
    return LlamaModel(c, w), TorchLlama(c, w)


def numpy_taps(model: LlamaModel, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits ``[T, V]`` and taps ``[T, n, E]`` of one causal numpy forward."""
    out = forward(model, np.array(ids), model.new_cache(), all_logits=True, taps=tuple(TAPS))
    return out.logits, out.taps.reshape(len(ids), len(TAPS), -1)


def test_prefill_decode_and_taps_match_numpy(tiny):
    np_model, t_model = tiny
    ids = [5, 17, 3, 88, 42, 9, 60, 1, 33]
    want_logits, want_taps = numpy_taps(np_model, ids)
    cache = t_model.new_cache(3, 32)
    logits, taps = t_model.forward(torch.tensor([ids[:6]]), torch.arange(6)[None], cache, 2, TAPS, all_logits=True)
    np.testing.assert_allclose(logits[0].numpy(), want_logits[:6], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(taps[0].numpy(), want_taps[:6], rtol=1e-4, atol=1e-4)
    for p in range(6, len(ids)):  # decode in slot 2 while slots 0 and 1 run dummies
        step_ids = torch.tensor([[0], [0], [ids[p]]])
        step_pos = torch.tensor([[0], [0], [p]])
        logits, taps = t_model.forward(step_ids, step_pos, cache, None, TAPS)
        np.testing.assert_allclose(logits[2, 0].numpy(), want_logits[p], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(taps[2, 0].numpy(), want_taps[p], rtol=1e-4, atol=1e-4)
    whole = t_model.taps_only(torch.tensor(ids), TAPS)
    np.testing.assert_allclose(whole.numpy(), want_taps, rtol=1e-4, atol=1e-4)


def test_continuous_batching_greedy_equals_numpy_one_at_a_time(tiny):
    np_model, t_model = tiny
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [40], [50, 51], [60, 61, 62, 63]]
    shard = generate_shard(t_model, [(i, p, True) for i, p in enumerate(prompts)], tap_layers=TAPS, max_new=12,
                           slots=2, seed=0)
    for i, p in enumerate(prompts):
        start, end = shard["offsets"][i], shard["offsets"][i + 1]
        seq = shard["tokens"][start:end].tolist()
        cache, out, steps = np_model.new_cache(), list(p), []
        logits = prefill(np_model, np.array(p), cache).logits
        while len(out) - len(p) < 12:
            steps.append(logits)
            out.append(int(np.argmax(logits)))
            if out[-1] in (0, 2):
                break
            logits = decode(np_model, out[-1], cache).logits
        assert seq == out, i
        _, want_taps = numpy_taps(np_model, seq[:-1])
        got = shard["taps"][start: end - 1].astype(np.float32)
        np.testing.assert_allclose(got, want_taps.reshape(len(seq) - 1, -1), rtol=2e-3, atol=2e-3)  # float16
        # The top-k rows: filled from the last prompt position on (each step's logits), -inf elsewhere.
        logp = np.stack(steps) - np.log(np.exp(np.stack(steps)).sum(-1, keepdims=True))  # [steps, V]
        want_ids = np.argsort(-logp, axis=-1, kind="stable")[:, :TOP_K]
        rows = slice(start + len(p) - 1, end - 1)
        assert shard["top_ids"][rows].tolist() == want_ids.tolist()
        np.testing.assert_allclose(shard["top_logprobs"][rows].astype(np.float32),
                                   np.take_along_axis(logp, want_ids, -1), rtol=2e-3, atol=2e-3)
        unfilled = np.r_[start: start + len(p) - 1, end - 1]
        assert np.all(shard["top_logprobs"][unfilled] == -np.inf) and not shard["top_ids"][unfilled].any()


def test_decode_attention_equals_masked_sdpa_per_slot():
    """The decode kernel against torch's attention with K/V repeated per query head, slots at
    different positions (0 included), over a cache longer than any of them."""
    from flm_train.target import decode_attention

    g = torch.Generator().manual_seed(0)
    b, h, hkv, cap, d = 5, 6, 2, 40, 16
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = torch.randn(b, hkv, cap, d, generator=g), torch.randn(b, hkv, cap, d, generator=g)
    pos = torch.tensor([0, 7, 39, 12, 1])
    got = decode_attention(q, k, v, pos)
    for s in range(b):
        n = int(pos[s]) + 1
        want = torch.nn.functional.scaled_dot_product_attention(
            q[s:s + 1], k[s:s + 1, :, :n].repeat_interleave(h // hkv, 1), v[s:s + 1, :, :n].repeat_interleave(h // hkv, 1))
        np.testing.assert_allclose(got[s].numpy(), want[0].numpy(), rtol=1e-5, atol=1e-6)


def test_default_taps_for_30_layers():
    assert default_tap_layers(30) == [1, 8, 14, 20, 27]


def test_smollm2_torch_target_equals_numpy(smollm2_gguf, smollm2_model, smollm2_tokenizer):
    from flm_runtime.loading import load_model_files

    bundle = load_model_files(smollm2_gguf)
    t_model = TorchLlama(bundle.config, bundle.weights)
    tok = smollm2_tokenizer
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "Explain what a prime number is."]
    items = [(i, tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])), True)
             for i, p in enumerate(prompts)]
    shard = generate_shard(t_model, items, tap_layers=default_tap_layers(30), max_new=16, slots=2, seed=0)
    for i, (_, ids, _) in enumerate(items):
        seq = shard["tokens"][shard["offsets"][i]: shard["offsets"][i + 1]].tolist()
        want = forward(smollm2_model, np.array(seq[:-1]), smollm2_model.new_cache(), all_logits=True).logits  # [T, V]
        cache = t_model.new_cache(1, len(seq))
        got, _ = t_model.forward(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None], cache, 0, all_logits=True)
        np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-3, atol=2e-3)
        assert seq[len(ids):] == want[len(ids) - 1:].argmax(-1).tolist()  # numpy's greedy continuation
