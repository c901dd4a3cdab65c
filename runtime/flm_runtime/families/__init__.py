"""The model families we run, by Hugging Face ``model_type``, by GGUF ``general.architecture``
and by config class: the one table the loaders and the model look a family up in.

| family | model_type | GGUF architecture |
|---|---|---|
| ``families.llama`` | llama | llama |
| ``families.mistral`` | mistral | llama with ``llama.attention.sliding_window`` (llama.cpp converts Mistral as llama) |
| ``families.qwen2`` | qwen2 | qwen2 |
| ``families.qwen3`` | qwen3 | qwen3 |
| ``families.gemma3`` | gemma3_text | gemma3 |
| ``families.phi3`` | phi3 | phi3 |
"""

from __future__ import annotations

from typing import Any

from flm_runtime.errors import ModelFormatError
from flm_runtime.families import gemma3, llama, mistral, phi3, qwen2, qwen3
from flm_runtime.model_config import ModelConfig

FAMILIES = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY, phi3.FAMILY)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_CONFIG = {f.config_class: f for f in FAMILIES}


def for_model_type(model_type: Any, source: str) -> llama.Llama:
    """The family of a config.json's ``model_type``.

    Raises:
        ModelFormatError: a model_type we do not run, naming it.
    """
    if model_type not in _BY_MODEL_TYPE:
        raise ModelFormatError(f"{source}: model_type {model_type!r} is not supported (supported: "
                               f"{', '.join(_BY_MODEL_TYPE)})")
    return _BY_MODEL_TYPE[model_type]


def for_gguf(metadata: dict[str, Any], source: str) -> llama.Llama:
    """The family of a GGUF file, from its ``general.architecture`` (and, for ``llama``, whether
    it has a sliding window: Mistral).

    Raises:
        ModelFormatError: an architecture we do not run, naming it.
    """
    arch = metadata.get("general.architecture")
    if arch == "llama" and metadata.get("llama.attention.sliding_window"):
        return mistral.FAMILY
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family
    names = sorted({a for f in FAMILIES for a in f.gguf_architectures})
    raise ModelFormatError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(names)})")


def of_config(config: ModelConfig) -> llama.Llama:
    """The family whose config class ``config`` is (each family has its own)."""
    return _BY_CONFIG[type(config)]
