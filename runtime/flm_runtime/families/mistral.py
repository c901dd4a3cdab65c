"""The Mistral family: Llama with a sliding window on every layer.

Hugging Face config keys beyond Llama's: ``sliding_window`` (None: full attention) and
``head_dim`` (None: hidden / heads). GGUF: llama.cpp converts Mistral as the ``llama``
architecture, without the window; a ``llama`` GGUF with ``llama.attention.sliding_window`` is read
as Mistral (``families.for_gguf``), one without it as Llama (full attention, as llama.cpp
runs it). Tensors, names and the Q/K permutation are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from flm_runtime.families.checkpoint import GGUFMetadata
from flm_runtime.families.llama import Llama
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.model_config import SIZE, Bound, ModelConfig


@dataclass(frozen=True)
class MistralConfig(ModelConfig):
    """Llama's hyper-parameters and the window every layer attends (0: all positions)."""

    sliding_window: int = 0

    BOUNDS: ClassVar[dict[str, Bound]] = {**ModelConfig.BOUNDS, "sliding_window": SIZE}


class Mistral(Llama):
    """The Mistral family (module docstring)."""

    model_types = ("mistral",)
    gguf_architectures = ()  # llama.cpp writes Mistral as "llama" (families.for_gguf)
    config_class = MistralConfig
    gguf_keys = {**Llama.gguf_keys, "sliding_window": "attention.sliding_window"}

    def hf_values(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        values = super().hf_values(config, source)
        values["sliding_window"] = config.get("sliding_window") or 0  # null: full attention
        return values

    def gguf_values(self, meta: GGUFMetadata) -> dict[str, Any]:
        return {**super().gguf_values(meta), "sliding_window": meta.count(self.gguf_keys["sliding_window"], 0, SIZE)}

    def layer_spec(self, config: MistralConfig, layer: int) -> LayerSpec:
        return replace(super().layer_spec(config, layer), sliding_window=config.sliding_window)


FAMILY = Mistral()
