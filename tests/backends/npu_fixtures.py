"""A tiny random Llama, a synthetic kernel build for it, and fake-pyxrt kernels that run the
numpy reference of each manifest role (``flm_runtime.backends.npu.reference``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flm_runtime.backends.npu import manifest as mf
from flm_runtime.backends.npu import reference as npu_reference
from flm_runtime.backends.npu.layout import from_bf16, to_bf16, unpack
from flm_runtime.families.llama import FAMILY as LLAMA
from flm_runtime.model_config import ModelConfig
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.models.dflash import DFlashConfig, DFlashDraft, draft_weight_shapes

from fake_pyxrt import make_fake_pyxrt
from xclbin_files import write_build

TAG = "tiny:1m"


def tiny_model(*, max_positions: int = 128, seed: int = 0) -> CausalLM:
    """Random weights already on the bfloat16 grid, so packing them for the NPU loses nothing."""
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in LLAMA.checkpoint_shapes(config).items():
        w = rng.standard_normal(shape).astype(np.float32) * (0.3 if len(shape) == 2 else 0.1)
        w = w + 1.0 if name.endswith("norm.weight") else w
        weights[name] = from_bf16(to_bf16(w))
    return CausalLM(config, weights)


class ByteTokenizer:
    """Token i is the byte 32 + i: printable, no stop tokens (the runs use ignore_eos anyway)."""

    stop_token_ids = frozenset()
    special_token_ids = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([32 + token_id])


def random_draft(target) -> DFlashDraft:
    """A random one-layer DFlash draft for ``target`` (taps 0 and 2, mask id 1)."""
    c = target.config
    config = DFlashConfig(target_layer_ids=(0, 2), num_hidden_layers=1, hidden_size=c.hidden_size,
                          intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                          rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, mask_token_id=1)
    rng = np.random.default_rng(7)
    weights = {name: rng.standard_normal(shape).astype(np.float32) * (0.2 if len(shape) == 2 else 0.05)
               + (1.0 if name.endswith("norm.weight") else 0.0)
               for name, shape in draft_weight_shapes(config).items()}
    return DFlashDraft(config, weights, embed=target.embed, lm_head=target.lm_head,
                       max_positions=c.max_position_embeddings)


def write_tiny_build(folder: Path, model: CausalLM, **build_kwargs) -> mf.Manifest:
    """Synthetic xclbins for ``model`` and a manifest (the repository's, plus this build)."""
    kernels = write_build(folder, **build_kwargs)
    raw = json.loads((mf.xclbin_dir() / "manifest.json").read_text())
    raw["builds"] = [{"model": TAG, "geometry": mf.geometry_of(model.config), "kernels": kernels}]
    (folder / "manifest.json").write_text(json.dumps(raw))
    return mf.load_manifest(folder / "manifest.json")


def sim_kernels(manifest: mf.Manifest, geometry: dict, fail: str | None = None) -> dict:
    """Fake-pyxrt kernel functions for the synthetic build's three kernels; ``fail`` names a
    kernel that raises as a device error would."""
    e, hkv, d = geometry["E"], geometry["Hkv"], geometry["D"]

    def layer(max_t: int):
        def run(args):
            opcode, instr, ninstr, x_in, x_out, weights, kv, step = args
            assert opcode == manifest.opcode and ninstr == len(instr) // 4 and ninstr > 0
            st = np.frombuffer(step, np.int32)
            assert 1 <= st[1] <= max_t, f"T={st[1]} for a kernel of {max_t} positions"
            npu_reference.decoder_layer(
                np.frombuffer(x_in, np.float32).reshape(-1, e), np.frombuffer(x_out, np.float32).reshape(-1, e),
                unpack(manifest, "layer_weights", geometry, weights),
                np.frombuffer(kv, np.uint16).reshape(2, hkv, int(st[2]), d), st, geometry)
        return run

    def head(args):
        opcode, instr, ninstr, x_in, weights, logits, step = args
        assert opcode == manifest.opcode and ninstr == len(instr) // 4
        npu_reference.lm_head(np.frombuffer(x_in, np.float32).reshape(-1, e),
                              unpack(manifest, "lm_head_weights", geometry, weights),
                              np.frombuffer(logits, np.float32).reshape(-1, geometry["V"]),
                              np.frombuffer(step, np.int32), geometry)

    kernels = {"flm_decode_layer": layer(1), "flm_verify_layer": layer(8), "flm_lm_head": head}
    if fail:
        def broken(args):
            raise RuntimeError("Command failed to complete successfully (ERT_CMD_STATE_ERROR)")
        kernels[fail] = broken
    return kernels


def fake_pyxrt_for(manifest: mf.Manifest, model: CausalLM, **kwargs):
    fail = kwargs.pop("fail", None)
    return make_fake_pyxrt(sim_kernels(manifest, mf.geometry_of(model.config), fail), **kwargs)
