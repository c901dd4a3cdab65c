"""What every model family module (``families/llama.py``, ``qwen2.py`` ...) builds on: the named
tensors a family takes its weights from (``WeightTaker``), a GGUF file's metadata as a family
reads it (``GGUFMetadata``) and the RoPE tables a model gives its layers (``RopePlan``).

A family is a class whose one instance (``FAMILY`` in its module) says, for checkpoints of its
``model_type`` / GGUF architecture: its config (HF keys and ``{arch}.*`` GGUF keys), its tensor
names and shapes, how its tensors become ``LayerWeights``, the ``LayerSpec`` of each layer, its
RoPE tables and its embedding scale. ``families.llama.Llama`` is the base the others extend;
``flm_runtime.families`` maps names to families. Imports: model_config, errors, kernels, layers and
``families.rope`` only, so that the loaders can read the families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.families.rope import RopeScaling
from flm_runtime.kernels.quant import QuantWeight, Weight
from flm_runtime.model_config import COUNT, NON_NEGATIVE, SIZE, Bound, ConfigValueError, require


class WeightTaker:
    """Looks up named tensors in a weights dict, checking shape; arrays become float32
    C-contiguous, quantized matrices (``QuantWeight``) are taken as they are."""

    def __init__(self, weights: dict[str, Weight]):
        self.weights = weights

    def __call__(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor ``name`` of shape ``shape``.

        Raises:
            ModelFormatError: it is missing or has another shape.
        """
        if name not in self.weights:
            raise ModelFormatError(f"tensor {name!r} is missing from the model file")
        a = self.weights[name]
        if tuple(a.shape) != shape:
            raise ModelFormatError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a if isinstance(a, QuantWeight) else np.ascontiguousarray(a, dtype=np.float32)


class GGUFMetadata(NamedTuple):
    """A GGUF file as a family's config reads it.

    Attributes:
        values: every metadata key/value of the file.
        arch: ``general.architecture``.
        tensor_names: the names of the file's tensors.
        rope_tensors: the RoPE factor tensors of the file (``rope_freqs.weight``,
            ``rope_factors_long.weight``, ``rope_factors_short.weight``) present, float32 ``[D/2]``.
        source: the file, for error messages.
    """

    values: dict[str, Any]
    arch: str
    tensor_names: list[str]
    rope_tensors: dict[str, np.ndarray]
    source: str

    def key(self, name: str, default: Any = None) -> Any:
        """The value of ``{arch}.{name}``, else ``default``.

        Raises:
            ModelFormatError: absent and no default.
        """
        value = self.values.get(f"{self.arch}.{name}", default)
        if value is None:
            raise ModelFormatError(f"{self.source}: metadata key {self.arch}.{name} is missing")
        return value

    def has(self, name: str) -> bool:
        """Whether the file has ``{arch}.{name}``."""
        return f"{self.arch}.{name}" in self.values

    def count(self, name: str, default: int | None = None, bound: Bound = COUNT) -> int:
        """The value of ``{arch}.{name}`` (else ``default``), an integer in ``bound`` (a size:
        layers, heads, widths).

        Raises:
            ModelFormatError: absent and no default, naming the key.
            ConfigValueError: not such an integer, naming the key (``config_refusals``).
        """
        return require(self.key(name, default), bound, f"{self.arch}.{name}")

    def decimal(self, name: str, default: float | None = None, bound: Bound = NON_NEGATIVE) -> float:
        """The float32 value of ``{arch}.{name}`` (else ``default``), a number in ``bound`` (a
        finite number not below zero unless it says otherwise: a RoPE base, a scaling factor), as
        the shortest decimal that round-trips through float32 (GGUF stores 1e-5 as
        9.99999974738e-06; the config.json had 1e-5).

        Raises:
            ModelFormatError: absent and no default, naming the key.
            ConfigValueError: not such a number, naming the key (``config_refusals``).
        """
        return float(str(np.float32(require(self.key(name, default), bound, f"{self.arch}.{name}"))))


@contextmanager
def config_refusals(source: str, what: str, key: Callable[[str], str]) -> Iterator[None]:
    """Re-raise a ``ConfigValueError`` of the block (a family reading a file's config, the config
    refusing a value) as a ``ModelFormatError`` naming ``source``, and each hyper-parameter as the
    file spells it: ``what`` (``key``, ``metadata key``), then ``key(field)``."""
    try:
        yield
    except ConfigValueError as e:
        raise ModelFormatError(f"{source}: {what} {e.describe(key)}") from e


class RopeTable(NamedTuple):
    """One RoPE table of a model: its base and scaling (``families.rope.rope_tables``)."""

    theta: float
    scaling: RopeScaling | None


class RopePlan(NamedTuple):
    """The RoPE tables of a model and which one each layer uses.

    Attributes:
        tables: the distinct tables (T of them).
        layer_table: ``[L]``, the index into ``tables`` of each layer's.
    """

    tables: tuple[RopeTable, ...]
    layer_table: tuple[int, ...]


def layer_windows(config: dict[str, Any], n_layers: int, default_types: list[str], source: str) -> tuple[int, ...]:
    """Each layer's sliding window from a config.json (0: full attention): Hugging Face's
    ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``), else ``default_types``
    (the family's rule), the window being ``sliding_window``.

    Raises:
        ModelFormatError: ``layer_types`` of another length or with another type, naming it.
        ConfigValueError: a ``sliding_window`` that is not an integer of at least 0.
    """
    types = config.get("layer_types") or default_types
    if (not isinstance(types, list) or len(types) != n_layers
            or not all(t in ("sliding_attention", "full_attention") for t in types)):
        raise ModelFormatError(f"{source}: layer_types {types} is not {n_layers} of sliding_attention / full_attention")
    window = require(config.get("sliding_window") or 0, SIZE, "sliding_window")
    return tuple(window if t == "sliding_attention" else 0 for t in types)
