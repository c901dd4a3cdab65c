"""Hugging Face model directory (config.json + *.safetensors) -> the weights of one of our model
families (``flm_runtime.families``, by ``model_type``), float32 or blocks of the cpu
backend's format when the weight kind asks (``load_hf_dir``). The family reads the config and
says which tensors the checkpoint must hold; a family whose norms scale by ``1 + w`` (Gemma) has
the 1 folded into its norm weights here.

Checkpoints are usually bfloat16, which ``safetensors.numpy`` cannot read: the files are read by
``flm_runtime.safetensors_file`` (float32 arrays of F32, F16, BF16 and F64 tensors).

Sharded checkpoints are found through ``model.safetensors.index.json`` (its ``weight_map``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import quant
from flm_runtime.loading.hf_files import load_json
from flm_runtime.loading.weights import WEIGHT_KINDS, Weight, check_weights
from flm_runtime.model_config import ModelConfig
from flm_runtime.safetensors_file import iter_safetensors

# Tensors some checkpoints carry that the model computes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFModel(NamedTuple):
    """What ``load_hf_dir`` returns: config (its family's class), Hugging Face weights, raw
    config.json."""

    config: ModelConfig
    weights: dict[str, Weight]
    config_dict: dict[str, Any]


def load_hf_dir(path: str | Path, *, weights: str = "f32") -> HFModel:
    """Read a Hugging Face checkpoint directory of one of our families.

    Args:
        path: directory with config.json and model.safetensors (or shards + index).
        weights: a weight kind of ``WEIGHT_KINDS``: ``f32`` (the default) keeps float32 matrices, ``q4``
            quantizes them to 4 bits, ``auto`` and ``q8`` to 8 bits (a matrix whose input width
            is not a multiple of 32 stays float32); one tensor is float32 at a time.

    Returns:
        ``HFModel``; a tied model's redundant ``lm_head.weight`` is dropped.

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ModelFormatError: a model_type we do not run, a feature of it we do not (named with its
            key), a config value of the wrong type or out of range (config.json, the key and the
            value named), malformed files, tensors missing, unexpected (named) or of the wrong shape.
    """
    from flm_runtime import families  # deferred as in loading.gguf.load_gguf

    path = Path(path)
    config_dict = load_json(path / "config.json")
    family = families.for_model_type(config_dict.get("model_type"), str(path))
    config = family.config_from_hf(config_dict, str(path / "config.json"))
    assert weights in WEIGHT_KINDS, f"weight kind {weights!r} not in {WEIGHT_KINDS}"
    bits = None if weights == "f32" else 4 if weights == "q4" else 8
    tensors: dict[str, Weight] = {}
    for file in safetensors_files(path):
        for name, w in iter_safetensors(file):
            if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if family.norm_offset and name.endswith("norm.weight"):  # the checkpoint's w of a (offset + w) norm
                w = w + np.float32(family.norm_offset)
            tensors[name] = quant.quantize(w, bits) if bits and w.ndim == 2 and w.shape[1] % quant.BLOCK == 0 else w
    check_weights(family.checkpoint_shapes(config), tensors, source=str(path))
    return HFModel(config, tensors, config_dict)


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, in load order.

    Raises:
        FileNotFoundError: none found, or the index names a file that is absent.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(load_json(index).get("weight_map", {}).values()))
        files = [directory / n for n in names]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(2, "no .safetensors file in model directory", str(directory))
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(2, "safetensors shard listed in the index is missing", str(f))
    return files
