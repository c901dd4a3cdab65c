"""qwen2.5-coder:0.5b and :1.5b, the real models every speed figure is measured on: their perplexity
with the default weights against llama.cpp's ``llama-perplexity`` on the same GGUF, computed the
same way (tests/models/perplexity.py)."""

from __future__ import annotations

import pytest
from perplexity import llama_cpp_fixture, llama_perplexity, passage_as_llama_perplexity_reads_it

from flm_runtime import paths, registry
from flm_runtime.loading import load_model_files
from flm_runtime.models.causal_lm import CausalLM
from flm_runtime.pull import locate

# Recorded once by tests/reference/llama_cpp.py (command, date, llama.cpp commit inside).
LLAMA_CPP = {tag: llama_cpp_fixture(f"qwen2.5_coder_{tag.partition(':')[2]}_llama_cpp_perplexity.json")
             for tag in ("qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b")}


@pytest.mark.parametrize("tag", LLAMA_CPP)
def test_perplexity_with_the_default_weights_is_within_1_percent_of_llama_cpps(tag):
    reference = LLAMA_CPP[tag]
    assert reference["model_sha256"] == registry.resolve(tag).files[0].sha256
    # The default weights, whatever FLM_WEIGHTS the suite sets: a float32 1.5B would take 7 GB.
    bundle = load_model_files(locate(tag), weights="auto", keep=paths.converted_dir())
    tok = bundle.tokenizer
    assert not tok.add_bos  # so llama-perplexity keeps each chunk's first token, as we do (bos=None)
    ids = tok.encode(passage_as_llama_perplexity_reads_it())
    ppl, n_chunks = llama_perplexity(CausalLM(bundle.config, bundle.weights), ids, reference["n_ctx"], None)
    assert n_chunks == reference["chunks"]
    assert abs(ppl / reference["perplexity"] - 1) < 0.01, (ppl, reference["perplexity"])
