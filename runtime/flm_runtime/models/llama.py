"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) in numpy.

Weights follow Hugging Face's names and layout (``model.layers.{i}.self_attn.q_proj.weight`` is
``[out_features, in_features]``) and Hugging Face's RoPE convention: the rotation pairs dimension
``i`` with ``i + head_dim/2`` ("rotate half"). Loaders bring every format to this convention
(GGUF stores Q/K permuted for interleaved pairs; ``flm_runtime.loading.gguf`` undoes it).
"""

from __future__ import annotations

import numpy as np

from flm_runtime.backends import Backend
from flm_runtime.core import ForwardOutput, LlamaConfig
from flm_runtime.kv_cache import BLOCK_TOKENS, KVCache, KVPool
from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import cpu
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.layers.decoder import DecoderLayer, LayerWeights, RowSpan, stack_arithmetic
from flm_runtime.layers.stack import Stack, stack_weights
from flm_runtime.layers.spec import LayerConfig, LayerSpec

KV_PROJ = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
QKV_PROJ = ("self_attn.q_proj.weight", *KV_PROJ)  # LayerWeights.wqkv's rows, in this order


def layer_weight_shapes(config: LayerConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder layer, by Hugging Face name below the layer's prefix, with their
    ``[out, in]`` shapes."""
    c = config
    e, f = c.hidden_size, c.intermediate_size
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
            "self_attn.q_proj.weight": (q_rows, e), "self_attn.k_proj.weight": (kv_rows, e),
            "self_attn.v_proj.weight": (kv_rows, e), "self_attn.o_proj.weight": (e, q_rows),
            "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e), "mlp.down_proj.weight": (e, f)}


def take_fused(take: WeightTaker, config: LayerConfig, prefix: str, names: tuple[str, ...]) -> cpu.Weight:
    """The tensors ``prefix + name`` of one layer (names of ``layer_weight_shapes``) stacked by rows,
    in that order: one matrix product instead of one per tensor (a weight fusion).

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape.
    """
    shapes = layer_weight_shapes(config)
    return cpu.stack_rows([take(prefix + name, shapes[name]) for name in names])


