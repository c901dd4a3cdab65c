"""Self-distillation data through the serving runtime (flm_train.generate), on SmolLM2-135M with
its served (quantized) weights: a shard's responses are the runtime engine's own (greedy, and
sampled with the same seed), its taps and top-k are those of one causal forward of each whole
sequence, and an interrupted run resumes with only the missing shards. No torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flm_runtime.request import SamplingParams
from flm_runtime.sampling.sampler import FALLBACK_SAMPLING
from flm_runtime.scheduling.engine import Engine

from flm_train import generate
from flm_train.generate import (STOP_IDS, TOP_K, check_taps, default_tap_layers, generate_shard, prompt_seed,
                                run_generation, top_logprobs)

LAYERS = default_tap_layers(30)
SAMPLING = FALLBACK_SAMPLING.resolve()
SEED = 3
MAX_NEW = 24
PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about rain.",
           "Explain what a prime number is.", "Name three colours."]


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def items(smollm2_tokenizer) -> list[tuple[int, list[int], bool]]:
    """Prompt ids 8..11, the last one sampled (every 4th id, as `run_generation` picks them at 0.75 greedy)."""
    return [(8 + i, chat_ids(smollm2_tokenizer, p), i != 3) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def shard(smollm2_quantized, items) -> dict[str, np.ndarray]:
    """Two slots for four prompts (a slot refilled while the other decodes), prompts prefilled in
    chunks of 16 beside the other slot's decoding."""
    return generate_shard(smollm2_quantized, items, tap_layers=LAYERS, max_new=MAX_NEW, slots=2, seed=SEED,
                          sampling=SAMPLING, prefill_tokens=16)


def sequences(shard: dict[str, np.ndarray]):
    """(index, row slice, prompt length, tokens) of each sequence of ``shard``."""
    for i, n in enumerate(shard["prompt_lens"]):
        s, e = int(shard["offsets"][i]), int(shard["offsets"][i + 1])
        yield i, slice(s, e), int(n), shard["tokens"][s:e].tolist()


def test_responses_are_the_engines_greedy_and_seeded_sampled_ones(shard, items, smollm2_quantized, smollm2_tokenizer):
    engine = Engine(smollm2_quantized, smollm2_tokenizer, name="generate-test")
    try:
        for i, _, n, seq in sequences(shard):
            pid, ids, greedy = items[i]
            assert seq[:n] == ids and shard["prompt_ids"][i] == pid and shard["greedy"][i] == greedy
            params = (SamplingParams(max_tokens=MAX_NEW) if greedy
                      else dataclasses.replace(SAMPLING, max_tokens=MAX_NEW, seed=prompt_seed(SEED, pid)))
            done = engine.submit(ids, params).result()
            response = seq[n:]
            if done.finish_reason == "stop":  # the engine does not deliver the end-of-turn token
                assert response[:-1] == list(done.token_ids) and response[-1] in STOP_IDS, i
            else:
                assert response == list(done.token_ids) and len(response) == MAX_NEW, i
    finally:
        engine.close()
    assert any(seq[-1] in STOP_IDS for *_, seq in sequences(shard))  # one response ended early


def test_taps_and_top_k_equal_one_causal_forward(shard, smollm2_quantized):
    for i, rows, n, seq in sequences(shard):
        ref = smollm2_quantized.forward_batch([np.array(seq[:-1])], [smollm2_quantized.new_cache(len(seq))],
                                              taps=tuple(LAYERS))  # logits and taps of every row
        taps = shard["taps"][rows]
        assert np.array_equal(taps[:-1], ref.taps.astype(np.float16)) and not taps[-1].any(), i
        z = ref.logits[n - 1:].astype(np.float64)  # [response, V]: from the last prompt position on
        logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        want = np.argsort(-ref.logits[n - 1:], axis=-1, kind="stable")[:, :TOP_K]
        assert shard["top_ids"][rows][n - 1:-1].tolist() == want.tolist(), i
        np.testing.assert_allclose(shard["top_logprobs"][rows][n - 1:-1].astype(np.float32),
                                   np.take_along_axis(logp, want, -1), rtol=1e-3, atol=1e-3)  # float16
        unfilled = np.r_[0:n - 1, len(seq) - 1]
        assert np.all(shard["top_logprobs"][rows][unfilled] == -np.inf) and not shard["top_ids"][rows][unfilled].any()
    record = check_taps(smollm2_quantized, shard, LAYERS)
    assert record["sequences"] == 4 and record["max_diff_float16_ulps"] <= 0.5
    bad = dict(shard, taps=shard["taps"].copy())
    bad["taps"][5, 7] = np.nextafter(np.nextafter(bad["taps"][5, 7], np.float16(np.inf)), np.float16(np.inf))
    assert 1.5 <= check_taps(smollm2_quantized, bad, LAYERS, n_seq=1)["max_diff_float16_ulps"] <= 2.5


