"""Golden logits of each model family, from Hugging Face transformers' own model classes.

Builds each tiny checkpoint of ``tests/models/family_files.py`` (from its numpy seed), loads its
Hugging Face directory with ``AutoModelForCausalLM`` (float32, eager attention: transformers' own
implementation, nothing of ``flm_runtime``), runs the golden token sequence and writes the
logits' first ``GOLDEN_VOCAB`` columns of every position to ``tests/reference/golden_families.npz``,
which ``tests/models/test_families.py`` compares our logits with.

One forward over the sequence, except for the RoPE scalings that depend on the sequence's length
(``dynamic``, ``longrope``): those run token by token through the KV cache, which is the reading
our tables implement (``flm_runtime.families.rope``'s docstring).

Not run in CI and never imported by the tests. Run in its own environment:
    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors numpy gguf==0.19.0
    .venv-ref/bin/python tests/reference/record_golden.py
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import family_files  # noqa: E402  (beside the tests, not a package)

OUT = Path(__file__).resolve().parent / "golden_families.npz"
TOKEN_BY_TOKEN = ("dynamic", "longrope")


def golden_logits(case: str, directory: Path) -> np.ndarray:
    """``[SEQUENCE, GOLDEN_VOCAB]`` float32 logits of ``case`` from transformers."""
    path = family_files.write_hf_dir(directory / case, case)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not any(info.values()), f"{case}: transformers did not load the checkpoint as written: {info}"
    model.eval()
    ids = torch.from_numpy(family_files.golden_tokens()).reshape(1, -1)
    scaling = family_files.hf_config(case).get("rope_scaling") or {}
    with torch.no_grad():
        if scaling.get("rope_type", scaling.get("type")) in TOKEN_BY_TOKEN:
            rows, past = [], None
            for t in range(ids.shape[1]):
                out = model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
                rows.append(out.logits[0, -1])
                past = out.past_key_values
            logits = torch.stack(rows)
        else:
            logits = model(ids).logits[0]
    return logits[:, :family_files.GOLDEN_VOCAB].numpy().astype(np.float32)


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        golden = {case: golden_logits(case, Path(tmp)) for case in family_files.CASES}
    np.savez_compressed(OUT, tokens=family_files.golden_tokens(),
                        versions=np.array(f"torch {torch.__version__} transformers {transformers.__version__}"),
                        **golden)
    for case, logits in golden.items():
        print(f"{case}: {logits.shape} first row {np.round(logits[0, :4], 4).tolist()}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
