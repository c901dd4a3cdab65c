"""Drafts in the public DFlash format (``dflash_public_files``: bfloat16, QK-norm, blocks of 16, for
the tiny Qwen3 and Llama 3.1 targets): their logits and a whole greedy speculative generation
equal the golden outputs of the ``dflash`` package's reference (``tests/reference/golden_dflash.npz``,
recorded by ``tests/reference/record_dflash_golden.py``); a models file pairs a target GGUF with
such a draft into a ``-dflash`` tag; malformed public drafts are refused naming the problem."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from dflash_public_files import BLOCK_SIZE, CASES, CONTEXT, draft_config, draft_tensors, write_case, write_draft_dir
from family_files import write_gguf, write_hf_dir

from flm_runtime import registry
from flm_runtime.backends import decode, prefill
from flm_runtime.errors import ModelFormatError
from flm_runtime.loading.gguf import load_gguf
from flm_runtime.loading.safetensors_loader import load_hf_dir
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.models.dflash import PUBLIC_ARCHITECTURE, DFlashDraft
from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.sampling.picker import Picker
from flm_runtime.scheduling.step import Lane
from flm_runtime.speculation import decoders
from flm_runtime.speculation.policy import ALWAYS_SPECULATE
from flm_runtime.speculation.speculative import SpeculativeDecoder

GOLDEN = np.load(Path(__file__).resolve().parents[1] / "reference" / "golden_dflash.npz")
GREEDY = SamplingParams()


def golden(case: str, field: str) -> np.ndarray:
    return GOLDEN[f"{case}_{field}"]


def hf_target(directory: Path, case: str) -> CausalLM:
    """The float32 target of draft ``case``, from its Hugging Face directory (as the reference loads it)."""
    loaded = load_hf_dir(write_hf_dir(directory / "target", CASES[case].target), weights="f32")
    return CausalLM(loaded.config, loaded.weights)


@pytest.mark.parametrize("case", CASES)
def test_draft_logits_equal_the_reference(tmp_path, case):
    """The block's logits after the reference's own context taps (added in two pieces), over the
    target's LM head: the whole vocabulary, scaled and soft-capped as the config asks."""
    target = hf_target(tmp_path, case)
    draft = DFlashDraft.load(write_case(tmp_path / "draft", case), target)
    c = draft.config
    assert (c.architecture, c.qk_norm, c.block_size, draft.vocab) == (PUBLIC_ARCHITECTURE, True, BLOCK_SIZE, None)
    assert c.target_layer_ids == CASES[case].taps and c.mask_token_id == CASES[case].mask_token_id
    assert (c.scaling.kind if c.scaling else None) == ("llama3" if case == "llama_llama3" else None)
    taps, anchor = golden(case, "taps"), int(golden(case, "context_ids")[CONTEXT])
    cache = draft.new_cache()
    draft.add_context(cache, taps[:10], 0)
    draft.add_context(cache, taps[10:], 10)
    got = draft.draft_logits(cache, anchor, CONTEXT)  # [15, 256]
    expected = golden(case, "logits")
    assert got.shape == expected.shape == (BLOCK_SIZE - 1, 256)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
    assert np.array_equal(draft.draft_block(cache, anchor, CONTEXT), np.argmax(expected, axis=-1))


def whole_steps(decoder: SpeculativeDecoder, prompt: tuple[int, ...], n_steps: int):
    """Greedy speculative decoding of ``prompt`` for ``n_steps`` steps: (tokens, per-step drafted
    tokens, per-step acceptance lengths)."""
    picker = Picker(GREEDY, sampler.new_rng(None))
    cache = decoder.target.new_cache(64)
    state = decoder.new_state()
    out = [picker.pick_and_accept(decoder.prefill(np.asarray(prompt, dtype=np.int64), cache, state))]
    drafted, acceptance = [], []
    for _ in range(n_steps):
        step = decoder.step(Lane(out[-1], cache, state, picker, lambda token: out.append(token) or False))
        drafted.append(step.record.ids.tolist())
        acceptance.append(step.accepted + 1)
    return out, drafted, acceptance


@pytest.mark.parametrize("case", CASES)
def test_speculative_decoding_reproduces_the_reference(tmp_path, case):
    """``SpeculativeDecoder`` (greedy, whole blocks of 16: the null policy, no n-gram or suffix
    proposer) drafts, keeps and emits exactly what ``dflash_generate`` did, step by step, over the
    steps the reference ran whole blocks; one of them keeps several tokens."""
    target = hf_target(tmp_path, case)
    draft = DFlashDraft.load(write_case(tmp_path / "draft", case), target)
    n = int(golden(case, "whole_steps"))
    decoder = SpeculativeDecoder(target, draft, policy=ALWAYS_SPECULATE, ngram=False)
    out, drafted, acceptance = whole_steps(decoder, CASES[case].prompt, n)
    assert acceptance == golden(case, "acceptance")[:n].tolist()
    assert max(acceptance) >= 7
    assert drafted == golden(case, "drafted")[:n].tolist()
    assert out == golden(case, "output")[: len(out)].tolist() and len(out) == 1 + sum(acceptance)


