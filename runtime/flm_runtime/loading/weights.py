"""The weight dictionary every loader produces, and its validation.

Names and layouts are Hugging Face's (``LlamaForCausalLM.state_dict()`` and its families'): a linear layer's weight
is ``[out_features, in_features]``; ``y = x @ W.T``. A weight is a C-contiguous float32 array or,
for matrices, a ``QuantWeight`` of the cpu backend's block format (``WEIGHT_KINDS`` says which).
RoPE convention: "rotate half" (dimension ``i`` pairs with ``i + D/2`` inside each head). A norm
weight is the multiplier itself (Gemma's ``1 + w`` folded in at load).
"""

from __future__ import annotations


import numpy as np

from flm_runtime.errors import InvalidRequestError, ModelFormatError
from flm_runtime.kernels.quant import QuantWeight, Weight
from flm_runtime.settings import Settings, variable

# How a model's matrices are held: "auto" keeps each source tensor's precision class (4-bit
# sources 4-bit, the rest 8-bit); "q4" / "q8" make every matrix 4- / 8-bit; "f32" dequantizes
# everything (the reference path).
WEIGHT_KINDS = ("auto", "q4", "q8", "f32")


def weight_kind(requested: str | None = None) -> str:
    """The weight kind to load: ``requested`` (a models-file entry's ``weights``), else
    ``$FLM_WEIGHTS``, else ``auto``.

    Raises:
        InvalidRequestError: not one of ``WEIGHT_KINDS``; ``param`` names where the value came from
            (``weights`` or ``FLM_WEIGHTS``), as ``$FLM_BACKEND``'s error does.
    """
    value, origin = (requested, "weights") if requested else (Settings.from_env().weights, variable("weights"))
    value = (value or "auto").strip().lower()
    if value not in WEIGHT_KINDS:
        raise InvalidRequestError(f"{origin}={value!r} is not a weight kind; use one of {', '.join(WEIGHT_KINDS)}",
                                  param=origin)
    return value


def check_weights(expected: dict[str, tuple[int, ...]], weights: dict[str, Weight], source: str) -> None:
    """Check that ``weights`` holds exactly the tensors ``expected`` names, of those shapes, as
    float32 arrays or (matrices) ``QuantWeight``.

    Args:
        expected: name -> shape, what the model's family asks of its checkpoint
            (``flm_runtime.families.llama.Llama.checkpoint_shapes``).
        weights: name -> weight in Hugging Face layout.
        source: file or directory the weights came from, for error messages.

    Raises:
        ModelFormatError: as ``check_shapes``.
    """
    check_shapes(expected, {name: tuple(w.shape) for name, w in weights.items()}, source)
    for name, w in weights.items():
        assert isinstance(w, QuantWeight) or w.dtype == np.float32, f"{name}: loaders must produce float32, got {w.dtype}"


def check_shapes(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Check that ``shapes`` (name -> shape, Hugging Face layout) names exactly the tensors
    ``expected`` names, of those shapes: before a loader converts them, or after.

    Raises:
        ModelFormatError: a tensor is missing, unexpected (named: a tensor of a feature we do not
            run) or of the wrong shape (the embedding's rows: the vocabulary's size), naming
            ``source`` and the tensor.
    """
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing:
        raise ModelFormatError(f"{source}: missing tensors {missing[:5]} ({len(missing)} in all)")
    if extra:
        raise ModelFormatError(f"{source}: unexpected tensors {extra[:5]} ({len(extra)} in all)")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ModelFormatError(f"{source}: tensor {name} has shape {shapes[name]}, the config implies {shape}")
