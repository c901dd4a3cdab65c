"""Golden outputs of tiny drafts in the public DFlash format, from the ``dflash`` package's own torch
reference (``dflash.model.DFlashDraftModel`` and ``dflash_generate``, PyPI ``dflash==0.1.0``).

Builds each tiny draft of ``tests/models/dflash_public_files.py`` (bfloat16 files from its numpy
seed) and its tiny target of ``tests/models/family_files.py`` (``qwen3``; ``llama_llama3``: Llama
3.1's RoPE scaling), loads the target with transformers' ``AutoModelForCausalLM`` and the draft
with ``DFlashDraftModel.from_pretrained`` (both float32; nothing of ``flm_runtime``), and writes
to ``tests/reference/golden_dflash.npz``, per case ``<case>_<field>``:

- ``context_ids`` ``[CONTEXT + 1]``: the golden token sequence's first tokens; ``taps``
  ``[CONTEXT, n*E]``: the target's hidden states after the tapped layers at positions
  ``0 .. CONTEXT-1`` (``extract_context_feature``); ``logits`` ``[B-1, V]``: the draft's logits
  (``compute_logits`` over the target's LM head) of the block ``[context_ids[CONTEXT], mask x
  B-1]`` at positions ``CONTEXT ..`` after that context (the vocabulary is 256: all columns);
- a greedy ``dflash_generate(..., return_stats=True)`` of the case's prompt (``NEW_TOKENS``,
  no stop tokens): ``output`` (generated ids), ``acceptance`` (tokens kept per step),
  ``drafted`` ``[steps, B-1]`` (each step's drafted tokens, -1 past a cut block's rows; captured
  by wrapping the model's ``compute_logits``), ``verify_sizes`` (each step's block rows) and
  ``whole_steps`` (how many steps, from the first, ran a whole block without the end of
  ``max_new_tokens`` cutting what they kept: the steps our decoder, which knows no
  ``max_new_tokens``, runs alike).

It asserts that the runs are worth comparing: every argmax behind a drafted token, or behind a
target token of the whole steps, leads the runner-up by more than ``MARGIN`` (float32 rounding
cannot flip it), and some whole step of each case keeps several tokens.

Not run in CI and never imported by the tests. Run in its own environment:
    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers==5.15.0 safetensors numpy gguf==0.19.0
    .venv-ref/bin/pip install --no-deps /path/to/dflash-0.1.0-py3-none-any.whl
    .venv-ref/bin/python tests/reference/record_dflash_golden.py
(``--no-deps``: ``dflash.model`` needs torch and transformers only; the wheel's other
requirements serve its benchmark.)
"""

import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

import dflash.model as reference
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import dflash_public_files as public  # noqa: E402  (beside the tests, not a package)
import family_files  # noqa: E402

OUT = Path(__file__).resolve().parent / "golden_dflash.npz"
MARGIN = 1e-3  # logits: an argmax must lead by more than float32 rounding moves a logit here


