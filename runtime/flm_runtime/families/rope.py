"""RoPE tables: the cosines and sines of rotary position embeddings (Su et al. 2021, RoFormer),
with the context-extension scalings checkpoints ask for (``RopeScaling``).

Formulas: Hugging Face transformers 4.57, ``src/transformers/modeling_rope_utils.py``
(``_compute_default_rope_parameters``, ``_compute_linear_scaling_rope_parameters``,
``_compute_dynamic_ntk_parameters``, ``_compute_yarn_parameters``,
``_compute_longrope_parameters``, ``_compute_llama3_parameters`` and ``dynamic_rope_update``),
plus llama.cpp's per-frequency divisors (a GGUF's ``rope_freqs.weight``: its converter's form of
the llama3 scaling). As in Hugging Face, an attention factor multiplies both cos and sin.

Two kinds depend on the length of the sequence in Hugging Face: ``dynamic`` (NTK-aware base) and
``longrope`` (short or long factors). Hugging Face recomputes its frequencies from the largest
position of each forward, so a sequence decoded one token at a time rotates position ``p`` with
the frequencies of a sequence of ``p + 1`` tokens. That is the reading a KV cache can hold (a
cached key never rotates again), so the tables here give each position the frequencies of
``p + 1`` tokens: equal to Hugging Face decoding token by token, not to one Hugging Face forward
over a sequence past the original context (which rotates every position with the final length's).

Axis legend: P positions, D head dim (the rotated width: partial rotary is refused at load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import cpu
from flm_runtime.model_config import COUNT, NON_NEGATIVE, POSITIVE, Bound, ConfigValueError, require, require_flag

# Hugging Face's rope_type values we compute ("su" is LongRoPE's former name; "freq_factors" is a
# GGUF's rope_freqs tensor).
ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (Hugging Face's ``rope_scaling`` keys).

    Attributes:
        kind: one of ``ROPE_KINDS``.
        factor: the context extension factor (linear, dynamic, llama3, yarn).
        original_max_positions: the context the model was pretrained on (llama3, yarn, longrope,
            dynamic: Hugging Face's ``original_max_position_embeddings``, else
            ``max_position_embeddings``).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow: yarn's ramp, in rotations.
        mscale, mscale_all_dim: yarn's attention factor parameters (0: unset).
        truncate: yarn rounds its ramp's ends to whole dimensions.
        attention_factor: multiplies cos and sin (yarn, longrope); 0: the kind's default.
        short_factor, long_factor: longrope's per-frequency divisors ``[D/2]``; ``freq_factors``
            keeps its divisors in ``short_factor``.
    """

    kind: str
    factor: float = 1.0
    original_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float = 0.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def scaling_from_hf(rope_scaling: dict[str, Any] | None, max_position_embeddings: int, *,
                    original_max_position_embeddings: int = 0, source: str = "config.json") -> RopeScaling | None:
    """A config.json's ``rope_scaling`` as a ``RopeScaling`` (None: no scaling).

    Args:
        rope_scaling: the mapping (``rope_type`` or its older name ``type``, and the kind's keys).
        max_position_embeddings: the config's, a positive integer.
        original_max_position_embeddings: a config-level value (Phi-3 keeps it beside
            ``rope_scaling``); 0 when the config has none.

    Raises:
        ModelFormatError: a kind not in ``ROPE_KINDS`` or a key the kind needs missing, naming it.
        ConfigValueError: ``rope_scaling`` not a mapping, or a key's value of the wrong type or
            out of range (a factor not above 0, llama3's high_freq_factor not above its
            low_freq_factor ...), naming it (``rope_scaling.factor``).
    """
    if not rope_scaling:
        return None
    if not isinstance(rope_scaling, dict):
        raise ConfigValueError("rope_scaling", rope_scaling, "an object of RoPE scaling keys")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    kind = "longrope" if kind == "su" else kind
    if kind == "default":
        return None
    if kind not in ROPE_KINDS[:-1]:
        raise ModelFormatError(f"{source}: rope_scaling type {kind!r} is not supported (supported: "
                               f"{', '.join(ROPE_KINDS[1:-1])})")

    def given(key: str) -> Any:
        if rope_scaling.get(key) is None:
            raise ModelFormatError(f"{source}: rope_scaling type {kind!r} needs the key {key!r}")
        return rope_scaling[key]

    def need(key: str, bound: Bound) -> Any:
        return require(given(key), bound, f"rope_scaling.{key}")

    def optional(key: str, default: Any, bound: Bound) -> Any:  # null: the default
        value = rope_scaling.get(key)
        return default if value is None else require(value, bound, f"rope_scaling.{key}")

    def factors(key: str) -> tuple[float, ...]:  # divisors of the frequencies
        values = given(key)
        if not isinstance(values, list) or not all(map(POSITIVE.holds, values)):
            raise ConfigValueError(f"rope_scaling.{key}", values, "a list of finite numbers above 0")
        return tuple(map(float, values))

    if kind == "longrope":
        # a config-level original context (Phi-3's) makes the extension max / original
        original = original_max_position_embeddings or max_position_embeddings
        factor = (max_position_embeddings / original if original_max_position_embeddings
                  else float(optional("factor", 1.0, POSITIVE)))
        return RopeScaling(kind, factor, original,
                           attention_factor=float(optional("attention_factor", 0.0, NON_NEGATIVE)),
                           short_factor=factors("short_factor"), long_factor=factors("long_factor"))
    factor = float(need("factor", POSITIVE))
    if kind == "dynamic":  # Hugging Face reads the config's max_position_embeddings as the original
        return RopeScaling(kind, factor, max_position_embeddings)
    if kind == "llama3":
        low, high = float(need("low_freq_factor", POSITIVE)), float(need("high_freq_factor", POSITIVE))
        if high <= low:  # the blend between the bands divides by their difference
            raise ConfigValueError("rope_scaling.high_freq_factor", high, "above {}", "rope_scaling.low_freq_factor",
                                   low)
        return RopeScaling(kind, factor, need("original_max_position_embeddings", COUNT), low_freq_factor=low,
                           high_freq_factor=high)
    if kind == "yarn":
        truncate = rope_scaling.get("truncate", True)  # null: false, as in Hugging Face
        truncate = truncate is not None and require_flag(truncate, "rope_scaling.truncate")
        return RopeScaling(kind, factor, optional("original_max_position_embeddings", max_position_embeddings, COUNT),
                           beta_fast=float(optional("beta_fast", 32.0, POSITIVE)),
                           beta_slow=float(optional("beta_slow", 1.0, POSITIVE)),
                           mscale=float(optional("mscale", 0.0, NON_NEGATIVE)),
                           mscale_all_dim=float(optional("mscale_all_dim", 0.0, NON_NEGATIVE)),
                           truncate=truncate,
                           attention_factor=float(optional("attention_factor", 0.0, NON_NEGATIVE)))
    return RopeScaling(kind, factor)


