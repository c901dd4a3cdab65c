"""Recompute preemption on the embedded default model: in a pool too small for every running
sequence, the youngest are preempted as the others grow, recompute their context when admitted
again, and every request ends with the tokens and logprobs it has alone, bit for bit (quantized
weights: a row's results do not depend on the rows beside it or on the blocks holding its
context), with the prefix cache on (a preempted sequence takes its own blocks back) or off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.engine import Engine

STORY = (Path(__file__).parents[1] / "data" / "wizard_of_oz_ch1.txt").read_text()
PARAMS = [SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
          SamplingParams(max_tokens=90, temperature=0.8, seed=3, ignore_eos=True, logprobs=True),
          SamplingParams(max_tokens=90, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True, logprobs=True)]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    return [np.array(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Go on with this story:\n" + part}],
                                                        add_generation_prompt=True)))
            for part in (STORY[:300], STORY[300:600], STORY[600:900])]


@pytest.fixture(scope="module")
def alone(smollm2_quantized, smollm2_tokenizer, prompts):
    engine = Engine(smollm2_quantized, smollm2_tokenizer, name="alone", prefix_cache=False)
    try:
        return [engine.submit(p, params).result() for p, params in zip(prompts, PARAMS)]
    finally:
        engine.close()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_pool_too_small_preempts_and_every_request_gets_its_output_alone(smollm2_quantized, smollm2_tokenizer,
                                                                             prompts, alone, prefix_cache):
    block_bytes = 64 * 2 * 30 * 3 * 64 * 2  # 64 positions of 30 layers' float16 K and V, 3 heads of 64
    engine = Engine(smollm2_quantized, smollm2_tokenizer, name="small", kv_budget=6 * block_bytes,
                    prefix_cache=prefix_cache)
    try:
        assert engine.stats()["kv_blocks"] == 6  # each request grows to 3 blocks: two fit at once
        with engine.held():
            handles = [engine.submit(p, params) for p, params in zip(prompts, PARAMS)]
        got = [h.result(timeout=300) for h in handles]
        for g, a in zip(got, alone):
            assert (g.token_ids, g.logprobs, g.finish_reason) == (a.token_ids, a.logprobs, a.finish_reason)
        stats = engine.stats()
        assert stats["preempted"] >= 1 and stats["finished"] == 3 and stats["kv_blocks_used"] == 0
        assert [g.stats.cached_tokens for g in got] == [0, 0, 0]  # counted at first admission only
    finally:
        engine.close()