def test_a_models_file_pairs_a_target_gguf_with_a_public_draft(tmp_path, monkeypatch):
    """``base`` + ``draft`` in the models file: the ``-dflash`` tag finds its public draft, loads it
    for the base's quantized GGUF target (an 8-bit draft) with no policy table in the draft
    directory (whole blocks always), and decodes greedily exactly as the target alone."""
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    gguf = write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3")
    draft_dir = write_case(tmp_path / "tiny-qwen3-dflash", "qwen3")
    (tmp_path / "models.yaml").write_text(textwrap.dedent("""\
        tinypub:qwen3: tiny-qwen3.gguf
        tinypub-dflash:qwen3:
          base: tinypub:qwen3
          draft: tiny-qwen3-dflash
        """))
    registry.reload()
    try:
        entry = registry.resolve("tinypub-dflash:qwen3")
        assert entry.is_dflash and entry.base == "tinypub:qwen3"
        assert registry.locate_draft("tinypub-dflash:qwen3") == draft_dir
        loaded = load_gguf(gguf, weights="q8")
        target = CausalLM(loaded.config, loaded.weights)
        draft = decoders.load_draft("tinypub-dflash:qwen3", target)
        assert draft.quantized and target.quantized
        policy = decoders.load_policy("tinypub-dflash:qwen3", "cpu")
    finally:
        registry.reload()
    assert policy is ALWAYS_SPECULATE
    prompt = CASES["qwen3"].prompt
    decoder = SpeculativeDecoder(target, draft, policy=policy, ngram=False)
    out, _, acceptance = whole_steps(decoder, prompt, 12)
    cache = target.new_cache(64)
    plain = [int(np.argmax(prefill(target, np.asarray(prompt, dtype=np.int64), cache).logits))]
    while len(plain) < len(out):
        plain.append(int(np.argmax(decode(target, plain[-1], cache).logits)))
    assert out == plain
    assert max(acceptance) > 1  # the 8-bit draft still drafts the repeated token


def rewrite(config: dict, **changes) -> dict:
    """``config`` with top-level keys changed (None: removed) and ``dflash_config`` keys given as
    ``dflash_<key>``."""
    config = json.loads(json.dumps(config))
    for key, value in changes.items():
        where, key = (config["dflash_config"], key[len("dflash_"):]) if key.startswith("dflash_") else (config, key)
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value
    return config


MALFORMED_CONFIGS = {
    "DFlash 2 key": (dict(dflash_conv_kernel_size=4), r"key 'conv_kernel_size': DFlash 2 drafts"),
    "DFlash 2 class": (dict(architectures=["DFlash2DraftModel"]), r"architectures \['DFlash2DraftModel'\]: DFlash 2"),
    "sliding layers": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                       r"key 'layer_types': sliding-window draft layers"),
    "attention bias": (dict(attention_bias=True), r"key 'attention_bias': attention biases"),
    "no taps": (dict(dflash_target_layer_ids=None, num_target_layers=None), r"key 'target_layer_ids' is missing"),
    "taps out of range": (dict(dflash_target_layer_ids=[0, 2]), r"target_layer_ids \[0, 2\] fall outside the target's 2"),
    "no mask id": (dict(dflash_mask_token_id=None), r"missing .*'mask_token_id'"),
    "mask id out of range": (dict(dflash_mask_token_id=256), r"mask_token_id 256 is outside the target's vocabulary"),
    "other hidden size": (dict(hidden_size=32), r"hidden_size is 32 but the target's is 64"),
    "other vocabulary": (dict(vocab_size=300), r"vocab_size is 300 but the target's vocab_size is 256"),
    "other target depth": (dict(num_target_layers=4), r"num_target_layers is 4 but the target's num_hidden_layers is 2"),
    "unknown rope scaling": (dict(rope_scaling={"rope_type": "weird", "factor": 2.0}), r"rope_scaling type 'weird'"),
    "taps not integers": (dict(dflash_target_layer_ids="0,1"), r"key 'target_layer_ids' is '0,1', expected a list"),
}


@pytest.mark.parametrize("changes, message", MALFORMED_CONFIGS.values(), ids=MALFORMED_CONFIGS.keys())
def test_malformed_public_configs_are_refused(tmp_path, changes, message):
    target = hf_target(tmp_path, "qwen3")
    path = write_draft_dir(tmp_path / "draft", rewrite(draft_config("qwen3"), **changes), draft_tensors("qwen3"))
    with pytest.raises(ModelFormatError, match=message) as info:
        DFlashDraft.load(path, target)
    assert str(path) in str(info.value)


def without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


MALFORMED_TENSORS = {
    "misshapen QK-norm": (lambda t: t | {"layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)},
                          r"layers\.0\.self_attn\.q_norm\.weight"),
    "missing QK-norm": (lambda t: without(t, "layers.1.self_attn.k_norm.weight"), r"layers\.1\.self_attn\.k_norm\.weight"),
    "misshapen fc": (lambda t: t | {"fc.weight": np.ones((64, 64), np.float32)}, r"fc\.weight"),
    "a DFlash 2 tensor": (lambda t: t | {"layers.0.attention_conv.base_kernel": np.ones((2, 4, 64), np.float32)},
                          r"unexpected tensors in the draft: layers\.0\.attention_conv\.base_kernel"),
}


@pytest.mark.parametrize("change, message", MALFORMED_TENSORS.values(), ids=MALFORMED_TENSORS.keys())
def test_malformed_public_tensors_are_refused(tmp_path, change, message):
    target = hf_target(tmp_path, "qwen3")
    path = write_draft_dir(tmp_path / "draft", draft_config("qwen3"), change(draft_tensors("qwen3")))
    with pytest.raises(ModelFormatError, match=message) as info:
        DFlashDraft.load(path, target)
    assert str(path / "model.safetensors") in str(info.value)
