"""Engine, detokenizer and stop checker on the embedded SmolLM2-135M (real tokenizer, real caches).

Uses the shared fixtures of tests/conftest.py (``smollm2_engine`` is the process-wide engine).
Kept short: a decode step costs tens of milliseconds on the shared CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flm_runtime.backends import decode, prefill
from flm_runtime.request import SamplingParams
from flm_runtime.text.detokenizer import Detokenizer

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "wizard_of_oz_ch1.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


@pytest.fixture
def engine(smollm2_engine):
    """The process-wide SmolLM2 engine, checked idle before and after each test."""
    assert smollm2_engine.stats()["kv_tokens"] == 0
    yield smollm2_engine
    assert smollm2_engine.stats()["active"] == 0


def _greedy_reference(model, prompt_ids, n):
    """Hand-rolled greedy loop straight on the model (independent of the engine)."""
    cache = model.new_cache(len(prompt_ids) + n)
    logits = prefill(model, np.asarray(prompt_ids, dtype=np.int64), cache).logits
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = decode(model, out[-1], cache).logits
    return out


def test_real_tokenizer_detokenizer_matches_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "你好，世界! 안녕하세요 😀🎉 👨\u200d👩\u200d👧 naïve café <|im_end|> done"
    ids = tok.encode(text)
    partial = [i for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "the sample should split some character across tokens"
    detok = Detokenizer(tok.token_bytes, skip_ids=tok.special_token_ids)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text.replace("<|im_end|>", "")


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_greedy_engine_equals_hand_rolled_loop(engine, smollm2_model, smollm2_tokenizer):
    model, tok = smollm2_model, smollm2_tokenizer
    ids = tok.encode(PROMPTS[0])
    done = engine.submit(ids, SamplingParams(max_tokens=8, ignore_eos=True)).result()
    assert list(done.token_ids) == _greedy_reference(model, ids, 8)
    assert done.text == tok.decode(done.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4),
                                    SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=3, max_tokens=4)],
                         ids=["greedy", "seeded"])
def test_four_concurrent_requests_equal_each_alone(engine, smollm2_tokenizer, params):
    tok = smollm2_tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    alone = [engine.submit(p, params).result() for p in prompts]
    handles = [engine.submit(p, params) for p in prompts]
    together = [h.result() for h in handles]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.text for c in together] == [c.text for c in alone]
    assert engine.stats()["kv_tokens"] == 0


def test_eight_batched_requests_equal_each_alone(engine, smollm2_tokenizer, monkeypatch):
    """Isolation (docs/design.md, "Contract", 6) under continuous batching: 8 concurrent requests of
    mixed prompt lengths and budgets, greedy ones beside ones sampling with other seeds, give the
    tokens each gives alone; and they did share forward passes: prompt chunks of several requests in
    one pass (chunked prefill, 256 prompt tokens per pass), and all 8 decode rows in one pass."""
    tok = smollm2_tokenizer
    passage = tok.encode(PASSAGE.read_text())
    prompts = [tok.encode(p) for p in PROMPTS] + [passage[:40], passage[100:220], [passage[7]], passage[:300]]
    params = [SamplingParams(max_tokens=16 + 2 * (i % 4), ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=10 + i, max_tokens=20, ignore_eos=True)
              for i in range(8)]
    alone = [engine.submit(p, q).result().token_ids for p, q in zip(prompts, params)]

    passes = []  # per forward_batch call, the row count of each sequence
    forward_batch = engine.model.forward_batch
    monkeypatch.setattr(engine.model, "forward_batch",
                        lambda rows, caches, **kw: passes.append([len(r) for r in rows]) or forward_batch(rows, caches, **kw))
    with engine.held():  # hold the engine thread back until all 8 are queued
        handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
    together = [h.result().token_ids for h in handles]
    assert sum(r > 1 for r in passes[0]) >= 3, passes[0]    # several prompts' chunks in the first pass
    assert all(sum(p) - p.count(1) <= 256 for p in passes)  # the prefill budget (1-row parts are decode rows, or 1-token chunks)
    assert max(len(p) for p in passes) == 8
    assert together == alone
    assert [len(t) for t in together] == [q.max_tokens for q in params]


def test_stop_string_cut_on_real_output(engine, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(PROMPTS[2])
    full = engine.submit(ids, SamplingParams(max_tokens=12, ignore_eos=True)).result()
    words = full.text.split()
    assert len(words) >= 4, full.text
    stop = words[2][1:] if len(words[2]) > 1 else words[2]     # likely starts inside a token
    handle = engine.submit(ids, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    events = list(handle)
    done = handle.result()
    cut = full.text.find(stop)
    assert done.text == full.text[:cut] == "".join(e.text for e in events)
    assert done.finish_reason == "stop"
    assert full.token_ids[: done.completion_tokens] == done.token_ids
    # Delivered = the tokens up to the one holding the last delivered character (stop.py).
    n = next(n for n in range(len(full.token_ids) + 1) if len(tok.decode(full.token_ids[:n])) >= len(done.text))
    assert done.completion_tokens == n and tok.decode(done.token_ids).startswith(done.text)
