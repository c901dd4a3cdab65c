"""gemma3:270m's perplexity against llama.cpp's ``llama-perplexity``, computed the same way."""

from __future__ import annotations

from perplexity import llama_cpp_fixture, llama_perplexity, passage_as_llama_perplexity_reads_it

# Recorded once by tests/reference/llama_cpp.py (command, date, llama.cpp commit inside).
LLAMA_CPP = llama_cpp_fixture("gemma3_270m_llama_cpp_perplexity.json")


def test_perplexity_is_within_1_percent_of_llama_cpps(gemma3_gguf):
    from flm_runtime.api import load_model

    loaded = load_model("gemma3:270m")
    tok = loaded.tokenizer
    ids = tok.encode(passage_as_llama_perplexity_reads_it())  # BOS first: Gemma adds it
    ppl, n_chunks = llama_perplexity(loaded.model, ids, LLAMA_CPP["n_ctx"], tok.bos_token_id)
    assert n_chunks == LLAMA_CPP["chunks"]
    assert abs(ppl / LLAMA_CPP["perplexity"] - 1) < 0.01, ppl
