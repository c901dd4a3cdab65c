"""Hostile hyper-parameters in a Hugging Face ``config.json`` and in GGUF metadata: each refused at
load with ``ModelFormatError`` naming the file, the key and the value (the same check of the config,
``model_config.ModelConfig``, for both formats); an absurd context length is refused before anything is
sized by it, and the longest one accepted makes a KV pool of a known size."""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from flm_runtime.errors import ModelFormatError
from flm_runtime.loading import load_model_files
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.scheduling.engine import Engine

CONFIG = tiny_config()  # hidden 64, 4 heads of 16, 2 key/value heads, context 128
WEIGHTS = random_hf_weights(CONFIG)
T = gguf.GGUFValueType

LAYERS = "an integer from 1 to 1024"
COUNT = "an integer of at least 1"
HEAD_DIM = "an even integer of at least 2"
CONTEXT = "an integer from 1 to 1048576"
BASE = "a finite number above 1"
POSITIVE = "a finite number above 0"
SIZE = "an integer of at least 0"

# config.json key, its GGUF key below ``llama.``, hostile values and what the value must be.
VALUES = [
    ("num_hidden_layers", "block_count", ["2", 2.0, 0, -1, True, 2**31], LAYERS),
    ("hidden_size", "embedding_length", ["64", 64.5, 0, -64], COUNT),
    ("intermediate_size", "feed_forward_length", [96.0, 0, -1], COUNT),
    ("num_attention_heads", "attention.head_count", ["4", 0], COUNT),
    ("num_key_value_heads", "attention.head_count_kv", [2.0, 0, -2], COUNT),
    ("vocab_size", "vocab_size", [0, "266"], COUNT),
    ("head_dim", "attention.key_length", [15, 0, -16, "16", 16.0], HEAD_DIM),
    ("max_position_embeddings", "context_length", [-1, 0, 2**31, 2**40, "128", 128.0], CONTEXT),
    ("rope_theta", "rope.freq_base", [-1.0, 0.0, 0.5, 1.0, math.nan, math.inf, "10000"], BASE),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", [-1.0, 0.0, math.nan, -math.inf, "1e-5"], POSITIVE),
]


def _gguf_typed(value) -> tuple[object, T]:
    """``value`` as a GGUF metadata value (float32, a 32- or 64-bit integer, a string, a bool)."""
    if isinstance(value, bool):
        return value, T.BOOL
    if isinstance(value, float):
        return value, T.FLOAT32
    if isinstance(value, str):
        return value, T.STRING
    return value, T.INT32 if value < 0 else T.UINT32 if value < 2**32 else T.UINT64


class Case:
    """One hostile config: ``hf`` the config.json keys changed (None: removed) and ``hf_message``
    what follows ``<dir>/config.json: ``; ``gguf`` the metadata keys set and ``gguf_message`` what
    follows ``<file>: ``, or None where GGUF has no such key."""

    def __init__(self, id: str, hf: dict | None, hf_message: str | None, gguf: dict | None = None,
                 gguf_message: str | None = None, arch: str = "llama", tensors: dict | None = None):
        self.id, self.hf, self.hf_message, self.gguf, self.gguf_message = id, hf, hf_message, gguf, gguf_message
        self.arch, self.tensors = arch, tensors


def _value_cases() -> list[Case]:
    cases = []
    for key, gguf_key, values, requirement in VALUES:
        for value in values:
            read = float(np.float32(value)) if isinstance(value, float) else value  # GGUF keeps float32
            cases.append(Case(f"{key}={value!r}", {key: value}, f"key {key} is {value!r}, not {requirement}",
                              {f"llama.{gguf_key}": _gguf_typed(value)},
                              f"metadata key llama.{gguf_key} is {read!r}, not {requirement}"))
    return cases


