"""Train the DFlash draft on the self-distilled shards (docs/dflash.md, "Training").

One step: ``--batch-seqs`` sequences, ``--anchors`` anchors each, sampled uniformly among the
response positions that have at least one token after them; every block ``[token at anchor,
MASK x 7]`` sees the context taps strictly before its anchor and its own 8 positions; cross-entropy
against the target's tokens at offsets ``k = 1..7``, weighted ``exp(-(k-1)/gamma)``; with
``--distill D`` a fraction ``D`` of it is the cross-entropy against the target's own next-token
distribution there instead (its top-16 log-probabilities, recorded at generation; renormalised
over those the draft can propose): knowledge distillation (Hinton et al. 2015, arXiv:1503.02531),
as DistillSpec (Zhou et al. 2023, arXiv:2310.08461) uses it for speculative drafts. AdamW, linear
warmup then cosine decay to 10%, gradient clipping. The frozen LM head runs in bfloat16 (faster on
CPUs with bfloat16 support; the logits are float32 for the loss); evaluation uses float32 like
serving.

Checkpoints (``<out>/ckpt/last.pt``, written atomically every ``--ckpt-minutes`` and at the end)
hold the draft, the optimizer, the step, the RNG states and the data cursor; a rerun resumes from
them. The best draft by held-out simulated AL is kept inside the checkpoint for export.

Simulated AL (acceptance length, *including the bonus token*): on held-out greedy sequences,
anchors every 8th response position; the draft's argmax tokens d1..d7 are compared with the
target's own greedy continuation; AL = 1 + the longest agreeing prefix (tokens past the end of the
sequence never agree). That is the greedy serving AL for the same context.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.models.dflash import DFlashConfig
from flm_train.draft import DFlashDraft
from flm_train.export import read_draft
from flm_train.generate import causal_taps, default_tap_layers, load_target
from tqdm import tqdm

log = logging.getLogger("flm_train")


# --- data ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seq:
    shard: int
    start: int  # offset of the sequence in its shard's token/taps arrays
    length: int  # tokens (prompt + response)
    prompt_len: int
    greedy: bool


def mmap_npz_array(path: Path, name: str) -> np.ndarray:
    """Array ``name`` of an uncompressed ``.npz`` (``np.savez``, as ``flm_train.generate`` writes
    shards), memory-mapped read-only instead of read into memory.

    A stored (uncompressed) zip member's bytes are the ``.npy`` file itself, so the array's data
    starts after the member's local file header (30 bytes, then its name and extra field:
    PKWARE APPNOTE.TXT 4.3.7) and the ``.npy`` header (``numpy.lib.format``).

    Raises:
        KeyError: no member ``name``.
        ValueError: the member is compressed (``np.savez_compressed``).
    """
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: {name} is compressed and cannot be memory-mapped")
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(f)
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")


class Shards:
    """Shards: tokens in memory; taps and the target's top-k memory-mapped, in their stored dtypes
    until a batch is built (the taps, 5.8 KB per token for SmolLM2: 5 tapped layers x 576 x
    float16, outgrow the memory: 22 GB for 3.9M tokens; the top-k add 96 bytes a token, read only
    by the rows a batch takes).

    A shard generated without taps (``--no-taps``) has them recomputed when a batch needs them, by
    ``target`` (the runtime model and its tap layers, ``flm_train.generate.load_target``): one
    causal forward of the batch's sequences (``generate.causal_taps``), rounded to float16, so they
    are the taps generation would have stored (bit for bit on the batch-invariant quantized
    kernels).

    ``top_ids`` / ``top_logprobs`` (``flm_train.generate``) are lists of ``[N, k]`` arrays, or None
    when a shard predates them (generated before they were recorded).

    Raises:
        ValueError: a shard has no taps and ``target`` is None.
    """

    def __init__(self, paths: list[Path], target: tuple[CausalLM, list[int]] | None = None):
        self.tokens, self.seqs = [], []
        self.taps: list[np.ndarray | None] = []  # None: recomputed by `target`
        self.target = target
        self.top_ids: list[np.ndarray] | None = []
        self.top_logprobs: list[np.ndarray] | None = []
        for i, p in enumerate(paths):
            z = np.load(p)
            self.tokens.append(z["tokens"].astype(np.int64))
            if "taps" not in z.files and target is None:
                raise ValueError(f"{p} holds no taps (generated with --no-taps), and no target was given to "
                                 "recompute them")
            self.taps.append(mmap_npz_array(p, "taps") if "taps" in z.files else None)
            if "top_ids" in z.files and self.top_ids is not None:
                self.top_ids.append(mmap_npz_array(p, "top_ids"))
                self.top_logprobs.append(mmap_npz_array(p, "top_logprobs"))
            else:
                self.top_ids = self.top_logprobs = None
            off, pl, gr = z["offsets"], z["prompt_lens"], z["greedy"]
            for j in range(len(pl)):
                if off[j + 1] - off[j] - pl[j] >= 2:  # at least an anchor and one target
                    self.seqs.append(Seq(i, int(off[j]), int(off[j + 1] - off[j]), int(pl[j]), bool(gr[j])))

    def seq_taps(self, seqs: list[Seq]) -> list[np.ndarray]:
        """Taps ``[length, n*E]`` float16 of each of ``seqs`` (the last row 0, as stored): read from
        its shard, or recomputed by ``target`` in one forward for all that need it."""
        out = {i: self.taps[s.shard][s.start: s.start + s.length] for i, s in enumerate(seqs)
               if self.taps[s.shard] is not None}
        missing = [i for i in range(len(seqs)) if i not in out]
        if missing:
            model, layers = self.target
            tokens = [self.tokens[seqs[i].shard][seqs[i].start: seqs[i].start + seqs[i].length] for i in missing]
            for i, taps in zip(missing, causal_taps(model, layers, tokens)):
                out[i] = np.concatenate([taps.astype(np.float16), np.zeros((1, taps.shape[1]), np.float16)])
        return [out[i] for i in range(len(seqs))]

    def tap_rms(self, max_tokens: int = 200_000, group: int = 16) -> torch.Tensor:
        """Per-column RMS ``[n*E]`` of the taps over (up to) ``max_tokens`` positions, leaving out each
        sequence's first position (the attention-sink token, whose massive values would set the scale).
        Sequences are read ``group`` at a time (one forward each group where taps are recomputed)."""
        acc, n = None, 0
        for g in range(0, len(self.seqs), group):
            for taps in self.seq_taps(self.seqs[g: g + group]):
                x = taps[1:-1].astype(np.float64)
                sq = (x * x).sum(0)
                acc, n = (sq if acc is None else acc + sq), n + len(x)
                if n >= max_tokens:
                    return torch.from_numpy(np.sqrt(acc / n).astype(np.float32))
        return torch.from_numpy(np.sqrt(acc / max(n, 1)).astype(np.float32))

    def token_ranking(self, vocab_size: int) -> np.ndarray:
        """Every target token id ``[V]`` int64 (``V = vocab_size``), most useful to draft first: by count in the training
        responses, then by count in the prompts, then by id (BPE ids roughly follow merge order,
        which follows frequency in the tokenizer's own corpus)."""
        v = vocab_size
        resp, prompt = np.zeros(v, np.int64), np.zeros(v, np.int64)
        for s in self.seqs:
            toks = self.tokens[s.shard][s.start: s.start + s.length]
            np.add.at(prompt, toks[: s.prompt_len], 1)
            np.add.at(resp, toks[s.prompt_len:], 1)
        return np.lexsort((np.arange(v), -prompt, -resp)).astype(np.int64)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def batch(self, seqs: list[Seq], anchors: list[np.ndarray]) -> tuple:
        """taps ``[B, T, n*E]`` f32, tokens ``[B, T]``, lengths ``[B]``, anchors ``[B, M]``, anchor valid
        ``[B, M]``, and the target's top-k ``(ids [B, T, k] int64, log-probabilities [B, T, k] f32)``
        after each position (None without them; padding rows are -inf)."""
        t = max(s.length for s in seqs)
        m = max(len(a) for a in anchors)
        seq_taps = self.seq_taps(seqs)
        taps = torch.zeros(len(seqs), t, seq_taps[0].shape[1])
        tokens = torch.zeros(len(seqs), t, dtype=torch.long)
        anc = torch.zeros(len(seqs), m, dtype=torch.long)
        valid = torch.zeros(len(seqs), m, dtype=torch.bool)
        for i, (s, a) in enumerate(zip(seqs, anchors)):
            taps[i, : s.length] = torch.from_numpy(seq_taps[i].astype(np.float32))
            tokens[i, : s.length] = torch.from_numpy(self.tokens[s.shard][s.start: s.start + s.length])
            anc[i, : len(a)] = torch.from_numpy(a)
            anc[i, len(a):] = s.prompt_len
            valid[i, : len(a)] = True
        lengths = torch.tensor([s.length for s in seqs])
        top = None
        if self.top_ids is not None:
            k = self.top_ids[0].shape[1]
            ids, logp = torch.zeros(len(seqs), t, k, dtype=torch.long), torch.full((len(seqs), t, k), -math.inf)
            for i, s in enumerate(seqs):
                rows = slice(s.start, s.start + s.length)
                ids[i, : s.length] = torch.from_numpy(self.top_ids[s.shard][rows].astype(np.int64))
                logp[i, : s.length] = torch.from_numpy(self.top_logprobs[s.shard][rows].astype(np.float32))
            top = ids, logp
        return taps, tokens, lengths, anc, valid, top


def sample_anchors(s: Seq, m: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``m`` distinct anchors in ``[prompt_len, length-2]`` (sorted)."""
    n = s.length - 1 - s.prompt_len
    pick = rng.choice(n, size=min(m, n), replace=False)
    return np.sort(pick + s.prompt_len).astype(np.int64)


def block_targets(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ``[B, M, k-1]`` (the tokens at anchor+1..anchor+k-1) and their validity."""
    pos = anchors[:, :, None] + torch.arange(1, k)  # [B, M, k-1]
    ok = (pos < lengths[:, None, None]) & valid[:, :, None]
    tgt = torch.gather(tokens, 1, pos.clamp(max=tokens.shape[1] - 1).flatten(1)).view_as(pos)
    return tgt, ok


def soft_targets(draft: DFlashDraft, top: tuple[torch.Tensor, torch.Tensor], anchors: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution at each block offset, over the draft vocabulary.

    Offset ``j`` of the block at ``a`` predicts the token at ``a+j``, which the target's logits after
    position ``a+j-1`` rank. ``top`` = (ids ``[B, T, t]``, log-probabilities ``[B, T, t]``) from
    ``Shards.batch``; anchors ``[B, M]``.

    Returns:
        draft-vocabulary indices ``[B, M, k-1, t]`` (0 where outside it) and their probabilities
        ``[B, M, k-1, t]`` renormalised over the top-``t`` tokens the draft can propose (0 elsewhere;
        all 0 where it can propose none of them).
    """
    ids, logp = top
    rows = (anchors[:, :, None] + torch.arange(k - 1)).clamp(max=ids.shape[1] - 1).flatten(1)  # [B, M(k-1)]
    t = ids.shape[2]
    ids = torch.gather(ids, 1, rows[:, :, None].expand(-1, -1, t)).view(*anchors.shape, k - 1, t)
    logp = torch.gather(logp, 1, rows[:, :, None].expand(-1, -1, t)).view(*anchors.shape, k - 1, t)
    d_ids = draft.to_draft[ids]
    logp = logp.masked_fill(d_ids < 0, -math.inf)
    probs = torch.nan_to_num(torch.softmax(logp, dim=-1), nan=0.0)  # a row of all -inf gives nan
    return d_ids.clamp(min=0), probs


def draft_loss(draft: DFlashDraft, batch: tuple, gamma: float, distill: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The weighted block loss (module docstring): ``(1 - distill)`` x cross-entropy against the
    emitted tokens + ``distill`` x cross-entropy against the target's top-k distribution.

    Raises:
        ValueError: ``distill > 0`` on a batch without the target's top-k (older shards).
    """
    taps, tokens, lengths, anchors, valid, top = batch
    k = draft.c.block_size
    h = draft.hidden(taps, tokens, anchors)[:, :, 1:]  # [B, M, k-1, E]
    tgt, ok = block_targets(tokens, lengths, anchors, valid, k)
    tgt = draft.to_draft[tgt]  # [B, M, k-1] draft-vocabulary index, -1 outside it
    ok &= tgt >= 0  # a token the draft cannot propose teaches it nothing
    logits = draft.logits(h[ok], bf16=True)  # [N, Vd]
    ce = F.cross_entropy(logits, tgt[ok], reduction="none")  # [N]
    if distill > 0:
        if top is None:
            raise ValueError("--distill needs shards with the target's top-k (generated since they are recorded)")
        d_ids, probs = soft_targets(draft, top, anchors, k)
        logq = torch.gather(torch.log_softmax(logits, dim=-1), 1, d_ids[ok])  # [N, t]
        ce = (1 - distill) * ce - distill * (probs[ok] * logq).sum(-1)
    w = torch.exp(-torch.arange(k - 1, dtype=torch.float32) / gamma).expand_as(ok)[ok]  # [N]
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        acc1 = (logits.argmax(-1) == tgt[ok])[torch.arange(k - 1).expand_as(ok)[ok] == 0].float().mean()
    return loss, {"acc1": float(acc1)}


@torch.no_grad()
def simulated_al(draft: DFlashDraft, data: Shards, seqs: list[Seq]) -> dict:
    """Greedy AL (includes the bonus token) of ``draft`` on held-out greedy sequences, two ways.

    The draft runs a block at every response position at once (one forward per sequence); the
    target's own continuation decides how many of ``d1..d7`` it keeps there. Then:

    - ``sim_al``, over ``steps``: the serving schedule. The first block is anchored at the first
      response token, each next one at the token after the previous block's kept prefix (its bonus
      token); AL = the response tokens after the first (the prefill's) / steps, pooled. This is what
      the serving runtime reports on these prompts (greedy, whole blocks, no policy): the same
      steps, the same AL (``tests/training/test_simulated_al.py``).
    - ``grid_al``, over ``blocks``, with ``accept_at_k`` (the fraction of blocks keeping ``d1..dk``):
      anchors every ``K``-th response position. Higher than ``sim_al``: a served block starts
      right after a token the draft got wrong, where the next ones are harder.
    """
    k = draft.c.block_size
    steps = emitted = 0
    grid, per_k = [], np.zeros(k - 1)
    for s in seqs:
        anchors = np.arange(s.prompt_len, s.length - 1)
        taps, tokens, lengths, anc, valid, _ = data.batch([s], [anchors])
        logits = draft.logits(draft.hidden(taps, tokens, anc)[:, :, 1:])  # [1, M, k-1, Vd]
        tgt, ok = block_targets(tokens, lengths, anc, valid, k)
        agree = ((draft.draft_vocab[logits.argmax(-1)] == tgt) & ok)[0].int()  # [M, k-1]
        prefix = torch.cumprod(agree, dim=1)  # 1 while every earlier one agreed
        kept = prefix.sum(1).tolist()  # [M] drafted tokens kept by a block at each response position
        grid.extend(kept[::k])
        per_k += prefix[::k].sum(0).numpy()
        i = 0
        while i < len(kept):
            steps += 1
            i += kept[i] + 1
        emitted += len(kept)
    return {"sim_al": emitted / max(1, steps), "steps": steps, "grid_al": 1 + float(np.mean(grid)),
            "blocks": len(grid), "accept_at_k": [round(float(x) / len(grid), 3) for x in per_k]}


# --- checkpointing -----------------------------------------------------------------------------

def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def lr_at(step: int, a: argparse.Namespace) -> float:
    """The LR at ``step``: ``--warmup`` linear steps from ``--schedule-from``, then a cosine from
    ``--lr`` to 10% of it at ``--steps``. A ``--schedule-from`` past 0 restarts the schedule when
    a run resumes (a warm restart: Loshchilov & Hutter 2017, "SGDR", arXiv:1608.03983)."""
    s = step - a.schedule_from
    if s < a.warmup:
        return a.lr * (max(0, s) + 1) / a.warmup
    frac = (s - a.warmup) / max(1, a.steps - a.schedule_from - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def build_draft(a: argparse.Namespace, target_config, embed: torch.Tensor, lm_head: torch.Tensor,
                target_norm: torch.Tensor | None, draft_vocab: torch.Tensor | None) -> DFlashDraft:
    """A freshly initialised draft for the target (``draft_vocab`` ``[Vd]`` or None: see ``DFlashDraft``)."""
    c = target_config
    dc = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                      num_hidden_layers=a.layers, target_layer_ids=tuple(default_tap_layers(c.num_hidden_layers)),
                      block_size=a.block_size, mask_token_id=a.mask_token_id,
                      max_position_embeddings=c.max_position_embeddings,
                      draft_vocab_size=0 if draft_vocab is None else len(draft_vocab))
    draft = DFlashDraft(dc, embed, lm_head, draft_vocab)
    with torch.no_grad():
        for mod in draft.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=0.02)
        if target_norm is not None:
            # The target's final-norm gains, scaled down: with the tied LM head a draft output near
            # the anchor/MASK embedding would otherwise start with logits of std ~20 (CE ~100).
            draft.norm.copy_(0.1 * target_norm)
    return draft


def load_or_grow(draft: DFlashDraft, state: dict[str, torch.Tensor]) -> int:
    """Load a checkpoint's draft ``state`` into ``draft``, growing it when the checkpoint has fewer layers.

    The checkpoint's layers come first; each added layer starts as the identity (``o_proj`` and
    ``down_proj`` zero: both residual branches add nothing), so the grown draft computes exactly
    what the checkpoint's did and training continues from there (progressive stacking, as in
    Gong et al. 2019, "Efficient Training of BERT by Progressively Stacking", with identity
    instead of copied layers).

    Returns:
        The number of layers added (0: same depth, a plain strict load).
    Raises:
        ValueError: the checkpoint has more layers than ``draft``.
    """
    have = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")), default=-1)
    if have > len(draft.layers):
        raise ValueError(f"the checkpoint's draft has {have} layers, more than --layers {len(draft.layers)}")
    missing, unexpected = draft.load_state_dict(state, strict=have == len(draft.layers))
    assert not unexpected and all(k.startswith("layers.") and int(k.split(".")[1]) >= have for k in missing), \
        (missing, unexpected)
    with torch.no_grad():
        for layer in draft.layers[have:]:
            layer.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
    return len(draft.layers) - have


@dataclass
class Run:
    """A training run between steps: what ``load_run`` builds, ``train_step`` advances and
    ``save_run`` checkpoints.

    Attributes:
        draft, opt: the draft being trained and its AdamW.
        data, held: the training shards and the held-out ones (None without any).
        eval_seqs: the held-out greedy sequences that ``simulated_al`` evaluates.
        heldout_names: the held-out shards' file names (a changed set forgets ``best``).
        rng: the numpy generator of the epochs' permutations and the anchors.
        step, epoch, cursor, perm: steps done; the epoch, and the position in its permutation of
            the training sequences.
        best: the best draft so far by held-out simulated AL (``sim_al``, ``step``, ``loss_ema``,
            ``state``: its ``export_state``), or None.
        history: every evaluation so far.
        warm_start: the ``--init-draft`` this run started from and how that one was trained, or None.
        warm_started_now: this call loaded ``--init-draft`` (a fresh run, not a resumed one).
    """

    draft: DFlashDraft
    opt: torch.optim.Optimizer
    data: Shards
    held: Shards | None
    eval_seqs: list[Seq]
    heldout_names: list[str]
    rng: np.random.Generator
    step: int
    epoch: int
    cursor: int
    perm: np.ndarray
    best: dict | None
    history: list[dict]
    warm_start: dict | None
    warm_started_now: bool


def served_float32(w: np.ndarray | QuantWeight) -> torch.Tensor:
    """A target matrix as the runtime serves it (a quantized one dequantized), float32 ``[out, in]``:
    the draft shares the served embedding and LM head."""
    return torch.from_numpy(w.dequantize() if isinstance(w, QuantWeight) else w)


def load_run(a: argparse.Namespace, train_paths: list[Path], heldout_paths: list[Path]) -> Run | None:
    """The run of ``a.out``: resumed from ``<out>/ckpt/last.pt`` when there is one, else a fresh
    draft (warm-started from ``--init-draft`` if given) for ``--target``.

    Returns:
        None when the checkpoint has already reached ``--steps``.
    Raises:
        SystemExit: ``--init-draft``'s config differs from the draft asked for.
    """
    from flm_runtime.loading import load_model_files
    from flm_runtime.pull import locate

    (a.out / "ckpt").mkdir(parents=True, exist_ok=True)
    last = a.out / "ckpt" / "last.pt"
    ck = torch.load(last, weights_only=False) if last.exists() else None
    if ck is not None and ck["step"] >= a.steps:
        log.info("train: done (step %d >= --steps %d)", ck["step"], a.steps)
        return None
    torch.set_num_threads(a.threads)
    bundle = load_model_files(locate(a.target))
    embed = served_float32(bundle.weights["model.embed_tokens.weight"])
    lm_head = embed if bundle.config.tie_word_embeddings else served_float32(bundle.weights["lm_head.weight"])
    # Shards generated without taps (--no-taps) have them recomputed by the target as served.
    target = None
    if any("taps" not in np.load(p).files for p in train_paths + heldout_paths):
        loaded, layers = load_target(a.target)
        target = loaded.model, layers
    data, held = Shards(train_paths, target), Shards(heldout_paths, target) if heldout_paths else None
    init = read_draft(a.init_draft) if ck is None and a.init_draft is not None else None
    warm_start = ck.get("warm_start") if ck is not None else (
        {"draft": str(a.init_draft), "training": init[2]} if init is not None else None)
    if ck is not None:  # the checkpoint's own vocabulary (or none), whatever the data says now
        draft_vocab = ck["model"].get("draft_vocab")
    elif init is not None:  # the warm start's
        draft_vocab = init[1].get("draft_vocab")
    else:
        vd = a.draft_vocab if 0 < a.draft_vocab < bundle.config.vocab_size else 0
        draft_vocab = torch.from_numpy(np.sort(data.token_ranking(bundle.config.vocab_size)[:vd])) if vd else None
    torch.manual_seed(a.seed)
    draft = build_draft(a, bundle.config, embed, lm_head, torch.from_numpy(bundle.weights["model.norm.weight"]),
                        draft_vocab)
    # Adam moves every weight by ~lr per step: the final norm, which alone sets the logit scale
    # (its input is normalised), would need ~1000 steps to grow from 0.1x to the target's gains.
    rest = [p for n, p in draft.named_parameters() if n != "norm"]
    opt = torch.optim.AdamW([{"params": rest, "lr_mult": 1.0},
                             {"params": [draft.norm], "lr_mult": a.norm_lr_mult, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)
    draft.set_tap_scale(data.tap_rms())  # a checkpoint's own scale (a buffer) replaces it on resume
    if init is not None:
        if init[0] != draft.c:
            raise SystemExit(f"--init-draft {a.init_draft}: its config {init[0]} differs from the one asked "
                             f"{draft.c} (set --layers, --block-size, --mask-token-id, --draft-vocab to match)")
        draft.load_export_state(init[1])
        log.info("train: warm start from the draft in %s", a.init_draft)
    log.info("train: %d sequences / %d tokens; held out %d sequences; draft vocabulary %d", len(data.seqs),
             data.n_tokens, len(held.seqs) if held else 0, len(draft.draft_vocab))
    eval_seqs = [s for s in held.seqs if s.greedy][: a.eval_seqs] if held else []
    rng = np.random.default_rng(a.seed)
    run = Run(draft, opt, data, held, eval_seqs, [q.name for q in heldout_paths], rng, step=0, epoch=0, cursor=0,
              perm=rng.permutation(len(data.seqs)), best=None, history=[], warm_start=warm_start,
              warm_started_now=init is not None)
    if ck is not None:
        _resume(run, ck)
    return run


def _resume(run: Run, ck: dict) -> None:
    """Put checkpoint ``ck``'s draft, optimizer, counters and RNG states into ``run``."""
    grown = load_or_grow(run.draft, ck["model"])
    if grown:  # Adam's moments belong to the old parameter list
        log.info("train: the checkpoint's draft grew by %d identity layer(s); the optimizer starts afresh", grown)
    else:
        run.opt.load_state_dict(ck["opt"])
    run.step, run.epoch, run.cursor, run.perm = ck["step"], ck["epoch"], ck["cursor"], np.asarray(ck["perm"])
    run.rng.bit_generator.state = ck["rng_numpy"]
    torch.set_rng_state(ck["rng_torch"])
    random.setstate(ck["rng_python"])
    run.best, run.history = ck.get("best"), ck.get("history", [])
    if grown or ck.get("heldout") != run.heldout_names:  # the best so far is not comparable with what follows
        log.info("train: %s: the best draft so far (%s) is forgotten",
                 "the draft grew" if grown else "the held-out shards changed",
                 None if run.best is None else f"step {run.best['step']}, simulated AL {run.best['sim_al']:.3f}")
        run.best = None
    if len(run.perm) != len(run.data.seqs):  # the data grew (more --prompts): a new epoch over all of it
        run.epoch, run.cursor, run.perm = run.epoch + 1, 0, run.rng.permutation(len(run.data.seqs))
    log.info("train: resumed at step %d (epoch %d, cursor %d)", run.step, run.epoch, run.cursor)


def train_step(run: Run, a: argparse.Namespace) -> tuple[float, dict, float]:
    """One optimizer step on the next ``--batch-seqs`` sequences of the epoch (a new epoch, newly
    permuted, when too few are left), ``--anchors`` blocks each.

    Returns:
        the loss, ``draft_loss``'s info (``acc1``) and the gradient norm before clipping.
    """
    if run.cursor + a.batch_seqs > len(run.perm):
        run.epoch, run.cursor, run.perm = run.epoch + 1, 0, run.rng.permutation(len(run.data.seqs))
    seqs = [run.data.seqs[i] for i in run.perm[run.cursor: run.cursor + a.batch_seqs]]
    run.cursor += a.batch_seqs
    batch = run.data.batch(seqs, [sample_anchors(s, a.anchors, run.rng) for s in seqs])
    for g in run.opt.param_groups:
        g["lr"] = lr_at(run.step, a) * g["lr_mult"]
    loss, info = draft_loss(run.draft, batch, a.gamma, a.distill)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(run.draft.parameters(), a.clip)
    run.opt.step()
    run.step += 1
    return loss.item(), info, float(gnorm)


def save_run(run: Run, a: argparse.Namespace) -> None:
    """Checkpoint ``run`` to ``<out>/ckpt/last.pt`` (atomically)."""
    save_checkpoint(a.out / "ckpt" / "last.pt", {
        "model": run.draft.state_dict(), "opt": run.opt.state_dict(), "step": run.step, "epoch": run.epoch,
        "cursor": run.cursor, "perm": run.perm, "rng_numpy": run.rng.bit_generator.state,
        "rng_torch": torch.get_rng_state(), "rng_python": random.getstate(), "best": run.best,
        "heldout": run.heldout_names, "history": run.history, "args": {k: str(v) for k, v in vars(a).items()},
        "warm_start": run.warm_start, "draft_config": run.draft.c.to_dict(), "train_tokens": run.data.n_tokens})


def train(a: argparse.Namespace, train_paths: list[Path], heldout_paths: list[Path]) -> None:
    """Train (or resume) the draft of ``a.out`` to ``--steps``: evaluate every ``--eval-every`` steps
    and at the end, keep the best draft, checkpoint every ``--ckpt-minutes`` and at the end."""
    run = load_run(a, train_paths, heldout_paths)
    if run is None:
        return

    def metric(rec: dict) -> None:
        with open(a.out / "train_metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def evaluate(loss_ema: float | None, note: str = "") -> dict:
        ev = {"step": run.step, "loss_ema": loss_ema, **simulated_al(run.draft, run.held, run.eval_seqs)}
        run.history.append(ev)
        log.info("eval: %s%s", ev, note)
        metric({"eval": ev})
        return ev

    if run.warm_started_now and run.eval_seqs:  # where the warm start begins, on this held-out data
        evaluate(None, " (the --init-draft draft)")
    t_ckpt, t0, steps_run, loss_avg = time.time(), time.time(), 0, None
    bar = tqdm(total=a.steps, initial=run.step, desc="train", unit="step", mininterval=30)
    while run.step < a.steps:
        lv, info, gnorm = train_step(run, a)
        steps_run += 1
        loss_avg = lv if loss_avg is None else 0.98 * loss_avg + 0.02 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}", acc1=f"{info['acc1']:.2f}", refresh=False)
        if run.step % 10 == 0:
            metric({"step": run.step, "loss": round(lv, 4), "loss_ema": round(loss_avg, 4),
                    "acc1": round(info["acc1"], 3), "lr": lr_at(run.step, a), "grad_norm": gnorm, "epoch": run.epoch,
                    "s_per_step": round((time.time() - t0) / steps_run, 3)})
        if run.eval_seqs and (run.step % a.eval_every == 0 or run.step == a.steps):
            ev = evaluate(round(loss_avg, 4))
            if run.best is None or ev["sim_al"] > run.best["sim_al"]:
                run.best = {"sim_al": ev["sim_al"], "step": run.step, "loss_ema": loss_avg,
                            "state": run.draft.export_state()}
        if time.time() - t_ckpt > 60 * a.ckpt_minutes or run.step == a.steps:
            save_run(run, a)
            t_ckpt = time.time()
    bar.close()
    log.info("train: finished %d steps (%.3f s/step this run)", run.step, (time.time() - t0) / max(1, steps_run))
