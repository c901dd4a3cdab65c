"""The types every layer shares: a model's hyper-parameters (``LlamaConfig``, which each model
family's config in ``flm_runtime.models`` extends with its own keys), the key tile of
the KV cache (``KEY_TILE``), what a target step returns (``ForwardOutput``) and what a draft proposes
(``Proposal``). It imports nothing of ``flm_runtime``: the backends, the models, the engine and the
loaders all build on it.

Axis legend (whole runtime): L layers, Hkv key/value heads, B positions per KV block, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters every model family has, named as in a Hugging Face ``config.json``
    (unknown keys are ignored). A family's own keys live in its config, a subclass
    (``flm_runtime.models``); this class is the Llama family's.

    Attributes:
        vocab_size: tokens in the vocabulary (V).
        hidden_size: width of the residual stream (hidden).
        intermediate_size: SwiGLU FFN width.
        num_hidden_layers: decoder layers (L).
        num_attention_heads: query heads (H).
        num_key_value_heads: key/value heads (Hkv); H % Hkv == 0 (grouped-query attention).
        max_position_embeddings: context length (tokens).
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon inside RMSNorm.
        tie_word_embeddings: the LM head is the embedding matrix.
        head_dim: per-head width (D); defaults to hidden_size // num_attention_heads.
        rope_scaling: the RoPE scaling (``flm_runtime.models.rope.RopeScaling``), None for none.
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
    head_dim: int = 0
    rope_scaling: Any = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        assert self.num_attention_heads % self.num_key_value_heads == 0, "H must be a multiple of Hkv"

    @classmethod
    def from_dict(cls, config: dict) -> "LlamaConfig":
        """Build from a ``config.json`` mapping, ignoring keys this class does not name."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads


KEY_TILE = 16  # positions per tile of the key cache: one 16-lane float32 vector per head dimension


class ForwardOutput(NamedTuple):
    """What a target step returns (``TargetModel.forward_batch`` and the helpers over it in
    ``flm_runtime.backends``).

    Attributes:
        logits: float32 ``[N, V]`` of the rows the call asked logits for (or ``[V]`` of the one
            next position: ``prefill``, ``decode``).
        taps: ``[T, n_taps * E]`` float32, the tapped layers' outputs concatenated per position;
            None when no taps were asked.
    """

    logits: np.ndarray
    taps: np.ndarray | None


class Proposal(NamedTuple):
    """Drafted tokens of ``S`` sequences.

    Attributes:
        ids: ``[S, K]`` int64 target token ids ``d1 .. dK``.
        confidence: ``[S, K]`` float32, the draft's softmax probability of each drafted token (its
            top-1 probability over the draft vocabulary). The speculation policy reads it as an
            estimate of that token's acceptance (EAGLE-2: Li et al. 2024, arXiv:2406.16858, find
            draft confidence a good proxy of the acceptance rate, and so does
            ``benchmarks/draft_confidence.py`` for ours: docs/dflash.md, "Confidence").
    """

    ids: np.ndarray
    confidence: np.ndarray
