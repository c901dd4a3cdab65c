"""Stand-ins for the speculative tests: a scripted target, tiny random targets and drafts, replaying
proposers, and a hand-driven speculative generation loop.

``ScriptTarget`` predicts ``script[i]`` as output token ``i`` whatever it is fed (one-hot logits
of 10.0; EOS after the script), or gives ``rows[i]`` as its logits, and writes each fed token id
into its KV cache, so a test can read back what the cache holds after rollbacks. Its taps are
zeros.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from engine_fakes import EOS, FAKE_BLOCK

from flm_runtime.backends import decode, prefill
from flm_runtime.kv_cache import KVCache, KVPool
from flm_runtime.loading.safetensors_loader import load_hf_dir
from flm_runtime.model_config import ModelConfig
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.models.dflash import DFlashConfig, DFlashDraft
from flm_runtime.outputs import ForwardOutput
from flm_runtime.sampling import sampler
from flm_runtime.sampling.picker import Picker
from flm_runtime.scheduling.step import Lane
from flm_runtime.speculation.speculative import SpeculativeDecoder

# The tiny-model and draft-file helpers live beside the model tests (tests/models).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dflash_files import draft_config_dict, random_draft_weights, write_draft_dir  # noqa: E402, F401


class ScriptTarget:
    """Target whose output token ``i`` (at position ``prompt_len + i``) is ``script[i]``, or whose
    logits there are ``rows[i]`` (``[N, vocab]``) where given."""

    prefill_chunk = 256
    kv_dtype = np.float32
    batch_invariant = False  # ``TargetModel``'s: no prefix caching unless a test turns it on

    def __init__(self, script: list[int], prompt_len: int, vocab: int = 300, context: int = 2048,
                 rows: np.ndarray | None = None):
        self.config = ModelConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context)
        rng = np.random.default_rng(0)
        self.embed = rng.standard_normal((vocab, 8)).astype(np.float32)  # [V, E]
        self.lm_head = rng.standard_normal((vocab, 8)).astype(np.float32)
        self.script, self.prompt_len, self.rows = list(script), prompt_len, rows

    def new_pool(self, positions: int) -> KVPool:
        return KVPool(1, 1, 1, np.float32, positions // FAKE_BLOCK, FAKE_BLOCK)

    def new_cache(self, capacity: int = 0, pool: KVPool | None = None) -> KVCache:
        if pool is not None:
            return KVCache(pool, self.config.max_position_embeddings)
        return KVCache.private(1, 1, 1, self.config.max_position_embeddings, capacity, block_tokens=FAKE_BLOCK)

    def fed(self, cache: KVCache) -> list[int]:
        """The token ids the cache holds, positions ``0 .. length-1``."""
        return cache.keys(0)[0, :, 0].astype(int).tolist()

    def forward_batch(self, token_rows, caches: list[KVCache], *, taps: tuple[int, ...] = (), logit_rows=None):
        """``TargetModel.forward_batch``: the script's one-hot rows, zero taps."""
        rows = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_rows]
        n_logits = [r.size for r in rows] if logit_rows is None else logit_rows
        logits = []
        for ids, cache, n in zip(rows, caches, n_logits):
            t, start = ids.size, cache.length
            cache.reserve(t)
            cache.write(0, ids.astype(np.float32).reshape(1, t, 1), np.zeros((1, t, 1), np.float32))
            cache.commit(t)
            for j in range(t - n, t):
                i = start + j + 1 - self.prompt_len  # the output index this row predicts
                if self.rows is not None and 0 <= i < len(self.rows):
                    logits.append(self.rows[i])
                    continue
                row = np.zeros(self.config.vocab_size, dtype=np.float32)
                row[self.script[i] if 0 <= i < len(self.script) else EOS] = 10.0
                logits.append(row)
        logits = np.stack(logits) if logits else np.zeros((0, self.config.vocab_size), np.float32)  # [sum n_b, V]
        r = sum(ids.size for ids in rows)
        return ForwardOutput(logits, np.zeros((r, len(taps) * 8), np.float32) if taps else None)


# A tiny random Llama (``tiny_model``) and a prompt for it.
TINY300 = ModelConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=300,
                      rope_theta=500.0, rms_norm_eps=1e-6)
PROMPT = [5, 17, 200, 33, 9, 140, 71, 2, 250, 64]


def tiny_model() -> CausalLM:
    from test_llama import tiny_weights  # tests/models is on sys.path (above)

    return CausalLM(TINY300, tiny_weights(TINY300, seed=4))


def family_model(directory: Path, case: str) -> CausalLM:
    """The float32 model of the tiny checkpoint ``case`` of ``family_files.CASES`` (a model family
    with its features), written as a Hugging Face directory under ``directory``."""
    from family_files import write_hf_dir  # tests/models is on sys.path (above)

    loaded = load_hf_dir(write_hf_dir(directory / case, case), weights="f32")
    return CausalLM(loaded.config, loaded.weights)


def random_draft(target, *, taps: list[int], layers: int = 1, seed: int = 0, block_size: int = 8) -> DFlashDraft:
    """A random-weight draft for ``target`` (shares its embedding and LM head)."""
    cfg = draft_config_dict(target.config, layers=layers, taps=taps, mask_token_id=1, block_size=block_size)
    return DFlashDraft(DFlashConfig.from_dict(cfg), random_draft_weights(cfg, seed=seed), embed=target.embed,
                       lm_head=target.lm_head, max_positions=target.config.max_position_embeddings)


def replay_proposer(truth, vocab: int, corrupt=lambda pos: False, drafted: int = 7):
    """A proposer that drafts ``truth(pos)`` for positions ``start+1 .. start+drafted`` (a token
    another run produced there; ``drafted``: the draft's block size - 1), replaced by
    ``(token + 1) % vocab`` where ``corrupt(pos)``."""
    def propose(draft_cache, anchor_id: int, start: int) -> np.ndarray:
        positions = range(start + 1, start + 1 + drafted)
        return np.array([(truth(p) + 1) % vocab if corrupt(p) else truth(p) for p in positions])
    return propose


def plain_generate(model, prompt, n: int, params, seed: int | None = None) -> list[int]:
    """The baseline: prefill, then ``n - 1`` 1-token decodes, one draw per token (no engine)."""
    rng = sampler.new_rng(seed)
    cache = model.new_cache(len(prompt) + n)
    out = [sampler.sample(prefill(model, np.asarray(prompt, dtype=np.int64), cache).logits, params, rng)]
    while len(out) < n:
        out.append(sampler.sample(decode(model, out[-1], cache).logits, params, rng))
    return out


def spec_generate(decoder: SpeculativeDecoder, prompt, n: int, params, seed: int | None = None, on_step=None):
    """Speculative generation of ``n`` tokens by hand (no engine). ``on_step(out, cache, state)``
    runs after every step that did not finish. Returns (tokens, cache, state)."""
    picker = Picker(params, sampler.new_rng(seed))
    cache = decoder.target.new_cache(len(prompt) + n + decoder.block_size)
    state = decoder.new_state()
    out = [picker.pick_and_accept(decoder.prefill(np.asarray(prompt, dtype=np.int64), cache, state))]

    def emit(token: int) -> bool:
        out.append(token)
        return len(out) >= n

    while len(out) < n:
        decoder.step(Lane(out[-1], cache, state, picker, emit))
        if len(out) < n and on_step is not None:
            on_step(out, cache, state)
    return out, cache, state
