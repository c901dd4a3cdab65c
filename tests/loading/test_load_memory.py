"""A GGUF's load holds its weights once: the peak and steady resident set of a load (the file
converted and kept, then mapped again) against the file's size (issue #31, item 5; docs/design.md,
"How weights are held").

The file is shaped like a small Llama (36 layers of width 1024, an untied 32k vocabulary) with
random blocks, about 300 MB: enough that holding the weights twice would be hundreds of MB above
the bound. Two mixes of block types: Q4_0 with Q8_0, Q4_K and Q6_K (``_q4_0``), and Qwen2.5-Coder's
Q4_K_M (``_q4_k_m``), whose layers fuse 4-bit Q and K with an 8-bit V. Each load runs in a fresh
process that reports its ``VmHWM`` (peak) and, once the model is built and every weight page has
been read (what serving does), its ``VmRSS`` (steady).
"""

from __future__ import annotations

import json
import mmap
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_llama_files import gguf_name, llama_gguf_writer, tiny_config

from flm_bench.shaped_gguf import random_blocks
from flm_runtime.families.llama import FAMILY as LLAMA
from flm_runtime.kernels import quant
from flm_runtime.loading import converted
from flm_runtime.loading import gguf as gguf_loader
from flm_runtime.model_config import ModelConfig
from flm_runtime.models.causal_lm import CausalLM

Q = gguf.GGMLQuantizationType
MB = 1 << 20
PEAK_RATIO, STEADY_RATIO, FIXED = 1.15, 1.10, 300 * MB  # the bounds: size * ratio + fixed

CONFIG = ModelConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# A Q4_0 file's matrices with the other types this loader reads (the LM head Q6_K, as llama.cpp's
# Q4_0 files have it); the matrices fused together (QKV, gate/up) of one type.
_TYPES = {"model.embed_tokens": Q.Q4_K, "mlp.down_proj": Q.Q8_0, "lm_head": Q.Q6_K}


def _q4_0(name: str) -> Q:
    return next((t for part, t in _TYPES.items() if part in name), Q.Q4_0)


