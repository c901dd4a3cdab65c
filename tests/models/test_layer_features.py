"""The layer features of the families after Llama (``layers/spec.py``): Q/K/V bias, QK-norm, post
norms, GeGLU, sliding window, softmax scale, and layers that differ in window and RoPE table (Gemma
3), all at once on a tiny random quantized model, causal (a target's layers) and non-causal (a
DFlash draft's, whose stack has no head of its own). The one-call stack (``layers/stack.py``) gives
a row the same bits alone or beside other sequences, on any number of threads; it and the float32
reference (``layers/decoder.py``) are checked against a numpy forward pass written here from the
formulas, the stack within what its quantization explains."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flm_runtime.errors import ModelFormatError
from flm_runtime.kernels import cpu, quant
from flm_runtime.kernels.team import Team
from flm_runtime.kv_cache import KVCache
from flm_runtime.layers.decoder import DecoderLayer, LayerWeights, RowSpan
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.layers.stack import Stack, shared_spec, stack_weights

E, F, H, HKV, D, V, LAYERS, EPS = 64, 96, 4, 2, 16, 80, 3, 1e-5
BLOCK = 16  # positions per cache block: a window of 20 leaves whole blocks behind
BASE = LayerSpec(hidden_size=E, ffn_size=F, n_heads=H, n_kv_heads=HKV, head_dim=D, rms_norm_eps=EPS,
                 rope_theta=10000.0)
THETAS = (10000.0, 1e6)  # RoPE table 0 and 1

# feature -> (the spec's fields, each layer's sliding window, each layer's RoPE table). Each spec
# compiles a stack of its own (about a minute on 2 cores), so the compiled tests run two: a Gemma 3
# mix (sliding-window layers on one RoPE base around a global layer on another) with Q/K/V bias as
# well, every feature on at once, and the same non-causal (no window: a draft's block attends it
# all). A feature's code is there only when it is on, so these specs hold all of it.
# tests/models/test_families.py runs Q/K/V bias alone (qwen2), QK-norm alone (qwen3) and a window
# alone (mistral) on the stack against transformers' logits.
EVERY = {"qkv_bias": True, "qk_norm": True, "post_norms": True, "activation": "gelu_tanh", "attn_scale": 0.2}
FEATURES = {
    "llama": ({}, (0, 0, 0), (0, 0, 0)),
    "qkv_bias": ({"qkv_bias": True}, (0, 0, 0), (0, 0, 0)),
    "every": (EVERY, (20, 0, 20), (0, 1, 0)),
    "every non-causal": (EVERY | {"causal": False}, (0, 0, 0), (0, 1, 0)),
}
COMPILED = ("every", "every non-causal")


class Tiny:
    """A random model of ``LAYERS`` layers with ``feature`` on, with its rows given as hidden
    states (no embedding): quantized (8-bit) and stacked, and the float32 decoders of the same
    (dequantized) weights. A non-causal stack has no head: its final norm's rows go through the
    LM head outside it, as a DFlash draft's do."""

    def __init__(self, feature: str, seed: int = 0):
        fields, windows, self.rope = FEATURES[feature]
        self.specs = [dataclasses.replace(BASE, sliding_window=w, rope_theta=THETAS[t], **fields)
                      for w, t in zip(windows, self.rope)]
        spec = self.specs[0]
        rng = np.random.default_rng(seed)

        def w(*shape, scale=0.2):
            return (scale * rng.standard_normal(shape)).astype(np.float32)

        def norm(n):
            return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

        layers = [LayerWeights(norm(E), quant.quantize(w((H + 2 * HKV) * D, E), 8), quant.quantize(w(E, H * D), 8),
                               norm(E), quant.quantize(w(2 * F, E), 8), quant.quantize(w(E, F, scale=0.15), 8),
                               qkv_bias=w((H + 2 * HKV) * D, scale=0.5) if spec.qkv_bias else None,
                               q_norm=norm(D) if spec.qk_norm else None, k_norm=norm(D) if spec.qk_norm else None,
                               post_attn_norm=norm(E) if spec.post_norms else None,
                               post_ffn_norm=norm(E) if spec.post_norms else None)
                  for _ in range(LAYERS)]
        self.final_norm = norm(E)
        lm_head = quant.quantize(w(V, E), 8)
        stacked, self.layers, head = stack_weights(layers, self.final_norm, lm_head if spec.causal else None)
        self.lm_head = lm_head if head is None else head
        self.stack = Stack(stacked, self.specs, None if head is None else V, rope=self.rope)
        self.float_layers = [dataclasses.replace(layer, **{name: np.ascontiguousarray(getattr(layer, name).dequantize())
                                                           for name in ("wqkv", "wo", "w_gate_up", "w_down")})
                             for layer in self.layers]
        self.float_decoders = [DecoderLayer(layer, s) for layer, s in zip(self.float_layers, self.specs)]
        tables = [cpu.rope_tables(D, 256, theta) for theta in THETAS]
        self.cos, self.sin = np.stack([c for c, _ in tables]), np.stack([s for _, s in tables])  # [2, P, D/2]

    def new_cache(self, dtype: type = np.float16) -> KVCache:
        return KVCache.private(LAYERS, HKV, D, 256, dtype=dtype, block_tokens=BLOCK)

    def step(self, rows: list[np.ndarray], caches: list[KVCache], logit_rows: list[int], *, path: str = "stack",
             team: Team | None = None, taps: tuple[int, ...] = ()):
        """One step of the sequences' hidden-state rows ``rows`` ``[T_b, E]`` on ``path``
        (``stack``, or ``float``: the float32 decoders): the logits of each sequence's last
        ``logit_rows`` rows, and the taps."""
        ends = np.cumsum([r.shape[0] for r in rows])
        spans = [RowSpan(c, c.length, slice(int(e) - r.shape[0], int(e)), n)
                 for c, r, e, n in zip(caches, rows, ends, logit_rows)]
        x = np.concatenate(rows)
        for s in spans:
            s.cache.reserve(s.n_rows)
        positions = np.concatenate([np.arange(s.start, s.start + s.n_rows) for s in spans])
        cos, sin = (np.ascontiguousarray(t[:, positions]) for t in (self.cos, self.sin))  # [2, R, D/2]
        last = np.concatenate([np.arange(s.rows.stop - s.n_logits, s.rows.stop) for s in spans])
        if path == "stack":
            stack = self.stack if team is None else Stack(self.stack.weights, self.specs, self.stack.vocab, team,
                                                          rope=self.rope)
            logits, tapped = stack(x, cos, sin, spans, taps)
            if stack.vocab is None:  # the final norm's rows
                logits = cpu.linear(logits, self.lm_head)
        else:
            tapped = []
            for i, decoder in enumerate(self.float_decoders):
                x = decoder(i, x, spans, cos[self.rope[i]], sin[self.rope[i]])
                if i in taps:
                    tapped.append(x)
            tapped = np.concatenate(tapped, axis=1) if taps else None
            logits = cpu.linear(cpu.rms_norm(x[last], self.final_norm, EPS), self.float_lm_head)
        for s in spans:
            s.cache.commit(s.n_rows)
        return logits, tapped

    @property
    def float_lm_head(self) -> np.ndarray:
        return self.lm_head.dequantize()