def fuse_layer(take: WeightTaker, config: LayerConfig, prefix: str) -> LayerWeights:
    """One decoder layer's weights (the tensors of ``layer_weight_shapes`` below ``prefix``) as a
    ``LayerWeights``.

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape.
    """
    shapes = layer_weight_shapes(config)

    def one(name: str) -> cpu.Weight:
        return take(prefix + name, shapes[name])

    return LayerWeights(
        attn_norm=one("input_layernorm.weight"),
        wqkv=take_fused(take, config, prefix, QKV_PROJ),
        wo=one("self_attn.o_proj.weight"),
        ffn_norm=one("post_attention_layernorm.weight"),
        w_gate_up=take_fused(take, config, prefix, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        w_down=one("mlp.down_proj.weight"),
    )


class LlamaModel:
    """A Llama-family target model on the cpu backend.

    Args:
        config: hyper-parameters.
        weights: float32 arrays or (matrices) ``QuantWeight`` keyed by Hugging Face names, HF layout
            and RoPE convention (see module docstring). Matrices are fused into new arrays; the
            dict is not modified.

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape.
    """

    backend = Backend.CPU
    prefill_chunk = 256  # positions per prefill forward; bounds the [Hkv, R*T, N] score buffer

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray]):
        self.config = config
        c = config
        take = WeightTaker(weights)
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))  # [V, E]
        self.layers = [fuse_layer(take, c, f"model.layers.{i}.") for i in range(c.num_hidden_layers)]
        self.norm = take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings:
            self.lm_head = self.embed  # [V, E]
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.rope_cos, self.rope_sin = cpu.rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta)
        spec = LayerSpec.of(c)
        self.stack = None  # a quantized model's one-call step (layers.stack), else None
        if all(isinstance(m, QuantWeight) for layer in self.layers for m in layer.matrices) and isinstance(
                self.lm_head, QuantWeight):
            stacked, self.layers, lm_head = stack_weights(self.layers, self.norm, self.lm_head)
            self.lm_head = lm_head
            if c.tie_word_embeddings:
                self.embed = lm_head
            self.stack = Stack(stacked, [spec] * c.num_hidden_layers, c.vocab_size)
        # Each layer runs on the ops table its weights call for (layers.ops.ops_for): compiled when
        # its matrices are quantized, else the numpy reference.
        self.decoders = [DecoderLayer(w, spec) for w in self.layers]
        self.quantized, self.kv_dtype, self._final_norm = stack_arithmetic(self.decoders)
        # A row's results do not depend on the rows beside it, bit for bit (docs/design.md,
        # "Batch invariance"): the quantized path's promise; float32 products round by row count.
        self.batch_invariant = self.quantized

    @property
    def nbytes_per_token(self) -> int:
        """Weight bytes read by one decode step (every layer + final norm + LM head, not the embedding row)."""
        n = sum(a.nbytes for layer in self.layers for a in vars(layer).values() if a is not None)
        return n + self.norm.nbytes + self.lm_head.nbytes

    def new_pool(self, positions: int) -> KVPool:
        """An engine's KV pool: ``positions // BLOCK_TOKENS`` blocks in this model's geometry and
        ``kv_dtype``, a fixed number (``kv_cache``)."""
        c = self.config
        return KVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype, positions // BLOCK_TOKENS)

    def new_cache(self, capacity: int = 0, pool: KVPool | None = None) -> KVCache:
        """An empty KV cache for one sequence, its blocks taken from ``pool`` (``new_pool``);
        without one, from a pool of its own that grows on demand (``capacity``, tokens, is a
        hint)."""
        c = self.config
        if pool is not None:
            return KVCache(pool, c.max_position_embeddings)
        return KVCache.private(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.max_position_embeddings,
                               capacity, self.kv_dtype)

    def forward_batch(self, token_rows: list[np.ndarray], caches: list[KVCache], *,
                      taps: tuple[int, ...] = (), logit_rows: list[int] | None = None) -> ForwardOutput:
        """One step for ``B`` sequences at once (continuous batching): sequence ``b`` appends the
        ``T_b`` positions ``token_rows[b]`` to ``caches[b]`` (a prefill chunk, a plain decode row,
        or a DFlash verify pass: the anchor and the drafted tokens).

        All ``R = sum T_b`` rows share every matrix product: one product per weight matrix, so
        the weights are read once per step instead of once per sequence. Attention stays per
        sequence, over its own cache. The sequences are independent: rows ``b`` equal the step of
        sequence ``b`` alone up to float rounding (a product of more rows runs a different BLAS
        kernel).

        Args:
            token_rows: ``B`` int arrays ``[T_b]`` (``T_b >= 1``).
            caches: ``B`` distinct KV caches, one per sequence.
            taps: the layers to tap (``TargetModel.forward_batch``); costs one concatenation.
            logit_rows: per sequence, how many of its LAST rows need logits (``0 <= n_b <= T_b``:
                a prefill chunk needs 1 or none, a verify pass all of them); None: every row.
                The LM head runs only on those rows.
        Returns:
            logits ``[sum n_b, V]`` float32 of the selected rows, sequence after sequence, and the
            taps of EVERY row ``[R, len(taps) * E]`` (None without ``taps``). If it raises, no
            cache's length has changed.
        """
        rows = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_rows]
        n_logits = [r.size for r in rows] if logit_rows is None else [int(n) for n in logit_rows]
        assert len(rows) == len(caches) == len(n_logits) > 0 and all(r.size for r in rows), "one non-empty row group per cache"
        assert all(0 <= n <= r.size for n, r in zip(n_logits, rows)), f"logit_rows {n_logits} out of range"
        assert len({id(c) for c in caches}) == len(caches), "a cache appears twice in the batch"
        ends = np.cumsum([r.size for r in rows])
        spans = [RowSpan(cache, cache.length, slice(int(e) - r.size, int(e)), n)
                 for cache, r, e, n in zip(caches, rows, ends, n_logits)]
        return ForwardOutput(*self._run(np.concatenate(rows), spans, taps=taps))

    def _run(self, token_ids: np.ndarray, spans: list[RowSpan], *,
             taps: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows ``token_ids`` ``[R]`` through every layer, and the LM head over each span's
        last ``n_logits`` rows; ``spans`` say which rows belong to which sequence (in row order,
        covering all rows), one span per sequence.

        Returns:
            logits ``[sum n_logits, V]``; the taps ``[R, len(taps) * E]`` or None without ``taps``.
        """
        assert all(0 <= i < len(self.layers) for i in taps), f"tap layers {taps} out of range"
        assert spans[0].rows.start == 0 and spans[-1].rows.stop == token_ids.shape[0]
        assert all(a.rows.stop == b.rows.start for a, b in zip(spans, spans[1:])), "spans out of row order"
        with cpu.forward_pass(token_ids.shape[0]):
            return self._run_rows(token_ids, spans, taps=taps)

    def _run_rows(self, token_ids: np.ndarray, spans: list[RowSpan], *,
                  taps: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        """``_run``'s body, inside ``cpu.forward_pass``."""
        for s in spans:
            s.cache.reserve(s.n_rows)
        positions = np.concatenate([np.arange(s.start, s.start + s.n_rows) for s in spans])  # [R]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [R, D/2] each
        x = cpu.embedding(self.embed, token_ids)  # [R, E]
        if self.stack is not None:
            logits, tapped = self.stack(x, cos[None], sin[None], spans, taps)  # one RoPE table
            for s in spans:
                s.cache.commit(s.n_rows)
            return logits, tapped
        tapped = {}
        for i, decoder in enumerate(self.decoders):
            x = decoder(i, x, spans, cos, sin)  # a new array each layer: no copy
            if i in taps:
                tapped[i] = x
        if sum(s.n_logits for s in spans) < x.shape[0]:
            x = x[np.concatenate([np.arange(s.rows.stop - s.n_logits, s.rows.stop) for s in spans])]
        logits = np.ascontiguousarray(cpu.linear(self._final_norm(x, self.norm, self.config.rms_norm_eps),
                                                 self.lm_head))  # [sum n_logits, V]
        for s in spans:  # last: a step that raised has appended nothing
            s.cache.commit(s.n_rows)
        return logits, (np.concatenate([tapped[i] for i in taps], axis=-1) if taps else None)  # [R, n*E]


class WeightTaker:
    """Looks up named tensors in a weights dict, checking shape; arrays become float32
    C-contiguous, quantized matrices (``cpu.Weight``) are taken as they are."""

    def __init__(self, weights: dict[str, cpu.Weight]):
        self.weights = weights

    def __call__(self, name: str, shape: tuple[int, ...]) -> cpu.Weight:
        if name not in self.weights:
            raise ModelFormatError(f"tensor {name!r} is missing from the model file")
        a = self.weights[name]
        if tuple(a.shape) != shape:
            raise ModelFormatError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
        return a if isinstance(a, QuantWeight) else np.ascontiguousarray(a, dtype=np.float32)
