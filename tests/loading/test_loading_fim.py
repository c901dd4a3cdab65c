"""Fill-in-the-middle tokens, the tokens that end generation and the FIM prompt, against llama.cpp's
(``tests/data/*_llama_cpp_fim.json``, recorded by ``tests/reference/llama_cpp.py fim``: the tokens
its vocabulary loader finds and ``llama-tokenize``'s ids with and without ``--no-parse-special``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flm_runtime.errors import InvalidRequestError, ModelFormatError
from flm_runtime.loading.fim import FimTokens
from flm_runtime.loading.gguf import open_gguf
from flm_runtime.loading.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
QWEN = json.loads((DATA / "qwen2.5_coder_0.5b_llama_cpp_fim.json").read_text(encoding="utf-8"))
SMOLLM2 = json.loads((DATA / "smollm2_135m_llama_cpp_fim.json").read_text(encoding="utf-8"))
# '</s>': llama.cpp ends generation at every token of that text (a rule added for PaddleOCR's
# vocabulary), a normal token in Qwen's; so do we (docs/design.md, "Tokenization as llama.cpp").
QWEN_PLAIN_END_TAG = 128247
TEMPLATED = QWEN["cases"][0]["text"]  # <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>
PREFIX, SUFFIX = TEMPLATED.removeprefix("<|fim_prefix|>").removesuffix("<|fim_middle|>").split("<|fim_suffix|>")


@pytest.fixture(scope="module")
def qwen_metadata(qwen_coder_gguf):
    return open_gguf(qwen_coder_gguf).metadata


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_metadata):
    return Tokenizer.from_gguf(qwen_metadata)


@pytest.mark.parametrize("fixture, tag", [(QWEN, "qwen2.5-coder:0.5b"), (SMOLLM2, "smollm2:135m")])
def test_fixtures_are_of_the_registered_files(fixture, tag):
    from flm_runtime import registry

    assert fixture["model_sha256"] == registry.resolve(tag).files[0].sha256


def test_qwen_fim_tokens_are_llama_cpps(qwen_tokenizer):
    assert qwen_tokenizer.fim._asdict() == QWEN["fim_tokens"]


def test_qwen_generation_ends_where_llama_cpps_does(qwen_tokenizer):
    tok = qwen_tokenizer
    assert tok.token_bytes(QWEN_PLAIN_END_TAG) == b"</s>" and QWEN_PLAIN_END_TAG in tok.special_token_ids
    assert tok.stop_token_ids == set(QWEN["eog"])
    assert tok.fim.end_ids == {tok.fim.pad, tok.fim.repo, tok.fim.file_sep}


def test_smollm2_has_llama_cpps_repo_token_and_end_tokens_but_cannot_fill_in(smollm2_tokenizer):
    assert smollm2_tokenizer.fim == FimTokens(**SMOLLM2["fim_tokens"]) == FimTokens(repo=4)
    assert smollm2_tokenizer.stop_token_ids == set(SMOLLM2["eog"])
    with pytest.raises(InvalidRequestError, match="no FIM prefix/suffix/middle token") as info:
        smollm2_tokenizer.encode_fim("def f():\n    ", "\n")
    assert info.value.param == "suffix"


@pytest.mark.parametrize("case", QWEN["cases"], ids=["templated", "spelled in code"])
def test_qwen_ids_with_and_without_special_tokens_parsed_equal_llama_cpps(qwen_tokenizer, case):
    assert qwen_tokenizer.encode(case["text"]) == case["ids"]
    assert qwen_tokenizer.encode(case["text"], parse_special=False) == case["ids_no_parse_special"]


def test_qwen_fim_prompt_is_the_hand_templated_one(qwen_tokenizer):
    assert qwen_tokenizer.encode_fim(PREFIX, SUFFIX) == QWEN["cases"][0]["ids"]


def test_a_fim_prefix_that_spells_control_tokens_stays_literal(qwen_tokenizer):
    code = QWEN["cases"][1]  # spells <|endoftext|>, <|fim_middle|> (control) and <tool_call> (user-defined)
    fim = qwen_tokenizer.fim
    assert qwen_tokenizer.encode_fim(code["text"], "") == [fim.prefix, *code["ids_no_parse_special"], fim.suffix,
                                                           fim.middle]


def test_gguf_keys_name_fim_tokens_before_their_texts(qwen_metadata):
    # llama.cpp reads the deprecated key after the current one, so it wins.
    keyed = {**qwen_metadata, "tokenizer.ggml.fim_pre_token_id": 100, "tokenizer.ggml.prefix_token_id": 101,
             "tokenizer.ggml.fim_pad_token_id": 102}
    tok = Tokenizer.from_gguf(keyed)
    assert (tok.fim.prefix, tok.fim.suffix, tok.fim.pad) == (101, QWEN["fim_tokens"]["suffix"], 102)
    assert tok.stop_token_ids == set(QWEN["eog"]) - {QWEN["fim_tokens"]["pad"]} | {102}


def test_a_fim_token_id_outside_the_vocabulary_is_refused(qwen_metadata):
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.fim_mid_token_id is 151936, not a token id"):
        Tokenizer.from_gguf({**qwen_metadata, "tokenizer.ggml.fim_mid_token_id": 151936})
