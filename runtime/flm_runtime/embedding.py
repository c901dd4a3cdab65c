"""Text embeddings from a target model (docs/design.md, "Embeddings").

A text's embedding is the mean, over its token positions, of the target's final normed hidden
state (the last layer's output after the model's final RMSNorm: what the LM head reads), then
L2-normalised; float32 ``[E]``. It is computed with the target's own step, ``forward_batch``, over
the prompt, with no logits and no sampling: prefill without decode. The KV caches live only for
the call.

    from flm_runtime import embed, get_engine

    engine = get_engine("smollm2:135m")
    vectors = embed(engine.model, [engine.tokenizer.encode(t) for t in ["a cat", "a dog"]], engine.context_length)

Texts run as one batch (each its own cache, ``model.prefill_chunk`` positions of each per step),
in consecutive groups of at most one context of positions in all, so a call's KV memory is at
most one full context's. A row's result does not depend on its batch on the quantized path (bit
for bit, docs/design.md, "Batch invariance"), so a text's vector is the same alone or among others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flm_runtime.backends import TargetModel
from flm_runtime.kernels import cpu
from flm_runtime.errors import ContextLengthError, InvalidRequestError


def embed(model: TargetModel, token_lists: Sequence[Sequence[int]], context_length: int | None = None) -> np.ndarray:
    """The embeddings of ``B`` tokenized texts.

    Args:
        model: the target (any backend).
        token_lists: ``B`` >= 1 non-empty lists of token ids, each within the context.
        context_length: the context (tokens), at most the model's ``max_position_embeddings``
            (None: that): its engine's (``Engine.context_length``, a tag's ``context_length``).

    Returns:
        ``[B, E]`` float32, each row of unit L2 norm.

    Raises:
        InvalidRequestError: no texts, an empty one or a token id outside the vocabulary
            (``param`` ``input`` / ``input[i]``).
        ContextLengthError: a text longer than the context (``param`` ``input[i]``).
    """
    rows = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in token_lists]
    if not rows:
        raise InvalidRequestError("input must hold at least one text", param="input")
    context, vocab = context_length or model.config.max_position_embeddings, model.config.vocab_size
    for i, ids in enumerate(rows):
        if ids.size == 0:
            raise InvalidRequestError(f"input[{i}] has no tokens", param=f"input[{i}]")
        if ids.size > context:
            raise ContextLengthError(prompt_tokens=int(ids.size), max_tokens=0, context_length=context,
                                     param=f"input[{i}]")
        if ids.min() < 0 or ids.max() >= vocab:
            raise InvalidRequestError(f"input[{i}] has a token id outside the vocabulary (0..{vocab - 1})",
                                      param=f"input[{i}]")
    out = np.empty((len(rows), model.config.hidden_size), dtype=np.float32)
    for group in _groups([r.size for r in rows], context):
        out[group] = _pooled(model, [rows[i] for i in group])
    return out


def _groups(lengths: list[int], capacity: int) -> list[list[int]]:
    """Consecutive indices of ``lengths`` in groups of at most ``capacity`` positions in all."""
    groups: list[list[int]] = []
    used = capacity  # the first text opens a group
    for i, n in enumerate(lengths):
        if used + n > capacity:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def _pooled(model: TargetModel, rows: list[np.ndarray]) -> np.ndarray:
    """Unit mean-pooled final normed hidden states ``[B, E]`` float32 of ``rows`` (token ids
    ``[T_b]`` each), run as one batch."""
    c = model.config
    caches = [model.new_cache(r.size) for r in rows]
    sums = np.zeros((len(rows), c.hidden_size), dtype=np.float64)  # float64: the mean of thousands of rows
    last_layer = (c.num_hidden_layers - 1,)
    step = model.prefill_chunk
    for start in range(0, max(r.size for r in rows), step):
        live = [b for b, r in enumerate(rows) if r.size > start]
        chunks = [rows[b][start : start + step] for b in live]
        out = model.forward_batch(chunks, [caches[b] for b in live], taps=last_layer, logit_rows=[0] * len(live))
        hidden = cpu.rms_norm(out.taps, model.norm, c.rms_norm_eps)  # [R, E]
        for b, part in zip(live, np.split(hidden, np.cumsum([len(x) for x in chunks])[:-1])):
            sums[b] += part.sum(axis=0, dtype=np.float64)
    means = sums / np.array([r.size for r in rows], dtype=np.float64)[:, None]
    return (means / np.linalg.norm(means, axis=1, keepdims=True)).astype(np.float32)