LINEAR, YARN = ("linear", T.STRING), ("yarn", T.STRING)
CASES = [*_value_cases(), *[
    Case("heads-not-a-multiple-of-kv-heads", {"num_key_value_heads": 3},
         "key num_attention_heads is 4, not a multiple of num_key_value_heads=3",
         {"llama.attention.head_count_kv": (3, T.UINT32)},
         "metadata key llama.attention.head_count is 4, not a multiple of llama.attention.head_count_kv=3"),
    Case("no-head-dim-and-hidden-not-a-multiple-of-twice-the-heads", {"head_dim": None, "hidden_size": 68},
         "key hidden_size is 68, not a multiple of twice num_attention_heads=4 (no head dim is given: it is "
         "their quotient, and RoPE needs it even)"),
    Case("tie-word-embeddings-a-string", {"tie_word_embeddings": "true"},
         "key tie_word_embeddings is 'true', not true or false"),
    Case("partial-rotary-factor-a-string", {"partial_rotary_factor": "x"},
         "key partial_rotary_factor is 'x', not a finite number above 0"),
    Case("rope-scaling-a-string", {"rope_scaling": "linear"},
         "key rope_scaling is 'linear', not an object of RoPE scaling keys"),
    *[Case(f"rope-scaling-factor={v!r}", {"rope_scaling": {"rope_type": "linear", "factor": v}},
           f"key rope_scaling.factor is {v!r}, not {POSITIVE}",
           {"llama.rope.scaling.type": LINEAR, "llama.rope.scaling.factor": _gguf_typed(v)},
           f"metadata key llama.rope.scaling.factor is {v!r}, not {POSITIVE}") for v in (-2.0, 0.0, math.nan, "2")],
    Case("yarn-beta-fast-zero",
         {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                           "beta_fast": 0.0}}, f"key rope_scaling.beta_fast is 0.0, not {POSITIVE}",
         {"llama.rope.scaling.type": YARN, "llama.rope.scaling.factor": (2.0, T.FLOAT32),
          "llama.rope.scaling.original_context_length": (64, T.UINT32),
          "llama.rope.scaling.yarn_beta_fast": (0.0, T.FLOAT32)},
         f"metadata key llama.rope.scaling.yarn_beta_fast is 0.0, not {POSITIVE}"),
    Case("yarn-truncate-a-string",
         {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                           "truncate": "yes"}}, "key rope_scaling.truncate is 'yes', not true or false"),
    Case("llama3-bands-of-no-width",
         {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                           "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
         "key rope_scaling.high_freq_factor is 2.0, not above rope_scaling.low_freq_factor=2.0"),
    Case("longrope-zero-divisor",
         {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 7 + [0.0], "long_factor": [1.0] * 8}},
         f"key rope_scaling.short_factor is {[1.0] * 7 + [0.0]!r}, not a list of finite numbers above 0"),
    Case("dynamic-ntk-past-the-longest-context", {"rope_scaling": {"rope_type": "dynamic", "factor": 16384.0}},
         f"key max_position_embeddings × rope_scaling.factor is {128 * 16384}, not {CONTEXT}"),
    Case("rope-freqs-zero-divisor", None, None, {}, "tensor rope_freqs.weight holds 0.0, not divisors above 0",
         tensors={"rope_freqs.weight": (np.array([1.0] * 7 + [0.0], np.float32), gguf.GGMLQuantizationType.F32)}),
    *[Case(f"mistral-sliding-window={v!r}", {"model_type": "mistral", "sliding_window": v},
           f"key sliding_window is {v!r}, not {SIZE}", {"llama.attention.sliding_window": _gguf_typed(v)},
           f"metadata key llama.attention.sliding_window is {v!r}, not {SIZE}") for v in (-1, 4.5, "8")],
    Case("qwen2-max-window-layers", {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": -1}, f"key max_window_layers is -1, not {SIZE}"),
    Case("qwen2-use-sliding-window-a-string", {"model_type": "qwen2", "use_sliding_window": "false"},
         "key use_sliding_window is 'false', not true or false"),
    Case("gemma3-sliding-window-pattern", {"model_type": "gemma3_text", "sliding_window_pattern": 0},
         f"key sliding_window_pattern is 0, not {COUNT}"),
    Case("gemma3-query-pre-attn-scalar", {"model_type": "gemma3_text", "query_pre_attn_scalar": -1},
         f"key query_pre_attn_scalar is -1, not {POSITIVE}"),
    Case("gemma3-local-rope-base", {"model_type": "gemma3_text", "rope_local_base_freq": 0.5},
         f"key rope_local_base_freq is 0.5, not {BASE}", {"gemma3.rope.freq_base_swa": (0.5, T.FLOAT32)},
         f"metadata key gemma3.rope.freq_base_swa is 0.5, not {BASE}", arch="gemma3"),
    Case("gemma3-final-softcap", {"model_type": "gemma3_text", "final_logit_softcapping": -30.0},
         "key final_logit_softcapping is -30.0, not a finite number of at least 0",
         {"gemma3.final_logit_softcapping": (-30.0, T.FLOAT32)},
         "metadata key gemma3.final_logit_softcapping is -30.0, not a finite number of at least 0", arch="gemma3"),
]]
HF_CASES = [pytest.param(c, id=c.id) for c in CASES if c.hf is not None]
GGUF_CASES = [pytest.param(c, id=c.id) for c in CASES if c.gguf is not None]


