"""The quantized cpu path (default weights: ``kernels/quant.py``, ``qgemm.py``, ``layers/stack.py``)
against the float32 reference (its perplexity is in tests/models/test_llama.py): the batch
invariance that makes greedy DFlash equal plain decoding bit for bit (a row's logits are the same
bits alone, in a verify pass, or beside other sequences), agreement, and loading under a memory
limit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_llama import PASSAGE, TINY, tiny_weights

from flm_runtime.backends import forward
from flm_runtime.kernels import quant
from flm_runtime.models.causal_lm import CausalLM


def _rows_alone_in_a_pass_and_in_a_batch(model, ids, rows=8):
    """Logits of ``rows`` positions (after a 40-token prefix): decoded one at a time, as one verify
    pass of ``rows`` rows (a block of 8 or 16), and as the last ``rows`` of a batched step beside 8
    rows of another sequence."""
    prefix, block, other = ids[:40], ids[40:40 + rows], ids[:25]
    cache = model.new_cache()
    forward(model, prefix, cache)
    alone = np.stack([forward(model, ids[40 + j:41 + j], cache).logits[0] for j in range(rows)])
    cache.trim(40)
    verify = forward(model, block, cache, all_logits=True).logits
    cache.trim(40)
    neighbour = model.new_cache()
    forward(model, other[:17], neighbour)
    batched = model.forward_batch([other[17:25], block], [neighbour, cache]).logits[8:]
    return alone, verify, batched


@pytest.mark.parametrize("rows", [8, 16])
def test_smollm2_rows_are_batch_invariant(smollm2_quantized, smollm2_tokenizer, rows):
    ids = np.array(smollm2_tokenizer.encode(PASSAGE.read_text()))
    alone, verify, batched = _rows_alone_in_a_pass_and_in_a_batch(smollm2_quantized, ids, rows)
    assert np.array_equal(alone, verify) and np.array_equal(alone, batched)


# TINY's widths made multiples of 32 (quantizable); 96 is not a multiple of 64: a padded chunk.
TINY_Q = dataclasses.replace(TINY, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16)


@pytest.mark.parametrize("rows", [8, 16])
def test_tiny_model_is_batch_invariant_and_near_float32(rows):
    weights = tiny_weights(TINY_Q)
    f32 = CausalLM(TINY_Q, weights)
    q8 = CausalLM(TINY_Q, {k: quant.quantize(v, 8) if v.ndim == 2 and v.shape[1] % 32 == 0 else v
                             for k, v in weights.items()})
    assert q8.quantized and q8.stack is not None
    ids = np.random.default_rng(1).integers(0, TINY_Q.vocab_size, 60)
    alone, verify, batched = _rows_alone_in_a_pass_and_in_a_batch(q8, ids, rows)
    assert np.array_equal(alone, verify) and np.array_equal(alone, batched)
    # float32: the skinny kernel (8 rows) or BLAS (16) against 1-row passes, to float32 rounding
    f32_alone, *f32_passes = _rows_alone_in_a_pass_and_in_a_batch(f32, ids, rows)
    for got in f32_passes:
        np.testing.assert_allclose(got, f32_alone, rtol=0, atol=1e-5)
    want = forward(f32, ids, f32.new_cache(), all_logits=True).logits
    got = forward(q8, ids, q8.new_cache(), all_logits=True).logits
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.mean() > 0.999 and cos.min() > 0.99, (cos.mean(), cos.min())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95


def test_quantized_layers_with_a_float32_head_run_as_a_stack_and_the_head_outside_it():
    """A real file's head and first layer products share their input width, so they are quantized
    alike; a model built with quantized layers and a float32 head stacks its layers without a head
    and runs the float32 head (not copied) on the stack's final norm rows: near the model whose
    head is quantized, and not batch invariant (float32 products round by row count)."""
    weights = tiny_weights(TINY_Q)
    q8 = CausalLM(TINY_Q, {k: quant.quantize(v, 8) if v.ndim == 2 else v for k, v in weights.items()})
    float_head = CausalLM(TINY_Q, {k: quant.quantize(v, 8) if v.ndim == 2 and k != "lm_head.weight" else v
                                   for k, v in weights.items()})
    assert float_head.stack is not None and float_head.stack.vocab is None and float_head.quantized
    assert float_head.lm_head is weights["lm_head.weight"] and not float_head.batch_invariant
    ids = np.random.default_rng(2).integers(0, TINY_Q.vocab_size, 30)
    got = forward(float_head, ids, float_head.new_cache(), all_logits=True).logits
    want = forward(q8, ids, q8.new_cache(), all_logits=True).logits
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert got.shape == (30, TINY_Q.vocab_size) and cos.min() > 0.999, cos.min()


GIB = 1 << 30


def test_a_gguf_too_big_for_float32_loads_quantized(tmp_path):
    """A 4-bit GGUF whose float32 weights (1.5 GiB) exceed the process's data limit (0.9 GiB above
    its data size after imports) loads with the default weights, in a child process under that limit."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    hidden, ffn, layers = 2048, 8192, 6  # 6 x 67M parameters
    path = tmp_path / "big.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 64, "embedding_length": hidden, "feed_forward_length": ffn,
                       "block_count": layers, "attention.head_count": 16, "attention.head_count_kv": 16,
                       "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": 64}.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    block = quantize(rng.standard_normal((ffn, hidden)).astype(np.float32) * 0.02, GGMLQuantizationType.Q4_0)

    def matrix(rows, cols):  # the same quantized bytes, cut to shape: content does not matter here
        raw = block[: rows * cols // hidden] if cols == hidden else quantize(
            rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, GGMLQuantizationType.Q4_0)
        return raw.reshape(rows, -1)

    writer.add_tensor("token_embd.weight", matrix(64, hidden), raw_dtype=GGMLQuantizationType.Q4_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    down = matrix(hidden, ffn)
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden))):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape), raw_dtype=GGMLQuantizationType.Q4_0)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", down, raw_dtype=GGMLQuantizationType.Q4_0)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = 64 * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn)
    assert params * 4 > 1.3 * GIB

    child = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        from flm_runtime.loading.gguf import load_gguf
        from flm_runtime.models.causal_lm import CausalLM
        # RLIMIT_DATA counts the data segment and private mappings: VmData, not the RSS.
        used = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + int(0.9 * {GIB}), resource.RLIM_INFINITY))
        try:
            model = load_gguf(sys.argv[1], weights=sys.argv[2])
            CausalLM(model.config, model.weights)
        except MemoryError:
            print("MemoryError")
        else:
            print("loaded")
    """)
    run = lambda kind: subprocess.run([sys.executable, "-c", child, str(path), kind], capture_output=True,  # noqa: E731
                                      text=True, timeout=600).stdout.strip().splitlines()[-1:]
    assert run("auto") == ["loaded"]
    assert run("f32") == ["MemoryError"]  # the limit is real: the float32 path does not fit under it


def test_agreement_of_the_quantized_verify_pass_with_float32_decoding(smollm2_quantized, smollm2_model,
                                                                      smollm2_tokenizer):
    """``litellm-flm agreement``'s measure on one window of the test passage: the default weights'
    8-position verify against float32 token-by-token decoding (the reference benchmark: 97.9% same top-1)."""
    from flm_bench.agreement import teacher_forced

    ids = np.array(smollm2_tokenizer.encode(PASSAGE.read_text()))
    a = teacher_forced(smollm2_quantized, ids, 200, 128, 8, reference=smollm2_model)
    assert a.positions == 128
    assert a.same_top1_pct >= 98 and a.mean_cosine > 0.999, (a.same_top1_pct, a.mean_cosine)
    assert a.same_top1 < a.positions or a.max_abs_diff > 0  # a real comparison of two weight kinds