def test_without_taps_the_shard_is_the_same_less_its_taps(shard, items, smollm2_quantized):
    lean = generate_shard(smollm2_quantized, items, tap_layers=LAYERS, max_new=MAX_NEW, slots=3, seed=SEED,
                          sampling=SAMPLING, with_taps=False)
    assert sorted(lean) == sorted(set(shard) - {"taps"})
    assert all(np.array_equal(lean[k], shard[k]) for k in lean)


def test_top_logprobs_order_ties_like_a_stable_sort():
    rng = np.random.default_rng(0)
    z = np.round(rng.normal(0, 2, (5, 300)), 1).astype(np.float32)  # many equal values
    z[1, :] = 0.0  # a row of ties only
    ids, logp = top_logprobs(z)
    assert ids.tolist() == np.argsort(-z, axis=-1, kind="stable")[:, :TOP_K].tolist()
    zz = z.astype(np.float64)
    want = zz - np.log(np.exp(zz).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(want, ids.astype(np.int64), -1), rtol=1e-6, atol=1e-5)


def test_a_rerun_generates_only_the_missing_shards(tmp_path, shard, smollm2_quantized, smollm2_tokenizer, monkeypatch):
    prompts = [{"id": 8 + i, "prompt": p} for i, p in enumerate(PROMPTS)]
    shards = {0: prompts[:2], 1: prompts[2:]}
    kw = dict(tap_layers=LAYERS, max_new=MAX_NEW, slots=2, seed=SEED, sampling=SAMPLING, greedy_fraction=0.75)
    run_generation(smollm2_quantized, smollm2_tokenizer, shards, tmp_path, **kw)
    first = [dict(np.load(tmp_path / f"shard_{k:04d}.npz")) for k in (0, 1)]
    for k, part in enumerate(first):  # the sequences of `shard`
        rows = slice(shard["offsets"][2 * k], shard["offsets"][2 * k + 2])
        assert part["tokens"].tolist() == shard["tokens"][rows].tolist()
        assert part["greedy"].tolist() == shard["greedy"][2 * k: 2 * k + 2].tolist()
    kept = (tmp_path / "shard_0000.npz").stat()
    (tmp_path / "shard_0001.npz").unlink()  # as if killed before shard 1 was written ...
    (tmp_path / "shard_0001.tmp.npz").write_bytes(b"half a shard")  # ... while writing it
    ran = []
    stream = generate.generate_stream
    monkeypatch.setattr(generate, "generate_stream", lambda model, items, **a: (ran.extend(items), stream(model, items, **a))[1])
    run_generation(smollm2_quantized, smollm2_tokenizer, shards, tmp_path, **kw)
    assert [pid for pid, _, _ in ran] == [10, 11]
    again = np.load(tmp_path / "shard_0001.npz")
    assert sorted(again.files) == sorted(first[1]) and all(np.array_equal(again[k], first[1][k]) for k in again.files)
    now = (tmp_path / "shard_0000.npz").stat()
    assert (now.st_ino, now.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    assert len((tmp_path / "shards.jsonl").read_text().splitlines()) == 3


def test_default_taps_for_30_layers():
    assert default_tap_layers(30) == [1, 8, 14, 20, 27]