def load(name: str, directory: Path) -> tuple[DFlashDraftModel, torch.nn.Module]:
    """The draft ``name`` and its target, float32, from files written under ``directory``."""
    case = public.CASES[name]
    target_dir = family_files.write_hf_dir(directory / case.target, case.target)
    target, info = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager",
                                                        output_loading_info=True)
    assert not any(info.values()), f"{name}: the target did not load as written: {info}"
    draft, info = DFlashDraftModel.from_pretrained(public.write_case(directory / name, name), dtype=torch.float32,
                                                   output_loading_info=True)
    assert not any(info.values()), f"{name}: the draft did not load as written: {info}"
    scaling = family_files.hf_config(case.target).get("rope_scaling") or {}
    assert draft.rotary_emb.rope_type == scaling.get("rope_type", "default"), draft.rotary_emb.rope_type
    return draft.eval(), target.eval()


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``[..., V]``, how far the largest logit leads the second."""
    top = torch.topk(logits, 2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.inference_mode()
def block_logits(draft: DFlashDraftModel, target: torch.nn.Module) -> dict[str, np.ndarray]:
    """The draft's logits of one block after ``CONTEXT`` positions of the golden tokens."""
    ids = torch.from_numpy(family_files.golden_tokens()[: public.CONTEXT + 1]).reshape(1, -1)
    hidden = target(ids[:, : public.CONTEXT], output_hidden_states=True).hidden_states
    taps = extract_context_feature(hidden, draft.target_layer_ids)  # [1, CONTEXT, n*E]
    block = torch.full((1, public.BLOCK_SIZE), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = ids[0, public.CONTEXT]
    scale = float(reference._draft_value(draft.config, "input_embedding_scale", 1.0))
    noise = reference._raw_input_embeddings(target, block, scale)
    positions = torch.arange(public.CONTEXT + public.BLOCK_SIZE).reshape(1, -1)
    out = draft(target_hidden=taps, noise_embedding=noise, position_ids=positions)[:, 1:, :]
    logits = draft.compute_logits(out, reference._output_head(target))[0]  # [B-1, V]
    return {"context_ids": ids[0].numpy(), "taps": taps[0].numpy(), "logits": logits.numpy()}


@torch.inference_mode()
def generation(draft: DFlashDraftModel, target: torch.nn.Module, prompt: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A greedy ``dflash_generate`` of ``prompt``, each step's drafted tokens captured."""
    drafted, draft_margins = [], []
    compute_logits = draft.compute_logits

    def capture(hidden, head):
        logits = compute_logits(hidden, head)  # [1, rows, V]
        drafted.append(torch.argmax(logits, dim=-1)[0].tolist())
        draft_margins.append(margins(logits).min().item())
        return logits

    draft.compute_logits = capture
    ids = torch.tensor([prompt])
    run = dflash_generate(draft, target, ids, public.NEW_TOKENS, None, temperature=0.0, return_stats=True)
    output = run.output_ids[0, len(prompt):]
    assert len(drafted) == len(run.acceptance_lengths), "a step ran no draft"
    verify_sizes = [len(d) + 1 for d in drafted]
    max_length, start, whole = len(prompt) + public.NEW_TOKENS, len(prompt), 0
    for size, kept in zip(verify_sizes, run.acceptance_lengths):
        if size < public.BLOCK_SIZE or max_length - start - 1 < public.BLOCK_SIZE:
            break
        whole, start = whole + 1, start + kept
    # the target's argmax at every position that chose an output token the whole steps keep
    kept = 1 + sum(run.acceptance_lengths[:whole])
    target_margins = margins(target(run.output_ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + kept])
    assert min(draft_margins) > MARGIN and target_margins.min().item() > MARGIN, (draft_margins, target_margins)
    assert max(run.acceptance_lengths[:whole]) >= 3, f"no step kept several tokens: {run.acceptance_lengths}"
    padded = np.full((len(drafted), public.BLOCK_SIZE - 1), -1, dtype=np.int64)
    for i, d in enumerate(drafted):
        padded[i, : len(d)] = d
    return {"output": output.numpy(), "acceptance": np.array(run.acceptance_lengths), "drafted": padded,
            "verify_sizes": np.array(verify_sizes), "whole_steps": np.array(whole)}


def main() -> None:
    torch.manual_seed(0)
    reference._cuda_time = time.perf_counter  # the stats' clock syncs CUDA, which a CPU run has not
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in public.CASES.items():
            draft, target = load(name, Path(tmp))
            values = block_logits(draft, target) | generation(draft, target, case.prompt)
            golden |= {f"{name}_{k}": v for k, v in values.items()}
            print(f"{name}: acceptance {values['acceptance'].tolist()} ({values['whole_steps']} whole steps), "
                  f"output {values['output'].tolist()}")
    versions = (f"torch {torch.__version__} transformers {transformers.__version__} "
                f"dflash {importlib.metadata.version('dflash')}")
    np.savez_compressed(OUT, versions=np.array(versions), **golden)
    print(f"wrote {OUT} ({versions})")


if __name__ == "__main__":
    main()
