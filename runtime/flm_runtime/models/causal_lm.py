"""The decoder-only model every family runs (``CausalLM``): an embedding, decoder layers (each
of its family's ``LayerSpec``, on the RoPE table its family gives it), a final norm and an LM
head, on the cpu backend.

Weights follow Hugging Face's names and layout (``model.layers.{i}.self_attn.q_proj.weight`` is
``[out_features, in_features]``) and Hugging Face's RoPE convention: the rotation pairs dimension
``i`` with ``i + head_dim/2`` ("rotate half"). Loaders bring every format to this convention
(GGUF stores Llama's Q/K permuted for interleaved pairs; ``flm_runtime.loading.gguf`` undoes it)
and fold a ``1 + w`` norm's offset into its weight. The family (``families.of_config``)
says how its tensors become each layer's weights (``families.checkpoint``).
"""

from __future__ import annotations

import numpy as np

from flm_runtime import families
from flm_runtime.backends import Backend
from flm_runtime.families import rope
from flm_runtime.families.checkpoint import WeightTaker
from flm_runtime.kernels import cpu
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.kv_cache import BLOCK_TOKENS, KVCache, KVPool
from flm_runtime.layers.decoder import DecoderLayer, RowSpan, quantized
from flm_runtime.layers.stack import Stack, stack_weights
from flm_runtime.model_config import ModelConfig
from flm_runtime.outputs import ForwardOutput


class CausalLM:
    """A target model of any family (``families``) on the cpu backend.

    Args:
        config: hyper-parameters: a family's config (its class names the family).
        weights: float32 arrays or (matrices) ``QuantWeight`` keyed by Hugging Face names, HF layout
            and RoPE convention (see module docstring). Matrices are fused and stacked as views
            when they lie in that order in one mapping (kept weights, ``loading.converted``),
            else into new arrays; the dict is not modified.

    Raises:
        ModelFormatError: a tensor is missing or has the wrong shape, or a layer turns on a
            feature the layers do not run yet (``LayerSpec.unsupported``).
    """

    backend = Backend.CPU
    prefill_chunk = 256  # positions per prefill forward; bounds the [Hkv, R*T, N] score buffer

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        self.config = config
        c = config
        family = families.of_config(c)
        take = WeightTaker(weights)
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))  # [V, E]
        self.embed_scale = np.float32(family.embed_scale(c))
        self.final_softcap = family.final_softcap(c)
        self.layers = [family.layer_weights(take, c, f"model.layers.{i}.") for i in range(c.num_hidden_layers)]
        self.norm = take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings:
            self.lm_head = self.embed  # [V, E]
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))
        plan = family.rope(c)
        tables = [rope.rope_tables(c.head_dim, c.max_position_embeddings, t.theta, t.scaling) for t in plan.tables]
        self.rope_cos = np.stack([cos for cos, _ in tables])  # [T, P, D/2]
        self.rope_sin = np.stack([sin for _, sin in tables])
        self.layer_rope = plan.layer_table  # [L] the table of each layer
        specs = [family.layer_spec(c, i) for i in range(c.num_hidden_layers)]
        for w, spec in zip(self.layers, specs):
            w.check(spec)
        # Layers whose matrices are all quantized run as one compiled step (layers.stack), the
        # LM head in it when it is quantized too; else every layer runs the numpy reference.
        self.quantized = quantized(self.layers)
        self.stack, self.decoders = None, None
        if self.quantized:
            head = self.lm_head if isinstance(self.lm_head, QuantWeight) else None
            stacked, self.layers, head = stack_weights(self.layers, self.norm, head)
            if head is not None:
                self.lm_head = head
                if c.tie_word_embeddings:
                    self.embed = head
            self.stack = Stack(stacked, specs, None if head is None else c.vocab_size, rope=self.layer_rope)
        else:
            self.decoders = [DecoderLayer(w, spec) for w, spec in zip(self.layers, specs)]
        self.kv_dtype = np.float16 if self.quantized else np.float32  # half the bytes attention reads
        # A row's results do not depend on the rows beside it, bit for bit (docs/design.md,
        # "Batch invariance"): the quantized path's promise; float32 products round by row count.
        self.batch_invariant = self.quantized and isinstance(self.lm_head, QuantWeight)

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
        # [T, R, D/2] each; C-contiguous (an index array after a slice need not give that)
        cos, sin = np.ascontiguousarray(self.rope_cos[:, positions]), np.ascontiguousarray(self.rope_sin[:, positions])
        x = cpu.embedding(self.embed, token_ids)  # [R, E]
        if self.embed_scale != 1:
            x *= self.embed_scale
        if self.stack is not None:
            logits, taps_out = self.stack(x, cos, sin, spans, taps)
            if self.stack.vocab is None:  # the final norm's rows, for the float32 head
                logits = np.ascontiguousarray(cpu.linear(logits, self.lm_head))
        else:
            logits, taps_out = self._layers(x, cos, sin, spans, taps)
        if self.final_softcap:
            logits = np.tanh(logits / self.final_softcap) * self.final_softcap
        for s in spans:  # last: a step that raised has appended nothing
            s.cache.commit(s.n_rows)
        return logits, taps_out

    def _layers(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, spans: list[RowSpan],
                taps: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows ``x`` ``[R, E]`` through the reference decoders one by one (layer ``l`` on the
        table ``layer_rope[l]`` of ``cos``, ``sin`` ``[T, R, D/2]``), the final norm and the LM
        head over each span's last ``n_logits`` rows: the logits and the taps, as ``_run``'s."""
        tapped = {}
        for i, decoder in enumerate(self.decoders):
            t = self.layer_rope[i]
            x = decoder(i, x, spans, cos[t], sin[t])  # a new array each layer: no copy
            if i in taps:
                tapped[i] = x
        if sum(s.n_logits for s in spans) < x.shape[0]:
            x = x[np.concatenate([np.arange(s.rows.stop - s.n_logits, s.rows.stop) for s in spans])]
        logits = np.ascontiguousarray(cpu.linear(cpu.rms_norm(x, self.norm, self.config.rms_norm_eps),
                                                 self.lm_head))  # [sum n_logits, V]
        return logits, (np.concatenate([tapped[i] for i in taps], axis=-1) if taps else None)  # [R, n*E]
