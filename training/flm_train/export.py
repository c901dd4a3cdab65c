"""Write (and read back) a trained draft in the format of docs/dflash.md: ``config.json`` + ``model.safetensors``.

The tensors are stored as float16 (the runtime loads them as float32): a 1-layer draft for
SmolLM2-135M is ~17 MB in float32, half that in float16. The directory defaults to where the
registry expects the draft of ``<family>-dflash:<size>`` (for ``smollm2:135m``:
``flm_runtime/drafts/smollm2-135m-dflash/``, shipped inside the package).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from flm_runtime.models.dflash import DFlashConfig
from flm_train.draft import DFlashDraft
from safetensors.numpy import save_file
from safetensors.torch import load_file


def default_export_dir(target: str) -> Path:
    from flm_runtime import registry

    entry = registry.resolve(registry.dflash_tag(target))
    assert entry.draft_dir is not None
    return entry.draft_dir


def write_draft(out_dir: Path, config: DFlashConfig, state: dict[str, torch.Tensor], *, target: str,
                target_sha256: str | None, training: dict) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float16; ``draft_vocab`` int64) atomically-enough
    (tmp + rename each)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = replace(config, target=target, target_sha256=target_sha256, training=training).to_dict()
    tensors = {k: v.detach().cpu().numpy().astype(np.int64 if k == "draft_vocab" else np.float16)
               for k, v in state.items()}
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "dflash-llama"})
    os.chmod(tmp, 0o644)  # safetensors creates its file 0600; a draft is read by whoever serves it
    os.replace(tmp, out_dir / "model.safetensors")
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, out_dir / "config.json")
    return out_dir


def read_draft(draft_dir: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor], dict]:
    """A draft directory's config, tensors (float32; ``draft_vocab`` int64) as ``export_state``
    gives them (what ``DFlashDraft.load_export_state`` takes, for a warm start from a shipped
    draft), and the ``training`` record of its ``config.json`` (``{}`` without one).

    Raises:
        FileNotFoundError: ``config.json`` or ``model.safetensors`` is missing.
    """
    cfg = json.loads((draft_dir / "config.json").read_text())
    tensors = load_file(str(draft_dir / "model.safetensors"))
    return (DFlashConfig.from_dict(cfg), {k: v.long() if k == "draft_vocab" else v.float() for k, v in tensors.items()},
            cfg.get("training", {}))


def _target_sha256(target: str) -> str | None:
    from flm_runtime import registry

    entry = registry.resolve(target)
    return entry.files[0].sha256 if entry.files else None


def export_from_checkpoint(a: argparse.Namespace) -> Path:
    """Export the best draft (by held-out simulated AL) of ``<out>/ckpt/last.pt``, else its last state."""
    ck = torch.load(a.out / "ckpt" / "last.pt", weights_only=False)
    config = DFlashConfig.from_dict(ck["draft_config"])
    best = ck.get("best")
    if best is not None:
        state, chosen = best["state"], {"step": best["step"], "sim_al": round(best["sim_al"], 3)}
    else:  # no held-out evaluation ran: the last state
        vocab = ck["model"].get("draft_vocab")
        rows = 1 + max(config.mask_token_id, int(vocab.max()) if vocab is not None else 0)
        dummy = torch.zeros(rows, config.hidden_size)  # the frozen target parts are not exported
        draft = DFlashDraft(config, dummy, dummy, vocab)
        draft.load_state_dict(ck["model"])
        state, chosen = draft.export_state(), {"step": ck["step"], "sim_al": None}
    last_eval = ck["history"][-1] if ck.get("history") else None
    training = {
        "data": "self-distilled: the target's own responses to the flm_train.prompts sources "
                f"{(ck.get('args') or {}).get('prompts', 'templates')} (not MT-Bench)",
        "train_tokens": ck.get("train_tokens"), "steps_trained": ck["step"], "exported": chosen,
        "last_eval": last_eval, "command": "python -m flm_train.pipeline --target " + a.target + " --out <dir>",
        "args": ck.get("args"),
    }
    if ck.get("warm_start"):  # the draft this run started from, and how that one was trained
        training["warm_start"] = ck["warm_start"]
    out = a.export_dir or default_export_dir(a.target)
    return write_draft(Path(out), config, state, target=a.target, target_sha256=_target_sha256(a.target),
                       training=training)

