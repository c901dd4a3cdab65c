"""A model's hyper-parameters (``ModelConfig``, which each model family's config in
``flm_runtime.models`` extends with its own keys) and what each must be (``Bound``). It imports
nothing of ``flm_runtime``: the backends, the models, the engine and the loaders all build on it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

# The longest context (positions) a model may declare: the RoPE tables (positions x D/2 x 8 bytes
# per table) and the engine's default KV budget (4 contexts) are sized from it, so a larger value
# is refused at load, never allocated. Above every released checkpoint of our families (Mistral
# Nemo's 1,024,000, Qwen2.5-1M's 1,010,000).
MAX_CONTEXT_LENGTH = 1 << 20
# The most decoder layers a model may declare: the readers list each layer's tensors and window
# before a tensor is compared with them. 8 times the deepest released dense checkpoint's (Llama 3.1
# 405B's 126).
MAX_LAYERS = 1 << 10


class ConfigValueError(ValueError):
    """A model config's hyper-parameter of the wrong type or out of range, named as the config
    names it (``ModelConfig`` refuses it, or a family's reader of a file: ``require``). The
    loaders re-raise it as a ``flm_runtime.errors.ModelFormatError`` naming the file and the key
    as the file spells it (``describe``; ``families.checkpoint.config_refusals``).

    Attributes:
        field: the hyper-parameter (``num_hidden_layers``, ``rope_scaling.factor``).
        value: what it holds.
        requirement: what it must be; a ``{}`` in it stands for ``other`` and its value.
        other, other_value: the hyper-parameter the requirement relates ``field`` to, or None.
    """

    def __init__(self, field: str, value: Any, requirement: str, other: str | None = None, other_value: Any = None):
        self.field, self.value, self.requirement = field, value, requirement
        self.other, self.other_value = other, other_value
        super().__init__(self.describe(str))

    def describe(self, key: Callable[[str], str]) -> str:
        """``"<key(field)> is <value>, not <requirement>"``, every hyper-parameter named by
        ``key`` (field -> the key as a file spells it)."""
        requirement = self.requirement if self.other is None else self.requirement.format(
            f"{key(self.other)}={self.other_value!r}")
        return f"{key(self.field)} is {self.value!r}, not {requirement}"


@dataclass(frozen=True)
class Bound:
    """What a hyper-parameter must be: an integer (``integer``; an even one if ``even``) or any
    finite number, at least ``least`` (above it if ``above``) and at most ``most`` (None: no
    limit). True and false are no numbers; a number too large for a float is none either."""

    integer: bool
    least: float
    above: bool = False
    most: int | None = None
    even: bool = False

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is such a number."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if self.integer else numbers.Real):
            return False
        try:
            if not isinstance(value, numbers.Integral) and not math.isfinite(value):
                return False
        except OverflowError:  # an integer where a float belongs, beyond float's range
            return False
        return ((value > self.least if self.above else value >= self.least)
                and (self.most is None or value <= self.most) and not (self.even and value % 2))

    def __str__(self) -> str:
        kind = "an even integer" if self.even else "an integer" if self.integer else "a finite number"
        if self.most is not None:
            return f"{kind} from {self.least:g} to {self.most}"
        return f"{kind} {'above' if self.above else 'of at least'} {self.least:g}"


COUNT = Bound(integer=True, least=1)  # heads, widths
LAYERS = Bound(integer=True, least=1, most=MAX_LAYERS)
SIZE = Bound(integer=True, least=0)  # a window, a layer index (0: none, the first)
HEAD_DIM = Bound(integer=True, least=2, even=True)  # RoPE rotates pairs of a head's dimensions
CONTEXT = Bound(integer=True, least=1, most=MAX_CONTEXT_LENGTH)
POSITIVE = Bound(integer=False, least=0, above=True)  # an epsilon, a scale, a scaling factor
NON_NEGATIVE = Bound(integer=False, least=0)  # a soft-cap, an attention factor (0: none, the default)
ROPE_BASE = Bound(integer=False, least=1, above=True)  # frequencies base ** (-2i/D) fall with i


def require(value: Any, bound: Bound, field: str) -> Any:
    """``value``, when ``bound`` holds it.

    Raises:
        ConfigValueError: it does not, naming ``field``.
    """
    if not bound.holds(value):
        raise ConfigValueError(field, value, str(bound))
    return value


def require_flag(value: Any, field: str) -> bool:
    """``value``, when it is true or false (a flag; no other value stands for one).

    Raises:
        ConfigValueError: it is not, naming ``field``.
    """
    if type(value) is not bool:
        raise ConfigValueError(field, value, "true or false")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters every model family has, named as in a Hugging Face ``config.json``
    (unknown keys are ignored). A family's own keys live in its config, a subclass
    (``flm_runtime.families``); this class is the Llama family's.

    Every numeric field is checked against its bound (``BOUNDS``; a subclass adds its fields'),
    and the fields against each other, when the config is made: a config that exists holds
    values a model can be built from and run with.

    Attributes:
        vocab_size: tokens in the vocabulary (V).
        hidden_size: width of the residual stream (hidden).
        intermediate_size: SwiGLU FFN width.
        num_hidden_layers: decoder layers (L), at most ``MAX_LAYERS``.
        num_attention_heads: query heads (H).
        num_key_value_heads: key/value heads (Hkv); H % Hkv == 0 (grouped-query attention).
        max_position_embeddings: context length (tokens), at most ``MAX_CONTEXT_LENGTH``.
        rope_theta: RoPE base frequency, above 1.
        rms_norm_eps: epsilon inside RMSNorm, above 0.
        tie_word_embeddings: the LM head is the embedding matrix.
        head_dim: per-head width (D), even; None (absent): hidden_size / num_attention_heads,
            which must then be a whole even number.
        rope_scaling: the RoPE scaling (``flm_runtime.families.rope.RopeScaling``), None for none.

    Raises:
        ConfigValueError: a value of the wrong type or out of its bound, H not a multiple of
            Hkv, or (head_dim absent) hidden_size not a multiple of 2 H; naming the field.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    rope_scaling: Any = None

    # Each numeric field's bound, checked when the config is made.
    BOUNDS: ClassVar[dict[str, Bound]] = {
        **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                         "num_key_value_heads"), COUNT),
        "num_hidden_layers": LAYERS, "max_position_embeddings": CONTEXT, "rope_theta": ROPE_BASE,
        "rms_norm_eps": POSITIVE, "head_dim": HEAD_DIM}

    def __post_init__(self) -> None:
        for name, bound in self.BOUNDS.items():
            if not (name == "head_dim" and self.head_dim is None):  # absent: derived below
                require(getattr(self, name), bound, name)
        require_flag(self.tie_word_embeddings, "tie_word_embeddings")
        heads = self.num_attention_heads
        if heads % self.num_key_value_heads:
            raise ConfigValueError("num_attention_heads", heads, "a multiple of {}", "num_key_value_heads",
                                   self.num_key_value_heads)
        if self.head_dim is None:
            if self.hidden_size % (2 * heads):
                raise ConfigValueError("hidden_size", self.hidden_size, "a multiple of twice {} (no head dim is "
                                       "given: it is their quotient, and RoPE needs it even)",
                                       "num_attention_heads", heads)
            object.__setattr__(self, "head_dim", self.hidden_size // heads)

    @classmethod
    def from_dict(cls, config: dict) -> "ModelConfig":
        """Build from a ``config.json`` mapping, ignoring keys this class does not name and null
        values (a field's default, if it has one).

        Raises:
            TypeError: a field without a default is missing.
            ConfigValueError: as the class.
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads
