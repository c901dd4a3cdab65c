"""The DFlash draft model on the cpu backend: a few Llama layers that draft a whole block in one
forward pass (float32 on the numpy reference layer, 8-bit as one compiled step on the kernel team).

DFlash (Jian Chen, Yesheng Liang, Zhijian Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036, 2026) drafts ``block_size - 1`` tokens at once: the block
``[anchor, MASK x 7]`` runs through a small decoder whose every layer also attends, through its own
``Wk``/``Wv`` ("KV injection"), to context features fused from hidden states of the target. This
module implements the contract of ``docs/dflash.md`` (architecture, file format, the draft's side
of a speculative step); the training pipeline implements the same contract in torch.

Axis legend: E hidden size (the target's), n taps, T positions, B block size (anchor + masks),
K = B - 1 drafted tokens, H / Hkv query / key-value heads, D head dim, F FFN width, V vocabulary,
Ld draft layers, S cache capacity (positions). All arrays are float32 unless stated.

The draft has no embedding or LM head of its own: it reads the target's arrays (the same objects,
not copies). Its per-sequence cache (``DraftCache``) holds the projected context K/V of every
committed token, one position per target position; the block's own K/V are written past
``length`` as scratch and never committed, so the next ``add_context`` overwrites them.

Two file formats load into the same draft (docs/dflash.md, "Files: a draft directory" and
"Published drafts"): ours (``architecture`` "dflash-llama") and the public DFlash format of the
``dflash`` package (a Hugging Face Qwen3 ``config.json`` with ``architectures``
``["DFlashDraftModel"]``, bfloat16 weights, QK-norm, the mask row taken from the target's
embedding), which ``public_config`` maps onto a ``DFlashConfig``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from flm_runtime.errors import ModelFormatError
from flm_runtime.families import rope
from flm_runtime.families.checkpoint import WeightTaker
from flm_runtime.families.llama import KV_PROJ, fuse_layer, layer_weight_shapes, take_fused
from flm_runtime.kernels import cpu, quant
from flm_runtime.kv_cache import KVCache
from flm_runtime.layers.decoder import DecoderLayer, LayerWeights, RowSpan, quantized, rope_heads
from flm_runtime.layers.spec import LayerSpec
from flm_runtime.layers.stack import Stack, stack_weights
from flm_runtime.model_config import ModelConfig
from flm_runtime.outputs import Proposal
from flm_runtime.safetensors_file import read_safetensors

log = logging.getLogger(__name__)

ARCHITECTURE = "dflash-llama"
PUBLIC_ARCHITECTURE = "DFlashDraftModel"  # the dflash package's draft class, a public config's ``architectures``
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# The draft's context K/V cache: a KVCache with one "layer" per draft layer (growable, ``trim``,
# ``length`` = context positions held). A named alias, not a new class: same bookkeeping.
DraftCache = KVCache


@dataclass(frozen=True)
class DFlashConfig:
    """A draft directory's ``config.json`` (docs/dflash.md, "Files"); unknown keys are ignored.

    Attributes:
        target_layer_ids: 0-based target layers tapped, in concatenation order (n of them).
        num_hidden_layers: draft layers (Ld, 1-3).
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
            rms_norm_eps, rope_theta: as in a Llama ``config.json``; equal to the target's.
        mask_token_id: the target vocabulary id whose embedding initialised ``mask_embedding``.
        block_size: B, the anchor plus B - 1 masks (8).
        draft_vocab_size: Vd, target tokens the draft can propose (its ``draft_vocab`` tensor);
            0 means the target's whole vocabulary (docs/dflash.md, "Draft vocabulary").
        max_position_embeddings: positions the training's RoPE tables span (the target's context
            length); serving sizes its tables from the target instead.
        qk_norm: an RMSNorm over each query and key head before RoPE (``layers.{i}.self_attn.q_norm``
            / ``k_norm`` ``[D]``), on the block's keys and the context's alike (public drafts).
        rope_scaling: a Hugging Face ``rope_scaling`` mapping (``families.rope``), or None.
        input_embedding_scale: multiplies the block's input rows (anchor and masks).
        output_multiplier: multiplies the logits; final_logit_softcapping: ``c tanh(z / c)``
            after it (0: none).
        vocab_size, num_target_layers: the target's vocabulary and layers the draft states it
            was built for (0: not stated); checked against the target when stated.
        architecture: ``"dflash-llama"`` (our format), or ``"DFlashDraftModel"`` for a public
            draft mapped by ``public_config``: its heads, FFN width, RoPE and eps are its own,
            not copied from the target (``check_target``).
        target: registry tag of the target it was trained for (e.g. ``"smollm2:135m"``).
        target_sha256: sha256 of the target's weight file, or None.
        training: free-form provenance.

    ``target``, ``target_sha256`` and ``training`` are provenance and take no part in equality:
    two configs are equal when they describe the same draft (a warm start checks that).
    """

    target_layer_ids: tuple[int, ...]
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mask_token_id: int
    block_size: int = 8
    draft_vocab_size: int = 0
    max_position_embeddings: int = 8192
    qk_norm: bool = False
    rope_scaling: dict | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    vocab_size: int = 0
    num_target_layers: int = 0
    architecture: str = ARCHITECTURE
    target: str = field(default="", compare=False)
    target_sha256: str | None = field(default=None, compare=False)
    training: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = []
        if self.architecture not in (ARCHITECTURE, PUBLIC_ARCHITECTURE):
            problems.append(f"architecture is {self.architecture!r}, expected {ARCHITECTURE!r}")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2, got {self.block_size}")
        if self.draft_vocab_size < 0:
            problems.append(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if self.num_hidden_layers < 1:
            problems.append(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        try:  # parsed once, so that a config with a scaling we lack is refused here
            object.__setattr__(self, "_scaling", rope.scaling_from_hf(self.rope_scaling, self.max_position_embeddings,
                                                                      source="key 'rope_scaling'"))
        except ModelFormatError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_dict(cls, config: dict) -> DFlashConfig:
        """Build from a ``config.json`` mapping.

        Raises:
            ValueError: a required key is missing, a value of the wrong JSON type (a string where
                a number belongs ...) or out of range, naming the key.
        """
        values = {f.name: config[f.name] for f in fields(cls) if config.get(f.name) is not None}
        wrong = [f"key {name!r} is {value!r}, expected {_JSON_TYPES[name][1]}" for name, value in values.items()
                 if not _JSON_TYPES[name][0](value)]
        if wrong:
            raise ValueError("; ".join(wrong))
        try:
            return cls(**values)
        except TypeError as e:  # a missing required key
            raise ValueError(str(e).replace("__init__()", "config.json")) from e

    def to_dict(self) -> dict:
        """The ``config.json`` mapping (``from_dict``'s inverse)."""
        return asdict(self) | {"target_layer_ids": list(self.target_layer_ids)}

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def scaling(self) -> rope.RopeScaling | None:
        """``rope_scaling`` parsed (``families.rope.scaling_from_hf``), or None."""
        return self._scaling

    @property
    def n_draft(self) -> int:
        """K: tokens drafted per step (``block_size - 1``)."""
        return self.block_size - 1


def check_target(config: DFlashConfig, target: ModelConfig, *, target_sha256: str | None = None,
                 source: str = "draft") -> None:
    """Refuse a draft that does not fit ``target``.

    What crosses between the two is always checked: the hidden size (the draft reads the target's
    embedding and LM head), tapped layers and mask id in range, and the vocabulary and layer count
    the draft states it was built for. Our format's drafts copy the rest of their geometry from
    the target (heads, KV heads, head dim, FFN width, RoPE base, RMSNorm eps), which is checked
    too; a public draft's layers are its own. ``target_sha256`` (the target weight file's
    hash, when the caller knows it cheaply) is compared with the draft's ``target_sha256`` when both
    are known; otherwise only the geometry is checked, and that is logged.

    Raises:
        ModelFormatError: a mismatch, naming the key and both values.
    """
    copied = config.architecture == ARCHITECTURE
    equal = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    problems = [f"{k} is {getattr(config, k)} but the target's is {getattr(target, k)}"
                for k in (equal if copied else equal[:1]) if getattr(config, k) != getattr(target, k)]
    for k in ("rope_theta", "rms_norm_eps") if copied else ():
        if not math.isclose(getattr(config, k), getattr(target, k), rel_tol=1e-6):
            problems.append(f"{k} is {getattr(config, k)} but the target's is {getattr(target, k)}")
    for k, target_k in (("vocab_size", "vocab_size"), ("num_target_layers", "num_hidden_layers")):
        if getattr(config, k) and getattr(config, k) != getattr(target, target_k):
            problems.append(f"{k} is {getattr(config, k)} but the target's {target_k} is {getattr(target, target_k)}")
    if not all(0 <= i < target.num_hidden_layers for i in config.target_layer_ids):
        problems.append(f"target_layer_ids {list(config.target_layer_ids)} fall outside the target's "
                        f"{target.num_hidden_layers} layers")
    if config.draft_vocab_size > target.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocabulary "
                        f"of {target.vocab_size}")
    if not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} is outside the target's vocabulary "
                        f"of {target.vocab_size}")
    if config.target_sha256 and target_sha256:
        if config.target_sha256.lower() != target_sha256.lower():
            problems.append(f"it was trained for a target file with sha256 {config.target_sha256}, "
                            f"this target's is {target_sha256}")
    else:
        log.info("%s: target weight hash not compared (draft's: %s, target's: %s); geometry only",
                 source, config.target_sha256, target_sha256)
    if problems:
        raise ModelFormatError(f"{source} does not fit its target: {'; '.join(problems)}")


class DFlashDraft:
    """A DFlash draft on the cpu backend.

    Args:
        config: the draft's hyper-parameters.
        weights: float32-convertible arrays keyed by the names of docs/dflash.md ("Files").
        embed: ``[V, E]`` the target's embedding (shared, not copied).
        lm_head: ``[V, E]`` the target's LM head (shared, not copied; with a draft vocabulary its
            ``Vd`` rows are gathered once into ``head``).
        max_positions: the target's context length (tokens): caches and RoPE tables span it.
        bits: None keeps the file's float32 matrices and runs the numpy reference layer
            (``layers.decoder``; training compares against it); 8 quantizes every matrix
            (``quant.quantize``, symmetric 8-bit blocks) and runs the layers as the quantized
            target's run, one compiled step on the kernel team (``layers.stack``, non-causal,
            without a head: the draft scores ``head`` itself), over float16 caches. ``load``
            picks 8 for a quantized target.

    Attributes:
        vocab: ``[Vd]`` int64 target ids of the draft vocabulary (ascending), or None (all ``V``).
        head: ``[Vd, E]`` the LM head rows the draft scores.
        layers: the layers' weights.
        stack: an 8-bit draft's layers and final norm (``layers.stack.Stack``), else None.
        decoders: a float32 draft's layers (non-causal ``DecoderLayer``), else None.
        quantized: an 8-bit draft (its layers compiled).
        kv_dtype: its caches' element type (float16 for an 8-bit draft, else float32).

    Raises:
        ModelFormatError: a tensor is missing, unexpected or misshapen, or ``draft_vocab`` is not
            ascending distinct ids of the target's vocabulary.
    """

    def __init__(self, config: DFlashConfig, weights: dict[str, np.ndarray], *, embed: np.ndarray,
                 lm_head: np.ndarray, max_positions: int, bits: int | None = None):
        c = config
        e, d = c.hidden_size, c.head_dim
        assert embed.shape[1] == e and lm_head.shape == embed.shape, "target embedding/LM head width != E"
        self.config = c
        self.embed = embed  # [V, E] the target's own array
        self.max_positions = max_positions
        expected = set(draft_weight_shapes(c))
        if unexpected := sorted(set(weights) - expected):
            raise ModelFormatError(f"unexpected tensors in the draft: {', '.join(unexpected[:8])} "
                                   f"(names carry no model prefix; {c.num_hidden_layers} layers)")
        self.vocab = _draft_vocab(weights, c, lm_head.shape[0])  # [Vd] int64 or None
        self.head = lm_head if self.vocab is None else cpu.take_rows(lm_head, self.vocab)  # [Vd, E]
        assert bits in (None, 8), f"draft matrices are float32 or 8-bit, not {bits}-bit"
        float_take = WeightTaker({k: v for k, v in weights.items() if k != "draft_vocab"})

        def take(name: str, shape: tuple[int, ...]) -> cpu.Weight:
            a = float_take(name, shape)
            return quant.quantize(a, bits) if bits and len(shape) == 2 else a

        self.fc = take("fc.weight", (e, c.n_taps * e))  # [E, n*E]
        self.hidden_norm = take("hidden_norm.weight", (e,))
        self.mask_embedding = take("mask_embedding", (e,))
        self.norm = take("norm.weight", (e,))
        self.layers = [_layer_weights(take, c, f"layers.{i}.") for i in range(c.num_hidden_layers)]
        spec = replace(LayerSpec.of(c, causal=False), qk_norm=c.qk_norm)
        for w in self.layers:
            w.check(spec)
        self.quantized = quantized(self.layers)
        self.stack, self.decoders = None, None
        if self.quantized:  # the target's head is scored outside the step: never a second copy of it
            stacked, self.layers, _ = stack_weights(self.layers, self.norm, None)
            self.stack = Stack(stacked, [spec] * c.num_hidden_layers, None)
        else:
            self.decoders = [DecoderLayer(w, spec) for w in self.layers]
        self.kv_dtype = np.float16 if self.quantized else np.float32
        # add_context's projection, each layer's Wk and Wv alone: a product of all wqkv's rows rounds differently
        self.context_kv = [take_fused(take, c, f"layers.{i}.", KV_PROJ) for i in range(c.num_hidden_layers)]  # [2*Hkv*D, E]
        self.rope_cos, self.rope_sin = rope.rope_tables(d, max_positions, c.rope_theta, c.scaling)  # [P, D/2]

    @classmethod
    def load(cls, path: str | Path, target, *, target_sha256: str | None = None) -> DFlashDraft:
        """Load a draft directory (``config.json`` + ``model.safetensors``) for ``target``, in our
        format or the public one (``read_config`` tells them apart). A public draft's tensors may
        be bfloat16; its mask row is the target's embedding of ``mask_token_id`` times
        ``input_embedding_scale``, as the ``dflash`` package builds its block.

        Args:
            path: the draft directory.
            target: the loaded target (``CausalLM``): its config is checked against the draft's
                and its ``embed`` / ``lm_head`` arrays are shared; a quantized one (``kv_dtype``
                float16) gets an 8-bit draft (``bits``).
            target_sha256: sha256 of the target's weight file when known cheaply (the registry's
                recorded, verified hash); None checks geometry only (see ``check_target``).

        Raises:
            FileNotFoundError: a file is missing.
            ModelFormatError: unreadable or mismatched files, naming the file.
        """
        path = Path(path)
        config = read_config(path / CONFIG_FILE)
        check_target(config, target.config, target_sha256=target_sha256, source=f"draft {path}")
        if config.architecture == ARCHITECTURE:
            weights = read_weights(path / WEIGHTS_FILE)
        else:
            weights = read_safetensors(path / WEIGHTS_FILE)
            mask_row = cpu.embedding(target.embed, np.array([config.mask_token_id]))[0]  # [E]
            weights["mask_embedding"] = mask_row * np.float32(config.input_embedding_scale)
        try:
            return cls(config, weights, embed=target.embed, lm_head=target.lm_head,
                       max_positions=target.config.max_position_embeddings,
                       bits=8 if target.kv_dtype == np.float16 else None)
        except ModelFormatError as e:
            raise ModelFormatError(f"{path / WEIGHTS_FILE}: {e}") from e

    def new_cache(self, capacity: int = 0) -> DraftCache:
        """An empty context K/V cache for one sequence (``capacity`` in tokens is a hint)."""
        c = self.config
        return DraftCache.private(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.max_positions, capacity,
                          self.kv_dtype)

    def add_context(self, cache: DraftCache, taps: np.ndarray, start_position: int) -> None:
        """Project committed tokens' taps to context K/V once and append them to ``cache``.

        ``c = RMSNorm_hidden(taps @ fc^T)``; per draft layer the context keys are ``RoPE(c Wk^T)``
        at the tokens' own positions and the values ``c Wv^T`` (no input norm: docs/dflash.md).

        Args:
            cache: the sequence's draft cache; ``cache.length == start_position``.
            taps: ``[T, n*E]`` the target's taps at positions ``start_position ..`` (T may be 0).
            start_position: position of the first of them.
        """
        c = self.config
        t = taps.shape[0]
        assert taps.shape == (t, c.n_taps * c.hidden_size), f"taps {taps.shape} != [T, {c.n_taps}*E]"
        assert cache.length == start_position, f"draft cache holds {cache.length}, taps start at {start_position}"
        if t == 0:
            return
        with cpu.forward_pass(t):
            ctx = cpu.rms_norm(cpu.linear(taps, self.fc), self.hidden_norm, c.rms_norm_eps)  # [T, E]
            cos = self.rope_cos[start_position : start_position + t]  # [T, D/2]
            sin = self.rope_sin[start_position : start_position + t]
            cache.reserve(t)
            hkv, d = c.num_key_value_heads, c.head_dim
            for i, wkv in enumerate(self.context_kv):
                kv = cpu.linear(ctx, wkv)  # [T, 2*Hkv*D]
                if c.qk_norm:  # the key heads' norm, as the block's keys get it in the layer
                    kv = cpu.qk_norm(kv, self.layers[i].k_norm, self.layers[i].k_norm, 0, hkv, d, c.rms_norm_eps)
                k = rope_heads(kv, cos, sin, 0, hkv, d)  # [T, Hkv, D]
                cache.write(i, k.transpose(1, 0, 2), kv[:, hkv * d:].reshape(t, hkv, d).transpose(1, 0, 2))
            cache.commit(t)

    def draft_logits(self, cache: DraftCache, anchor_id: int, start: int) -> np.ndarray:
        """Logits of block rows ``1 .. B-1`` over the draft vocabulary, the predictions of
        ``d1 .. dK`` (row k predicts the token at block index k: no shift; column j is target id
        ``vocab[j]``, or j without a draft vocabulary).

        Args:
            cache: holds the context of positions ``0 .. start-1`` (``cache.length == start``).
            anchor_id: the last committed token, at position ``start``.
            start: the anchor's position.
        Returns:
            ``[K, Vd]`` float32.
        """
        assert cache.length == start, f"draft cache holds {cache.length} positions, the anchor is at {start}"
        return self.draft_logits_batch([cache], [anchor_id])[0]

    def draft_logits_batch(self, caches: list[DraftCache], anchor_ids: list[int],
                           n_drafts: int | None = None) -> np.ndarray:
        """``draft_logits`` of ``S`` sequences' blocks at once: every weight matrix multiplies the
        ``S * B`` block rows of all of them in one product; attention runs per sequence, over its
        own cache. Sequence ``s``'s anchor sits at ``caches[s].length``. Rows ``s`` equal
        ``draft_logits(caches[s], anchor_ids[s], caches[s].length)`` up to float rounding.

        Args:
            n_drafts: K, the drafted tokens wanted (default all ``B - 1``). The block runs cut to
                its first ``K + 1`` rows, the anchor and K masks: the masks past K would only
                be attended, and the products are compute-bound in rows (docs/dflash.md,
                "Draft architecture"). The draft was trained on whole blocks, so a cut block
                drafts slightly differently.
        Returns:
            ``[S, K, Vd]`` float32.
        """
        c = self.config
        k_out = c.block_size - 1 if n_drafts is None else n_drafts
        assert 1 <= k_out <= c.block_size - 1, f"n_drafts {n_drafts} outside 1..{c.block_size - 1}"
        b = k_out + 1
        starts = [cache.length for cache in caches]
        assert all(st + b <= self.max_positions for st in starts), "a block runs past the context"
        n_seq = len(caches)
        x = np.empty((n_seq, b, c.hidden_size), dtype=np.float32)  # [S, B, E]
        x[:, 0] = cpu.embedding(self.embed, np.asarray(anchor_ids, dtype=np.int64)) * np.float32(c.input_embedding_scale)
        x[:, 1:] = self.mask_embedding
        x = x.reshape(n_seq * b, c.hidden_size)  # [S*B, E]
        positions = (np.asarray(starts)[:, None] + np.arange(b)).reshape(-1)  # [S*B]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [S*B, D/2]
        # rows 1..K of each block, its span's last K rows, are those the final norm and the head take
        spans = [RowSpan(cache, st, slice(s * b, (s + 1) * b), k_out)
                 for s, (cache, st) in enumerate(zip(caches, starts))]
        with cpu.forward_pass(n_seq * b):
            for cache in caches:
                cache.reserve(b)  # the block's K/V go past `length` as scratch: never committed
            if self.stack is not None:
                h_out, _ = self.stack(x, cos[None], sin[None], spans, ())  # [S*K, E] the final norm's rows
            else:
                for i, decoder in enumerate(self.decoders):
                    x = decoder(i, x, spans, cos, sin)  # [S*B, E]
                hidden = x.reshape(n_seq, b, -1)[:, 1:].reshape(n_seq * k_out, -1)  # rows 1..K of each block
                h_out = cpu.rms_norm(hidden, self.norm, c.rms_norm_eps)  # [S*K, E]
            logits = cpu.linear(h_out, self.head) * np.float32(c.output_multiplier)  # [S*K, Vd]
            if softcap := np.float32(c.final_logit_softcapping):
                logits = np.tanh(logits / softcap) * softcap
            return np.ascontiguousarray(logits).reshape(n_seq, k_out, -1)  # [S, K, Vd]

    def draft_block(self, cache: DraftCache, anchor_id: int, start: int) -> np.ndarray:
        """Greedy draft: ``d1 .. dK`` = argmax of block rows ``1 .. K`` (see ``draft_logits``),
        mapped to target ids.

        Returns:
            ``[K]`` int64 target token ids.
        """
        assert cache.length == start, f"draft cache holds {cache.length} positions, the anchor is at {start}"
        return self.draft_blocks([cache], [anchor_id]).ids[0]

    def draft_blocks(self, caches: list[DraftCache], anchor_ids: list[int], n_drafts: int | None = None) -> Proposal:
        """``draft_block`` for ``S`` sequences in one batched draft pass (``draft_logits_batch``): the
        first ``n_drafts`` (K, default ``B - 1``) drafted tokens of each, with the draft's
        confidence in each.

        Returns:
            a ``Proposal`` of ``[S, K]`` arrays.
        """
        logits = self.draft_logits_batch(caches, anchor_ids, n_drafts)  # [S, K, Vd]
        best = np.argmax(logits, axis=-1)  # [S, K] draft-vocabulary index
        top = np.take_along_axis(logits, best[..., None], axis=-1)  # [S, K, 1]
        confidence = 1.0 / np.exp(logits - top).sum(axis=-1)  # [S, K]: softmax at the argmax
        ids = best if self.vocab is None else self.vocab[best]
        return Proposal(ids.astype(np.int64), confidence.astype(np.float32))