def _hidden(rng, n):
    return rng.standard_normal((n, E)).astype(np.float32)


def _steps(model: Tiny, **kwargs):
    """A prefill of two sequences beside a third, a decode row beside a 3-row verify pass, then a
    sequence's decode alone: each step's logits and taps, and the caches' keys and values."""
    rng = np.random.default_rng(1)
    xs = [_hidden(rng, n) for n in (7, 40, 17, 1, 3, 1)]
    a, b, c = model.new_cache(), model.new_cache(), model.new_cache()
    out = [model.step(xs[:3], [a, b, c], [1, 5, 0], taps=(0, 2), **kwargs),
           model.step(xs[3:5], [a, b], [1, 3], **kwargs),
           model.step(xs[5:], [b], [1], **kwargs)]
    return out, [(x.keys(), x.values()) for x in (a, b, c)]


@pytest.fixture(scope="module", params=COMPILED)
def compiled_model(request) -> Tiny:
    return Tiny(request.param)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_stack_gives_the_same_bits_on_any_number_of_threads(compiled_model, threads):
    model = compiled_model
    want, want_caches = _steps(model)
    team = Team(threads)
    try:
        got, got_caches = _steps(model, team=team)
    finally:
        team.close()
    for (gl, gt), (wl, wt) in zip(got, want):
        assert np.array_equal(gl, wl) and (gt is None and wt is None or np.array_equal(gt, wt))
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert np.array_equal(gk, wk) and np.array_equal(gv, wv)
    assert np.all(np.isfinite(got[0][0])) and got[0][0].shape == (6, V)