def context_length(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The positions a model serves: ``max_position_embeddings``, except under dynamic NTK, whose
    ``max_position_embeddings`` is the pretrained context and whose factor extends it (Hugging
    Face sets no bound; the factor says how far the extension is meant to reach)."""
    if scaling is not None and scaling.kind == "dynamic":
        return int(max_position_embeddings * scaling.factor)
    return max_position_embeddings


def rope_tables(head_dim: int, positions: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The RoPE cos and sin of positions ``0 .. positions-1`` (module docstring's sources).

    Args:
        head_dim: D, the rotated width.
        positions: P.
        theta: the RoPE base (``rope_theta``).
        scaling: the checkpoint's scaling, or None.

    Returns:
        ``(cos, sin)``, each ``[P, D/2]`` float32, the attention factor folded in.

    Raises:
        ModelFormatError: longrope or per-frequency factors whose length is not D/2.
    """
    s = scaling
    if s is None:
        return cpu.rope_tables(head_dim, positions, theta)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    p = np.arange(positions, dtype=np.float64)
    attention = 1.0
    freqs = np.broadcast_to(inv_freq, (positions, head_dim // 2))  # [P, D/2]
    if s.kind == "linear":
        freqs = freqs / s.factor
    elif s.kind == "dynamic":
        # the base of a sequence of max(p + 1, original) tokens, per position
        seq = np.maximum(p + 1, s.original_max_positions)[:, None]
        base = theta * (s.factor * seq / s.original_max_positions - (s.factor - 1)) ** (head_dim / (head_dim - 2))
        freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    elif s.kind == "llama3":
        freqs = np.broadcast_to(_llama3(inv_freq, s), freqs.shape)
    elif s.kind == "yarn":
        inv, attention = _yarn(inv_freq, head_dim, theta, s)
        freqs = np.broadcast_to(inv, freqs.shape)
    elif s.kind in ("longrope", "freq_factors"):
        short = _factors(s.short_factor, head_dim, "short_factor")
        if s.kind == "freq_factors":
            freqs = np.broadcast_to(inv_freq / short, freqs.shape)
        else:
            long = _factors(s.long_factor, head_dim, "long_factor")
            # a sequence of p + 1 tokens past the original context takes the long factors
            freqs = np.where((p + 1 > s.original_max_positions)[:, None], inv_freq / long, inv_freq / short)
            attention = _longrope_attention(s)
    angles = p[:, None] * freqs  # [P, D/2]
    return ((np.cos(angles) * attention).astype(np.float32), (np.sin(angles) * attention).astype(np.float32))


def _factors(values: tuple[float, ...], head_dim: int, name: str) -> np.ndarray:
    if len(values) != head_dim // 2:
        raise ModelFormatError(f"RoPE {name} has {len(values)} values, the head dim {head_dim} needs {head_dim // 2}")
    return np.asarray(values, dtype=np.float64)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's frequencies: long wavelengths divided by ``factor``, short ones kept, a smooth
    blend between (``_compute_llama3_parameters``)."""
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def _yarn(inv_freq: np.ndarray, head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN's frequencies and attention factor (Peng et al. 2023, arXiv:2309.00071;
    ``_compute_yarn_parameters``): interpolated below the ``beta_slow`` rotations, extrapolated
    above ``beta_fast``, a linear ramp between."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation, attention


def _longrope_attention(s: RopeScaling) -> float:
    """LongRoPE's attention factor: given, else ``sqrt(1 + ln(factor) / ln(original))`` with
    ``factor`` the context extension (``_compute_longrope_parameters``)."""
    if s.attention_factor:
        return s.attention_factor
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_positions))
