"""Model files -> config, weights, tokenizer and chat template.

Two formats, one result (``ModelBundle``):

- a ``.gguf`` file (llama.cpp; matrices kept in their blocks or dequantized as the weight kind
  asks, Q/K rows un-permuted; tokenizer and chat template from the metadata):
  ``flm_runtime.loading.gguf``;
- a Hugging Face directory (config.json, *.safetensors, tokenizer.json, tokenizer_config.json):
  ``flm_runtime.loading.safetensors_loader``.

Weights use Hugging Face names, ``[out_features, in_features]`` layout and the rotate-half RoPE
convention whatever the source (see ``flm_runtime.loading.weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flm_runtime.errors import ModelFormatError
from flm_runtime.loading.gguf import load_gguf, open_gguf
from flm_runtime.loading.safetensors_loader import load_hf_dir
from flm_runtime.loading.tokenizer import Tokenizer
from flm_runtime.loading.weights import Weight, weight_kind
from flm_runtime.model_config import ModelConfig

__all__ = ["ModelBundle", "Tokenizer", "load_model_files"]


@dataclass
class ModelBundle:
    """Everything the engine needs from a model's files.

    Attributes:
        config: hyper-parameters.
        weights: Hugging Face name -> float32 C-contiguous array or ``QuantWeight`` (``[out, in]``
            for matrices); ``lm_head.weight`` only when the model does not tie it to the embedding.
        tokenizer: encoder/decoder, special tokens and chat template.
        source: the file or directory loaded.
    """

    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: Tokenizer
    source: Path


def load_model_files(path: str | Path, weights: str | None = None, keep: Path | None = None) -> ModelBundle:
    """Load a model from a ``.gguf`` file or a Hugging Face directory.

    Args:
        path: a GGUF file (any name; its magic is checked) or a directory with config.json.
        weights: the weight kind (``loading.weights.WEIGHT_KINDS``); None: ``$FLM_WEIGHTS``,
            else ``auto`` (each GGUF tensor keeps its precision class; safetensors 8-bit).
        keep: where a GGUF's converted weights are kept for the next load
            (``flm_runtime.loading.converted``; ``load_gguf``'s ``keep``); None: converted at
            every load.

    Returns:
        The ``ModelBundle`` (weights in memory, or mapped from ``keep``).

    Raises:
        FileNotFoundError: ``path`` (or a file the directory needs) does not exist.
        ModelFormatError: unreadable or unsupported files (architecture, quantization,
            tokenizer type, inconsistent shapes); the message names the file.
        InvalidRequestError: ``weights`` (or ``$FLM_WEIGHTS``) is not a weight kind.
    """
    path, kind = Path(path), weight_kind(weights)
    if path.is_dir():
        return _load_hf_dir(path, kind)
    if path.is_file():
        return _load_gguf(path, kind, keep)
    raise FileNotFoundError(2, "model file or directory not found", str(path))


def _load_gguf(path: Path, kind: str, keep: Path | None) -> ModelBundle:
    header = open_gguf(path)
    tokenizer = Tokenizer.from_gguf(header.metadata, source=str(path))  # refused before a weight is converted
    model = load_gguf(path, weights=kind, keep=keep, gguf_file=header)
    _check_vocab(model.config, tokenizer, path)
    return ModelBundle(model.config, model.weights, tokenizer, path)


def _load_hf_dir(path: Path, kind: str) -> ModelBundle:
    model = load_hf_dir(path, weights=kind)
    tokenizer = Tokenizer.from_hf_dir(path)
    _check_vocab(model.config, tokenizer, path)
    return ModelBundle(model.config, model.weights, tokenizer, path)


def _check_vocab(config: ModelConfig, tokenizer: Tokenizer, path: Path) -> None:
    # The embedding may have padding rows beyond the tokenizer, never fewer rows.
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding only "
            f"{config.vocab_size} rows")