def write_hf(directory: Path, changes: dict) -> Path:
    """The tiny checkpoint as a Hugging Face directory, its config.json's keys ``changes`` set
    (None: removed)."""
    write_tiny_hf_dir(directory, CONFIG, WEIGHTS)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def refusal(path: Path) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as info:
        load_model_files(path, weights="f32")
    return info.value


@pytest.mark.parametrize("case", HF_CASES)
def test_a_hostile_config_json_value_is_refused_naming_the_file_the_key_and_the_value(tmp_path, case):
    directory = write_hf(tmp_path / "model", case.hf)
    assert str(refusal(directory)) == f"{directory / 'config.json'}: {case.hf_message}"


@pytest.mark.parametrize("case", GGUF_CASES)
def test_a_hostile_gguf_metadata_value_is_refused_naming_the_file_the_key_and_the_value(tmp_path, case):
    path = write_tiny_gguf(tmp_path / "model.gguf", CONFIG, WEIGHTS, arch=case.arch, extra_kv=case.gguf,
                           extra_tensors=case.tensors)
    assert str(refusal(path)) == f"{path}: {case.gguf_message}"


def test_the_same_checkpoint_loads_from_both_formats_unchanged(tmp_path):
    """The intact tiny checkpoint loads from each format: every refusal above is its change's doing."""
    hf = load_model_files(write_hf(tmp_path / "model", {}), weights="f32").config
    from_gguf = load_model_files(write_tiny_gguf(tmp_path / "model.gguf", CONFIG, WEIGHTS), weights="f32").config
    assert hf == from_gguf == CONFIG


@pytest.mark.parametrize("context", [2**31, 2**40])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_an_absurd_context_length_is_refused_before_anything_is_sized_by_it(tmp_path, source, context):
    """Refused at load, allocating what the tiny checkpoint's files take (they are under 1 MB): not
    the RoPE tables or KV pool of 2**31 positions (16 GB and more)."""
    if source == "hf":
        path, key = write_hf(tmp_path / "model", {"max_position_embeddings": context}), "key max_position_embeddings"
        where = path / "config.json"
    else:
        path = write_tiny_gguf(tmp_path / "model.gguf", CONFIG, WEIGHTS,
                               extra_kv={"llama.context_length": (context, T.UINT64)})
        key, where = "metadata key llama.context_length", path
    tracemalloc.start()
    try:
        error = refusal(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(error) == f"{where}: {key} is {context}, not {CONTEXT}"
    assert peak < 16 << 20


def test_the_longest_context_accepted_makes_a_kv_pool_of_four_such_contexts(tmp_path):
    """``MAX_CONTEXT_LENGTH`` (2**20 positions) loads, and the engine's default KV budget holds 4
    contexts of it: 65,536 blocks of 64 positions, 512 bytes a position (2 layers x K and V x 2
    heads x 16 x 4 bytes), 2 GiB of zeroed pages that cost nothing until written."""
    bundle = load_model_files(write_hf(tmp_path / "model", {"max_position_embeddings": 2**20}), weights="f32")
    engine = Engine(CausalLM(bundle.config, bundle.weights), bundle.tokenizer, name="longest")
    try:
        stats = engine.stats()
        assert engine.context_length == 2**20
        assert (stats["kv_blocks"], stats["kv_block_tokens"]) == (65_536, 64)
        assert stats["kv_budget_bytes"] == engine.pool.k.nbytes + engine.pool.v.nbytes == 4 * 2**20 * 512 == 2 << 30
    finally:
        engine.close()
