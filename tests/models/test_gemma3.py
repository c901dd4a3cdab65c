"""gemma3:270m's perplexity against llama.cpp's ``llama-perplexity``, computed the same way."""

from __future__ import annotations

import pytest
from perplexity import llama_cpp_fixture, llama_perplexity, passage_as_llama_perplexity_reads_it

from flm_runtime import paths
from flm_runtime.loading import load_model_files
from flm_runtime.models.causal_lm import LlamaModel

# Recorded once by tests/reference/llama_cpp.py (command, date, llama.cpp commit inside).
LLAMA_CPP = llama_cpp_fixture("gemma3_270m_llama_cpp_perplexity.json")


# float32 and the default weights (one int8 activation level, as llama.cpp's: docs/design.md)
@pytest.mark.parametrize("weights", ["f32", "auto"])
def test_perplexity_is_within_1_percent_of_llama_cpps(gemma3_gguf, weights):
    bundle = load_model_files(gemma3_gguf, weights=weights, keep=paths.converted_dir())
    tok = bundle.tokenizer
    ids = tok.encode(passage_as_llama_perplexity_reads_it())  # BOS first: Gemma adds it
    model = LlamaModel(bundle.config, bundle.weights)
    ppl, n_chunks = llama_perplexity(model, ids, LLAMA_CPP["n_ctx"], tok.bos_token_id)
    assert n_chunks == LLAMA_CPP["chunks"]
    assert abs(ppl / LLAMA_CPP["perplexity"] - 1) < 0.01, ppl
