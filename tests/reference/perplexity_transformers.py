"""Independent perplexity reference: Hugging Face transformers (PyTorch) loading the same GGUF.

transformers dequantizes the GGUF with its own code path, undoes llama.cpp's Q/K permutation with
its own code, builds its own tokenizer from the GGUF vocabulary and runs its own Llama
implementation, so nothing is shared with ``flm_runtime`` except the file. The number it prints
is the golden value in ``tests/models/test_llama.py``.

Run (needs the optional reference stack; not part of CI):
    pip install torch==2.13.0 transformers accelerate gguf
    python tests/reference/perplexity_transformers.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "wizard_of_oz_ch1.txt"


def main(gguf_path: str) -> None:
    path = Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = tok(PASSAGE.read_text(), add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean").item()
    print(f"tokens={ids.shape[1]} first_ids={ids[0, :8].tolist()} nll={nll:.6f} perplexity={math.exp(nll):.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