def draft_weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft's ``model.safetensors`` holds, with its shape (docs/dflash.md)."""
    e = config.hidden_size
    shapes = {"fc.weight": (e, config.n_taps * e), "hidden_norm.weight": (e,), "mask_embedding": (e,),
              "norm.weight": (e,)}
    if config.draft_vocab_size:
        shapes["draft_vocab"] = (config.draft_vocab_size,)
    layer = layer_weight_shapes(config)
    if config.qk_norm:
        layer |= dict.fromkeys(QK_NORMS, (config.head_dim,))
    for i in range(config.num_hidden_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # a layer's QK-norm weights, below its prefix


def _layer_weights(take: WeightTaker, config: DFlashConfig, prefix: str) -> LayerWeights:
    """One draft layer's ``LayerWeights``: a Llama layer, with QK-norm when the config has it (as the
    Qwen3 family's)."""
    weights = fuse_layer(take, config, prefix)
    if not config.qk_norm:
        return weights
    q_norm, k_norm = (take(prefix + name, (config.head_dim,)) for name in QK_NORMS)
    return replace(weights, q_norm=q_norm, k_norm=k_norm)


def _draft_vocab(weights: dict[str, np.ndarray], config: DFlashConfig, vocab_size: int) -> np.ndarray | None:
    """The ``draft_vocab`` tensor checked against the config and the target's ``vocab_size``.

    Raises:
        ModelFormatError: missing, misshapen, not integer, or not ascending distinct ids in range.
    """
    if not config.draft_vocab_size:
        return None
    if "draft_vocab" not in weights:
        raise ModelFormatError(f"tensor 'draft_vocab' is missing (draft_vocab_size is {config.draft_vocab_size})")
    v = weights["draft_vocab"]
    if v.shape != (config.draft_vocab_size,) or v.dtype.kind not in "iu":
        raise ModelFormatError(f"tensor 'draft_vocab' is {v.dtype} {tuple(v.shape)}, expected integer "
                               f"({config.draft_vocab_size},)")
    v = v.astype(np.int64)
    if v[0] < 0 or v[-1] >= vocab_size or (v.size > 1 and not (np.diff(v) > 0).all()):
        raise ModelFormatError(f"tensor 'draft_vocab' must hold ascending distinct token ids in [0, {vocab_size})")
    return v


def _integer(v: object) -> bool:
    return type(v) is int  # JSON's true and false are no counts


def _number(v: object) -> bool:
    return type(v) in (int, float)


# DFlashConfig field -> (test of its JSON value, what it must be).
_JSON_TYPES = {
    **dict.fromkeys(("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "mask_token_id", "block_size", "draft_vocab_size",
                     "max_position_embeddings", "vocab_size", "num_target_layers"), (_integer, "an integer")),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier",
                     "final_logit_softcapping"), (_number, "a number")),
    "qk_norm": (lambda v: type(v) is bool, "true or false"),
    "rope_scaling": (lambda v: type(v) is dict, "an object"),
    **dict.fromkeys(("architecture", "target", "target_sha256"), (lambda v: type(v) is str, "a string")),
    "target_layer_ids": (lambda v: type(v) in (list, tuple) and all(map(_integer, v)), "a list of integers"),
    "training": (lambda v: type(v) is dict, "an object"),
}