def test_a_sequence_alone_gets_the_bits_it_gets_in_a_batch(compiled_model):
    model = compiled_model
    rng = np.random.default_rng(2)
    other, x, more = _hidden(rng, 9), _hidden(rng, 40), _hidden(rng, 2)
    alone_cache = model.new_cache()
    alone = model.step([x], [alone_cache], [5])[0]
    alone_next = model.step([more], [alone_cache], [2])[0]
    caches = [model.new_cache(), model.new_cache()]
    batched = model.step([other, x], caches, [1, 5])[0]
    batched_next = model.step([other[:1], more], caches, [1, 2])[0]
    assert np.array_equal(alone, batched[1:]) and np.array_equal(alone_next, batched_next[1:])


def _rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _numpy_forward(model: Tiny, x: np.ndarray) -> np.ndarray:
    """The logits of one sequence's rows ``x`` ``[N, E]`` at positions ``0 .. N-1``, in one step, in
    float64 from the formulas (Hugging Face's Qwen2 / Qwen3 / Gemma 3 / Mistral layers; a
    non-causal layer attends every position, as a DFlash draft's block), on the float32
    weights."""
    n, x = x.shape[0], x.astype(np.float64)
    positions = np.arange(n)
    for layer, spec, table in zip(model.float_layers, model.specs, model.rope):
        inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, D, 2) / D)
        angles = positions[:, None] * inv_freq[None, :]  # [N, D/2]
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        qkv = _rms_norm(x, layer.attn_norm) @ layer.wqkv.T
        if spec.qkv_bias:
            qkv = qkv + layer.qkv_bias
        q = qkv[:, :H * D].reshape(n, H, D)
        k = qkv[:, H * D:(H + HKV) * D].reshape(n, HKV, D)
        v = qkv[:, (H + HKV) * D:].reshape(n, HKV, D)
        if spec.qk_norm:
            q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)

        def rope(t):
            t1, t2 = t[..., :D // 2], t[..., D // 2:]
            return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)

        q, k = rope(q), rope(k)
        scale = spec.attn_scale or D ** -0.5
        p, j = positions[:, None], positions[None, :]
        allowed = ((j <= p) | (not spec.causal)) & ((p - j < spec.sliding_window) if spec.sliding_window else True)
        attn = np.empty((n, H, D))
        for head in range(H):
            kv = head // (H // HKV)
            scores = np.where(allowed, q[:, head] @ k[:, kv].T * scale, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            attn[:, head] = weights / weights.sum(axis=1, keepdims=True) @ v[:, kv]
        o = attn.reshape(n, H * D) @ layer.wo.T
        x = x + (_rms_norm(o, layer.post_attn_norm) if spec.post_norms else o)
        gate_up = _rms_norm(x, layer.ffn_norm) @ layer.w_gate_up.T
        g, u = gate_up[:, :F], gate_up[:, F:]
        if spec.activation == "gelu_tanh":
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        else:
            act = g / (1 + np.exp(-g))
        down = (act * u) @ layer.w_down.T
        x = x + (_rms_norm(down, layer.post_ffn_norm) if spec.post_norms else down)
    return _rms_norm(x, model.final_norm) @ model.float_lm_head.T


def test_the_float32_and_quantized_paths_match_numpy(compiled_model):
    """Causal: a 40-row prefill then a decode row; non-causal: a 40-row step (a later row would
    change what the earlier ones attended): the float32 reference within float32 rounding of the
    numpy forward pass, the quantized stack within its activations' quantization and its float16
    keys and values (3.2e-4 of the logits' spread on this model)."""
    model = compiled_model
    rng = np.random.default_rng(3)
    x = _hidden(rng, 41)
    causal = model.specs[0].causal
    want = _numpy_forward(model, x)[[39, 40]] if causal else _numpy_forward(model, x[:40])[[38, 39]]  # [2, V]
    spread = np.abs(want).max()
    for path, cache, bound in (("float", model.new_cache(np.float32), 1e-5), ("stack", model.new_cache(), 5e-3)):
        if causal:
            got = np.concatenate([model.step([x[:40]], [cache], [1], path=path)[0],
                                  model.step([x[40:]], [cache], [1], path=path)[0]])
        else:
            got = model.step([x[:40]], [cache], [2], path=path)[0]
        assert np.abs(got - want).max() < bound * spread, (path, np.abs(got - want).max() / spread)


def test_a_layer_refuses_weights_its_spec_does_not_read():
    model = Tiny("qkv_bias")
    with pytest.raises(ModelFormatError, match="qkv_bias"):
        DecoderLayer(dataclasses.replace(model.layers[0], qkv_bias=None), model.specs[0])
    with pytest.raises(ModelFormatError, match=r"qk_norm is False but its q_norm is given"):
        DecoderLayer(dataclasses.replace(model.layers[0], q_norm=np.ones(D, np.float32)), model.specs[0])
    with pytest.raises(ModelFormatError, match=r"qkv_bias has shape \(8,\)"):
        DecoderLayer(dataclasses.replace(model.layers[0], qkv_bias=np.ones(8, np.float32)), model.specs[0])


def test_the_spec_names_what_the_layer_does_not_run():
    assert dataclasses.replace(BASE, qkv_bias=True, qk_norm=True, post_norms=True, activation="gelu_tanh",
                               sliding_window=4096, attn_scale=0.0625).unsupported() == []
    assert BASE.softmax_scale == np.float32(0.25) and dataclasses.replace(BASE, attn_scale=0.1).softmax_scale == \
        np.float32(0.1)
    problems = dataclasses.replace(BASE, activation="relu", sliding_window=8, causal=False).unsupported()
    assert len(problems) == 2 and "relu" in problems[0] and "non-causal" in problems[1]
    with pytest.raises(ModelFormatError, match="relu"):
        DecoderLayer(Tiny("llama").layers[0], dataclasses.replace(BASE, activation="relu"))


def test_a_stack_takes_layers_that_differ_in_window_and_rope_alone():
    gemma = [dataclasses.replace(BASE, sliding_window=w, rope_theta=t) for w, t in ((512, 1e4), (0, 1e6))]
    assert shared_spec(gemma) == dataclasses.replace(BASE, rope_theta=0.0)
    with pytest.raises(ModelFormatError, match="qk_norm, attn_scale"):
        shared_spec([BASE, dataclasses.replace(BASE, qk_norm=True, attn_scale=0.5)])
    model = Tiny("llama")
    with pytest.raises(ModelFormatError, match="qkv_bias"):
        Stack(model.stack.weights, [dataclasses.replace(BASE, qkv_bias=True)] * LAYERS, V)
