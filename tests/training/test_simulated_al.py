"""The training's held-out AL (``flm_train.train.simulated_al``) is the AL the serving runtime reports:
the shipped draft serves a chat prompt greedily (numpy engine, whole blocks, no policy, no prompt lookup), and the
torch draft, given the same sequence and the target's taps over it as a training shard, counts the
same speculative steps and the same AL on the serving schedule.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [train] extra) is not installed; CI leaves it out, see README")

from flm_runtime import paths
from flm_runtime.backends import prefill_chunks
from flm_runtime.models.dflash import DFlashDraft as NumpyDraft
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.engine import Engine
from flm_runtime.speculation.speculative import SpeculativeDecoder
from flm_train.draft import DFlashDraft
from flm_train.export import read_draft
from flm_train.train import Shards, simulated_al

SHIPPED = paths.package_dir() / "drafts" / "smollm2-135m-dflash"
CHAT = "Explain how a refrigerator keeps food cold, step by step."
MAX_TOKENS = 96


def test_simulated_al_counts_the_served_steps(tmp_path, smollm2_model, smollm2_tokenizer):
    model, tok = smollm2_model, smollm2_tokenizer
    draft = NumpyDraft.load(SHIPPED, model)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True))
    engine = Engine(model, tok, name="test-sim-al", speculative=SpeculativeDecoder(model, draft, ngram=False))
    try:
        served = engine.submit(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)).result()
    finally:
        engine.close()
    assert served.finish_reason == "length" and len(served.token_ids) == MAX_TOKENS

    tokens = np.array([*prompt, *served.token_ids], dtype=np.int64)
    cache = model.new_cache(len(tokens))
    taps = np.concatenate([out.taps for out in prefill_chunks(model, tokens, cache,
                                                                   taps=draft.config.target_layer_ids)])
    np.savez(tmp_path / "shard_0000.npz", tokens=tokens.astype(np.int32), offsets=np.array([0, len(tokens)]),
             prompt_lens=np.array([len(prompt)], np.int32), prompt_ids=np.zeros(1, np.int32),
             greedy=np.ones(1, bool), taps=taps.astype(np.float32))
    data = Shards([tmp_path / "shard_0000.npz"])
    config, state, _ = read_draft(SHIPPED)
    embed = torch.from_numpy(model.embed)
    twin = DFlashDraft(config, embed, embed, state["draft_vocab"])
    twin.load_export_state(state)

    got = simulated_al(twin, data, data.seqs)
    assert got["steps"] == served.stats.spec.steps
    assert got["sim_al"] == pytest.approx(served.stats.spec.acceptance_length, abs=1e-9)
    assert got["sim_al"] == pytest.approx((MAX_TOKENS - 1) / got["steps"])  # the first token is the prefill's
    assert got["blocks"] == -(-(MAX_TOKENS - 1) // 8)  # anchors at response tokens 0, 8, .., 88