# The dflash package's DFlash 2 drafts (dynamic convolutions around each layer's attention and
# FFN, a candidate selector over the top logits): their class and config keys.
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel",)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The taps of a public draft whose config names none: the ``dflash`` package's
    ``build_target_layer_ids`` (one draft layer: the middle target layer; else ``round(1 + i *
    (L - 4) / (n - 1))`` for ``i < n``, n the draft layers, with Python's ``round``)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def public_config(data: dict) -> DFlashConfig:
    """The ``DFlashConfig`` of a public DFlash draft's ``config.json``: a Hugging Face Qwen3 config
    (the ``dflash`` package's ``DFlashDraftModel``) whose DFlash keys (``target_layer_ids``,
    ``mask_token_id``, ``block_size``, ``input_embedding_scale``, ``output_multiplier``,
    ``final_logit_softcapping``) are read from its ``dflash_config`` object first, then from the
    top level, as the package's ``_draft_value`` reads them. Missing values take transformers'
    ``Qwen3Config`` defaults (KV heads = heads, head dim 128, eps 1e-6, RoPE base 10000, context
    32768), a block of 16, and taps from ``build_target_layer_ids`` (``num_target_layers``
    then needed); the RoPE base and scaling may come as transformers 5's ``rope_parameters``.

    Raises:
        ValueError: a DFlash 2 draft, sliding-window or causal draft layers, attention biases
            (features this runtime does not run), or a missing, mistyped or out-of-range key,
            each naming its key.
    """
    dflash = data.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError(f"key 'dflash_config' is {dflash!r}, expected an object")

    def value(key: str, default=None):
        return dflash.get(key, data.get(key, default))

    if dflash2 := sorted(set(DFLASH2_ARCHITECTURES) & set(data.get("architectures") or ())):
        raise ValueError(f"architectures {dflash2}: DFlash 2 drafts are not supported yet")
    if dflash2 := [key for key in DFLASH2_KEYS if value(key) is not None]:
        raise ValueError(f"key {dflash2[0]!r}: DFlash 2 drafts (convolutions, candidate selector) are not supported yet")
    if "sliding_attention" in (data.get("layer_types") or ()) or data.get("use_sliding_window"):
        key = "use_sliding_window" if data.get("use_sliding_window") else "layer_types"
        raise ValueError(f"key {key!r}: sliding-window draft layers are not supported yet")
    if data.get("is_causal"):
        raise ValueError("key 'is_causal': causal draft layers are not supported (the block attends both ways)")
    if data.get("attention_bias"):
        raise ValueError("key 'attention_bias': attention biases are not supported (no bias of o_proj runs here)")
    rope_parameters = data.get("rope_parameters") or {}
    rope_scaling = data.get("rope_scaling") or (rope_parameters if rope_parameters.get("rope_type", "default")
                                                != "default" else None)
    layers, taps = data.get("num_hidden_layers"), value("target_layer_ids")
    if taps is None:
        if not (_integer(data.get("num_target_layers")) and _integer(layers)):
            raise ValueError("key 'target_layer_ids' is missing, and 'num_target_layers' and 'num_hidden_layers' "
                             "do not give it")
        taps = build_target_layer_ids(data["num_target_layers"], layers)
    heads = data.get("num_attention_heads")
    return DFlashConfig.from_dict({
        "target_layer_ids": taps, "num_hidden_layers": layers, "hidden_size": data.get("hidden_size"),
        "intermediate_size": data.get("intermediate_size"), "num_attention_heads": heads,
        "num_key_value_heads": data.get("num_key_value_heads", heads), "head_dim": data.get("head_dim", 128),
        "rms_norm_eps": data.get("rms_norm_eps", 1e-6),
        "rope_theta": data.get("rope_theta", rope_parameters.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling, "max_position_embeddings": data.get("max_position_embeddings", 32768),
        "mask_token_id": value("mask_token_id"), "block_size": value("block_size", 16), "qk_norm": True,
        "input_embedding_scale": value("input_embedding_scale"), "output_multiplier": value("output_multiplier"),
        "final_logit_softcapping": value("final_logit_softcapping"), "vocab_size": data.get("vocab_size"),
        "num_target_layers": data.get("num_target_layers"), "architecture": PUBLIC_ARCHITECTURE})


def read_config(path: Path) -> DFlashConfig:
    """Parse a draft's ``config.json``: ours, or a public DFlash draft's (``public_config``), told
    apart by ``architectures`` naming a dflash package class or a ``dflash_config`` object.

    Raises:
        FileNotFoundError: no such file.
        ModelFormatError: not JSON, or not a valid DFlash config, or a public draft with a
            feature not run here (naming the key and the file).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not a JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    public = bool({PUBLIC_ARCHITECTURE, *DFLASH2_ARCHITECTURES} & set(data.get("architectures") or ())
                  or "dflash_config" in data)
    try:
        return public_config(data) if public else DFlashConfig.from_dict(data)
    except ValueError as e:
        raise ModelFormatError(f"{path}: {e}") from e


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """Read a draft's ``model.safetensors`` as float32 arrays (float16 is widened); ``draft_vocab``
    is read as int64.

    Raises:
        FileNotFoundError: no such file.
        ModelFormatError: unreadable, a dtype other than float32/float16 (int32/int64 for
            ``draft_vocab``).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise FileNotFoundError(2, "draft weights not found", str(path))
    try:
        raw = load_file(str(path))
    except (SafetensorError, ValueError, TypeError) as e:  # bfloat16 has no numpy dtype
        raise ModelFormatError(f"{path}: cannot read it as float32/float16 safetensors: {e}") from e
    out = {}
    for name, a in raw.items():
        if name == "draft_vocab" and a.dtype in (np.int32, np.int64):
            out[name] = a.astype(np.int64)
            continue
        if a.dtype not in (np.float16, np.float32):
            raise ModelFormatError(f"{path}: tensor {name!r} is {a.dtype}, expected float32 or float16")
        out[name] = a.astype(np.float32)
    return out
