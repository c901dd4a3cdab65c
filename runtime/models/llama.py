"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) in numpy.

Weights follow Hugging Face's names and layout (``model.layers.{i}.self_attn.q_proj.weight`` is
``[out_features, in_features]``) and Hugging Face's RoPE convention: the rotation pairs dimension
``i`` with ``i + head_dim/2`` ("rotate half"). Loaders bring every format to this convention
(GGUF stores Q/K permuted for interleaved pairs; ``flm_runtime.loading.gguf`` undoes it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters, named as in a Hugging Face ``config.json`` (unknown keys are ignored).

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