def _q4_k_m(name: str) -> Q:
    """Qwen2.5-Coder-1.5B's Q4_K_M mix: Q4_K, with Q6_K for the LM head and for ``v_proj`` and
    ``down_proj`` in half the layers (every other one here), whose Q, K and V fuse 4-bit and 8-bit
    blocks."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    if name.startswith("lm_head") or (name.endswith(("v_proj.weight", "down_proj.weight")) and layer % 2 == 0):
        return Q.Q6_K
    return Q.Q4_K


def write_blocks_gguf(path, config: ModelConfig, qtype: Callable[[str], Q] = _q4_0, seed: int = 0):
    """A Llama GGUF of random blocks (``qtype`` of each matrix's Hugging Face name; norms F32),
    written tensor by tensor."""
    rng = np.random.default_rng(seed)
    writer = llama_gguf_writer(path, config)
    writer.add_vocab_size(config.vocab_size)  # the tokenizer's vocabulary is smaller: padding rows
    for name, shape in LLAMA.checkpoint_shapes(config).items():
        if len(shape) == 1:
            writer.add_tensor(gguf_name(name), np.ones(shape, np.float32))
        else:
            writer.add_tensor(gguf_name(name), random_blocks(rng, shape, qtype(name)), raw_dtype=qtype(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load_in_a_fresh_process(path, keep) -> dict:
    """What ``api.load_model`` does up to the model's first step, then every weight page read once
    (``flm_bench.load_memory``): its peak and steady resident set at the end."""
    done = subprocess.run([sys.executable, "-m", "flm_bench.load_memory", str(path), str(keep)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from Linux's /proc")
@pytest.mark.parametrize("qtype", [_q4_0, _q4_k_m])
def test_a_load_holds_the_weights_once_first_and_later(tmp_path, qtype):
    if shutil.disk_usage(tmp_path).free < 2 * 1024 * MB:
        pytest.skip("the test writes a 300 MB GGUF and its converted copy: under 2 GB free in the temporary directory")
    path = write_blocks_gguf(tmp_path / "llama-3b-shaped.gguf", CONFIG, qtype)
    size, keep = path.stat().st_size, tmp_path / "kept"
    first = _load_in_a_fresh_process(path, keep)  # converts and keeps
    kept = converted.cache_file(keep, path, "auto")
    assert kept.is_file()
    later = _load_in_a_fresh_process(path, keep)  # maps what was kept
    print(f"file {size / MB:.0f} MB, kept {kept.stat().st_size / MB:.0f} MB; first load peak "
          f"{first['peak'] / MB:.0f} MB, steady {first['steady'] / MB:.0f} MB; later load peak "
          f"{later['peak'] / MB:.0f} MB, steady {later['steady'] / MB:.0f} MB")
    for load in (first, later):
        assert load["peak"] <= size * PEAK_RATIO + FIXED, (load, size)
        assert load["steady"] <= size * STEADY_RATIO + FIXED, (load, size)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("qtype", [_q4_0, _q4_k_m])
def test_weights_converted_slice_by_slice_are_the_whole_conversions_and_the_model_maps_them(tmp_path, monkeypatch,
                                                                                          tie, qtype):
    """Kept weights converted 16 rows at a time (rows not a whole number of tiles) hold the bytes
    of the in-memory conversion, but for the parts of a fused matrix of mixed widths, kept in its
    format (8-bit with stored mins) as ``quant.as_format`` holds them (4-bit q and k unchanged, a
    6-bit v quantized to 8 bits); and the model built from them
    stacks them with no copy: its stacked codes, scales and mins are views of the kept file's
    mapping, the bytes of the model built in memory."""
    config = tiny_config(vocab_size=280, hidden_size=256, intermediate_size=512, tie_word_embeddings=tie)
    path = write_blocks_gguf(tmp_path / "q.gguf", config, qtype)
    monkeypatch.setattr(gguf_loader, "_SLICE_WEIGHTS", 1)  # the smallest slice: one tile of rows
    fresh = gguf_loader.load_gguf(path, weights="auto").weights
    kept = gguf_loader.load_gguf(path, weights="auto", keep=tmp_path / "kept").weights  # converted, kept, mapped
    assert fresh.keys() == kept.keys()
    reformatted = set()
    for name in fresh:
        a, b = fresh[name], kept[name]
        if isinstance(a, quant.QuantWeight) and (a.bits, a.mins is None) != (b.bits, b.mins is None):
            reformatted.add(name)
            assert (b.bits, b.mins is None) == (8, False), name
            assert np.array_equal(quant.as_format(a, 8, True).dequantize(), b.dequantize()), name
        else:
            for x, y in zip(_arrays(a), _arrays(b), strict=True):
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    mixed = range(0, config.num_hidden_layers, 2) if qtype is _q4_k_m else ()  # layers with a Q6_K v_proj
    assert reformatted == {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in mixed for m in "qkv"}
    in_memory, mapped = CausalLM(config, fresh).stack.weights, CausalLM(config, kept).stack.weights
    mins = tie or qtype is _q4_k_m  # Q4_K's stored mins in the stack: the tied embedding's, or the layers'
    assert (mapped.mins.size > 0) == mins
    for a, b in zip(in_memory[:2 + mins], mapped[:2 + mins]):  # codes, scales (and mins)
        assert a.dtype == b.dtype and a.size > 0 and a.tobytes() == b.tobytes()
        assert isinstance(quant.owner_of(b), mmap.mmap) and not isinstance(quant.owner_of(a), mmap.mmap)
    assert quant.owner_of(mapped.codes) is quant.owner_of(mapped.scales)


def _arrays(w):
    return [a for a in ((w.codes, w.scales, w.mins) if isinstance(w, quant.QuantWeight) else (w,)) if a is not None]
