"""Tokenizer: the SmolLM2 vocabulary from its GGUF, tiny vocabularies written here (byte-level BPE and
SentencePiece), every real vocabulary we ship (SmolLM2, Gemma 3, Qwen 2.5) against llama.cpp's tokenizer,
and the output text of every token of Gemma 3's and Qwen2.5-Coder's vocabularies against llama.cpp's."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import pytest
import regex
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf, write_tiny_hf_dir
from tokenizers import pre_tokenizers

from flm_runtime import registry
from flm_runtime.errors import ModelFormatError
from flm_runtime.loading.gguf import open_gguf
from flm_runtime.loading.tokenizer import Tokenizer, gguf_pre_tokenizer, sentencepiece_merges

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "こんにちは世界、カタカナとひらがな。",
    "Привет, мир! Ελληνικά. עברית. العربية. हिन्दी में लिखा।",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\r\n}",
    "    leading spaces, trailing spaces    ",
    "\n\n\n  \t \t\n   multiple\u3000whitespace\u00a0runs  \n",
    "Digits 1234567890, 3.14159, 1e-5, ١٢٣ and ² ½ and 一二三",
    "café naïve résumé e\u0301 Å Ω ≠ ∑ ∫ √ ∞ → ⇒ ©®™ \x00\x01\x7f",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "not special: <|im_ <|im_start <|endoftext| |im_end|>",
    "",
    " ",
    "a",
]


def _fuzz_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ranges = [(0x20, 0x7F), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000),
              (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0, 0x20)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randrange(lo, hi)))
        out.append("".join(chars))
    return out


# Control characters SmolLM2's vocabulary has no byte token for (see Tokenizer.missing_bytes).
_SMOLLM2_MISSING = "\x04\x06\x13\x14\x16\x1d"


@pytest.mark.parametrize("text", CORPUS + _fuzz_strings(200))
def test_smollm2_round_trip_is_exact(smollm2_tokenizer, text):
    text = "".join(c for c in text if c not in _SMOLLM2_MISSING)
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert b"".join(smollm2_tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_smollm2_bytes_without_a_token_are_dropped_like_hf(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.missing_bytes == frozenset(
        [4, 6, 19, 20, 22, 29, 192, 193, *range(245, 256), 241, 242])
    ids = tok.encode("a\x04b")
    assert ids == tok.hf_tokenizer.encode("a\x04b", add_special_tokens=False).ids
    assert tok.decode(ids) == "ab"


def test_smollm2_invariants_from_design(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("123") == [33, 34, 35]  # digits split individually ('0' is id 32)
    assert len(tok.encode("2024")) == 4
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.stop_token_ids == frozenset({0, 2, 4})  # and <reponame>, llama.cpp's FIM repo token (test_loading_fim)
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.encode("hello") == tok.encode("hello", add_bos=False)
    assert tok.encode("hello", add_bos=True)[0] == 1


def test_smollm2_special_tokens_are_skippable(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi!"


def test_smollm2_token_bytes_agree_with_tokenizers_decode_for_every_id(smollm2_tokenizer):
    # Independent path: the Rust ByteLevel decoder of `tokenizers` on each id, and on runs of ids
    # that together form whole characters.
    tok = smollm2_tokenizer
    hf = tok.hf_tokenizer
    for i in range(tok.vocab_size):
        expected = hf.decode([i], skip_special_tokens=False)
        assert tok.token_bytes(i).decode("utf-8", "replace") == expected, i
    for text in CORPUS:
        ids = tok.encode(text)
        expected = hf.decode(ids, skip_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == expected


def test_smollm2_token_bytes_agree_with_gguf_vocab(smollm2_gguf, smollm2_tokenizer):
    # The GGUF token strings themselves: byte-level pieces must map back to the bytes they encode,
    # e.g. 'Ġworld' -> b' world', 'Ċ' -> b'\n'.
    tokens = open_gguf(smollm2_gguf).metadata["tokenizer.ggml.tokens"]
    tok = smollm2_tokenizer
    assert tok.token_bytes(tokens.index("Ġworld")) == b" world"
    assert tok.token_bytes(tokens.index("Ċ")) == b"\n"
    assert tok.token_bytes(tokens.index("<|im_start|>")) == b"<|im_start|>"
    assert [tok.id_to_token(i) for i in range(0, 49152, 997)] == tokens[::997]


def _reference_bpe_ids(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """A plain-Python byte-level BPE (digits isolated, GPT-2 regex, lowest-rank merge first)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    byte_char = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in byte_char]
    byte_char.update({b: chr(256 + n) for n, b in enumerate(others)})
    assert set(byte_char.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    vocab = {t: i for i, t in enumerate(tokens)}
    gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ids = []
    for piece in (p for p in regex.split(r"(\p{N})", text) if p):
        for word in regex.findall(gpt2, piece):
            parts = [byte_char[b] for b in word.encode("utf-8")]
            while len(parts) > 1:
                pairs = list(zip(parts, parts[1:]))
                best = min(range(len(pairs)), key=lambda j: rank.get(pairs[j], 1e18))
                if pairs[best] not in rank:
                    break
                parts[best:best + 2] = [parts[best] + parts[best + 1]]
            ids.extend(vocab[p] for p in parts if p in vocab)  # HF drops bytes with no token
    return ids


@pytest.mark.parametrize("text", [t for t in CORPUS if "<|" not in t] + _fuzz_strings(30, seed=1))
def test_smollm2_ids_match_a_reference_bpe(smollm2_metadata, smollm2_tokenizer, text):
    tokens = smollm2_metadata["tokenizer.ggml.tokens"]
    merges = smollm2_metadata["tokenizer.ggml.merges"]
    assert smollm2_tokenizer.encode(text) == _reference_bpe_ids(text, tokens, merges)


def test_smollm2_chat_template_renders_exact_chatml(smollm2_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert smollm2_tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")


def test_smollm2_rendered_prompt_encodes_specials_as_single_ids(smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = smollm2_tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


@pytest.fixture
def tiny_gguf_tokenizer(tmp_path):
    config = tiny_config()
    path = write_tiny_gguf(tmp_path / "t.gguf", config, random_hf_weights(config))
    return Tokenizer.from_gguf(open_gguf(path).metadata, source=str(path))


def test_tiny_gguf_tokenizer_merges_and_specials(tiny_gguf_tokenizer):
    tok = tiny_gguf_tokenizer
    ids = tok.encode(" the world<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["Ġthe", "Ġwor", "l", "d", "<|im_end|>"]
    assert [tok.token_bytes(i) for i in ids] == [b" the", b" wor", b"l", b"d", b"<|im_end|>"]
    assert tok.stop_token_ids == frozenset({0, 2}) and tok.vocab_size == 3 + 256 + 7


@pytest.mark.parametrize("text", CORPUS)
def test_tiny_gguf_tokenizer_round_trip(tiny_gguf_tokenizer, text):
    assert tiny_gguf_tokenizer.decode(tiny_gguf_tokenizer.encode(text)) == text


def test_tiny_hf_dir_tokenizer_matches_gguf_one(tmp_path, tiny_gguf_tokenizer):
    config = tiny_config()
    path = write_tiny_hf_dir(tmp_path / "hf", config, random_hf_weights(config))
    tok = Tokenizer.from_hf_dir(path)
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.stop_token_ids == frozenset({0, 2})
    for text in ("the world", "<|im_start|>user\nhi<|im_end|>", "a  b\n\n c"):
        assert tok.encode(text) == tiny_gguf_tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("pre,pieces", [
    ("smollm", ["1", "2", "3", "4", "5", "Ġapples"]),
    ("gpt-2", ["12345", "Ġapples"]),
    ("default", ["123", "45", "Ġapples"]),
    ("llama-bpe", ["123", "45", "Ġapples"]),
    ("qwen2", ["1", "2", "3", "4", "5", "Ġapples"]),
    ("tekken", ["1", "2", "3", "4", "5", "Ġapples"]),
    ("gpt-4o", ["123", "45", "Ġapples"]),
])
def test_pre_tokenizers_split_numbers_like_their_models(pre, pieces):
    got = [p for p, _ in gguf_pre_tokenizer(pre).pre_tokenize_str("12345 apples")]
    assert got == pieces


def test_unknown_pre_tokenizer_and_tokenizer_models_are_rejected():
    with pytest.raises(ModelFormatError, match="pre-tokenizer 'gpt2' is not supported .*qwen2"):
        gguf_pre_tokenizer("gpt2")  # the tokenizer model's name, never a pre-tokenizer's in llama.cpp
    with pytest.raises(ModelFormatError, match="tokenizer model 'rwkv' is not supported"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


# --- SentencePiece BPE: a vocabulary written here, and Gemma 3's against llama.cpp -------------

SPM_PIECES = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("bc", -5.0), ("ab", -6.0),
              ("▁a", -7.0), ("▁ab", -8.0)]
UNK, BOS, EOS, BYTE0, SPACE, A, B, C, BC, AB, SPACE_A, SPACE_AB = 0, 1, 2, 3, 259, 260, 261, 262, 263, 264, 265, 266


def spm_metadata(**extra) -> dict:
    """A SentencePiece GGUF vocabulary: <unk> <s> </s>, the 256 byte tokens, ``SPM_PIECES``."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(p for p, _ in SPM_PIECES)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in SPM_PIECES],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
            "tokenizer.ggml.unknown_token_id": UNK, "tokenizer.ggml.bos_token_id": BOS,
            "tokenizer.ggml.eos_token_id": EOS, "tokenizer.ggml.add_bos_token": False, **extra}


def test_sentencepiece_merges_follow_the_score_of_the_piece_made():
    meta = spm_metadata()
    merges = sentencepiece_merges(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])
    # best piece first; the two splits of "▁ab" by the ids of their halves ("▁" 259 < "▁a" 265)
    assert merges == [("b", "c"), ("a", "b"), ("▁", "a"), ("▁", "ab"), ("▁a", "b")]


def test_sentencepiece_joins_the_best_pair_first_and_falls_back_to_bytes():
    tok = Tokenizer.from_gguf(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.encode("abc") == [A, BC]  # "bc" (-5) beats "ab" (-6), and "abc" is no piece
    assert tok.encode(" ab") == [SPACE_AB]  # "ab" first, then "▁" + "ab"
    assert tok.encode("abcd é") == [A, BC, BYTE0 + 0x64, SPACE, BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert tok.encode("ab</s>ab") == [AB, EOS, AB]
    assert tok.encode("ab", add_bos=True) == [BOS, AB]
    assert [tok.token_bytes(i) for i in (SPACE_AB, BYTE0 + 0x64, BYTE0 + 0xC3, EOS)] == [b" ab", b"d", b"\xc3", b"</s>"]
    for text in ("abcd é", " ab  c ", "\x00\x7f☃"):
        assert tok.decode(tok.encode(text)) == text
        assert tok.hf_tokenizer.decode(tok.encode(text)) == text  # the independent Rust decoder
    assert tok.missing_bytes == frozenset()


def test_sentencepiece_space_prefix_goes_before_each_fragment_as_llama_cpp():
    # llama.cpp's default when the key is absent; after a special token the next fragment gets one too
    tok = Tokenizer.from_gguf(spm_metadata())
    assert tok.encode("ab") == [SPACE_AB]
    assert tok.encode("ab</s>ab") == [SPACE_AB, EOS, SPACE_AB]
    assert tok.decode(tok.encode("ab")) == " ab"  # the table keeps the space that encoding added
    assert tok.hf_tokenizer.decode(tok.encode("ab")) == "ab"  # HF's decoder strips it


def test_sentencepiece_needs_its_scores():
    meta = spm_metadata()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ModelFormatError, match="scores"):
        Tokenizer.from_gguf(meta)


DATA = Path(__file__).resolve().parents[1] / "data"
PASSAGE = DATA / "wizard_of_oz_ch1.txt"


def _fixture(name: str) -> dict:
    # Recorded once by tests/reference/llama_cpp.py (the command is in the fixture).
    return json.loads((DATA / name).read_text(encoding="utf-8"))


# Each real vocabulary we ship and llama.cpp's ids of the corpus (tests/reference/llama_cpp.py TEXTS)
# and of the perplexity passage, for its GGUF. Both Qwen2.5-Coder files hold the same vocabulary.
LLAMA_CPP_TOKENS = {tag: _fixture(name) for tag, name in (
    ("smollm2:135m", "smollm2_135m_llama_cpp_tokens.json"),
    ("gemma3:270m", "gemma3_270m_llama_cpp_tokens.json"),
    ("qwen2.5-coder:0.5b", "qwen2.5_coder_llama_cpp_tokens.json"),
)}
GEMMA3_LLAMA_CPP = LLAMA_CPP_TOKENS["gemma3:270m"]
PRE_TOKENIZERS_LLAMA_CPP = _fixture("pre_tokenizers_llama_cpp_tokens.json")


def _tokenizer_of(tag: str) -> Tokenizer:
    from flm_runtime.pull import locate

    gguf = locate(tag)
    return Tokenizer.from_gguf(open_gguf(gguf).metadata, source=str(gguf))


@pytest.fixture(scope="module")
def real_tokenizers() -> dict[str, Tokenizer]:
    return {tag: _tokenizer_of(tag) for tag in LLAMA_CPP_TOKENS}


@pytest.fixture(scope="module")
def gemma3_tokenizer(real_tokenizers):
    return real_tokenizers["gemma3:270m"]


@pytest.mark.parametrize("tag", LLAMA_CPP_TOKENS)
def test_llama_cpp_fixtures_are_of_the_registered_files(tag):
    from flm_runtime import registry

    assert LLAMA_CPP_TOKENS[tag]["model_sha256"] == registry.resolve(tag).files[0].sha256
    assert PRE_TOKENIZERS_LLAMA_CPP["model"] == LLAMA_CPP_TOKENS["qwen2.5-coder:0.5b"]["model"]


@pytest.mark.parametrize("tag", LLAMA_CPP_TOKENS)
def test_corpus_ids_equal_llama_cpps(real_tokenizers, tag):
    tok = real_tokenizers[tag]
    cases = LLAMA_CPP_TOKENS[tag]["cases"]
    assert [tok.encode(c["text"]) for c in cases] == [c["ids"] for c in cases]


@pytest.mark.parametrize("tag", LLAMA_CPP_TOKENS)
def test_passage_ids_equal_what_llama_perplexity_scores(real_tokenizers, tag):
    text = PASSAGE.read_text(encoding="utf-8").removesuffix("\n")  # llama-perplexity -f drops it
    assert real_tokenizers[tag].encode(text) == LLAMA_CPP_TOKENS[tag]["passage"]["ids"]


@pytest.fixture(scope="module")
def qwen_metadata(real_tokenizers) -> dict:
    return dict(open_gguf(real_tokenizers["qwen2.5-coder:0.5b"].source).metadata)


@pytest.mark.parametrize("pre", PRE_TOKENIZERS_LLAMA_CPP["ids"])
def test_every_pre_tokenizer_cuts_text_as_llama_cpp(qwen_metadata, pre):
    # Qwen 2.5's vocabulary read under each name: its 151k pieces and merges show every cut in the ids.
    tok = Tokenizer.from_gguf({**qwen_metadata, "tokenizer.ggml.pre": pre})
    assert [tok.encode(t) for t in PRE_TOKENIZERS_LLAMA_CPP["texts"]] == PRE_TOKENIZERS_LLAMA_CPP["ids"][pre]


def test_every_pre_tokenizer_name_is_checked_against_llama_cpp():
    from flm_runtime.loading.tokenizer import PRE_TOKENIZERS

    assert set(PRE_TOKENIZERS_LLAMA_CPP["ids"]) == set(PRE_TOKENIZERS)


def test_qwen_special_tokens_follow_llama_cpp(real_tokenizers):
    tok = real_tokenizers["qwen2.5-coder:0.5b"]
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (151936, 151643, 151645, False)
    # <|endoftext|>, <|im_end|>, "</s>" (a normal token of the vocabulary that llama.cpp ends on),
    # and the FIM pad, repository and file-separator tokens.
    assert tok.stop_token_ids == frozenset({151643, 151645, 128247, 151662, 151663, 151664})
    assert tok.encode("x</s>y") == [87, 128247, 88]
    assert {151657, 151658} & tok.special_token_ids == set()  # <tool_call>: user-defined, kept in text


def test_gemma3_special_tokens(gemma3_tokenizer):
    tok = gemma3_tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (262144, 2, 1, True)
    assert tok.stop_token_ids == frozenset({1, 106, 212})  # <eos>, <end_of_turn>, "</s>" (as llama.cpp)
    assert tok.chat_template is None  # a base model
    assert tok.encode("<start_of_turn>user\nHi<end_of_turn>", add_bos=False)[:1] == [105]
    assert tok.token_bytes(138) == b"  " and tok.token_bytes(107) == b"\n"  # user-defined: raw text
    assert tok.token_bytes(tok.token_to_id("<0x0A>")) == b"\n"


@pytest.mark.parametrize("text", [c["text"] for c in GEMMA3_LLAMA_CPP["cases"]] + CORPUS + _fuzz_strings(100))
def test_gemma3_round_trip_is_exact(gemma3_tokenizer, text):
    ids = gemma3_tokenizer.encode(text, add_bos=False)
    assert gemma3_tokenizer.decode(ids) == text
    assert gemma3_tokenizer.hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gemma3_token_bytes_agree_with_tokenizers_decode(gemma3_tokenizer):
    # Every id but the byte tokens (one byte alone is no UTF-8 text for the Rust decoder).
    tok = gemma3_tokenizer
    ids = [i for i in range(tok.vocab_size) if not re.fullmatch(r"<0x[0-9A-F]{2}>", tok.id_to_token(i))]
    decoded = tok.hf_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert [tok.token_bytes(i).decode("utf-8", "replace") for i in ids] == decoded


# The text of every token id in llama.cpp's output, recorded by `tests/reference/llama_cpp.py pieces`.
def _llama_cpp_pieces(name: str) -> dict:
    return json.loads((Path(__file__).resolve().parents[1] / "data" / name).read_text(encoding="utf-8"))


def _pieces_digest(pieces: list[bytes]) -> str:
    """As ``pieces_digest`` of tests/reference/llama_cpp.py: each piece after its length."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(len(piece).to_bytes(4, "little") + piece)
    return h.hexdigest()


@pytest.mark.parametrize("fixture, tokenizer", [("gemma3_270m_llama_cpp_pieces.json", "gemma3_tokenizer"),
                                                ("qwen2.5_coder_0.5b_llama_cpp_pieces.json", "qwen_coder_tokenizer")])
def test_the_output_text_of_every_token_is_llama_cpps(request, fixture, tokenizer):
    """What a generated token adds to the user's text (nothing for ``special_token_ids``, else its
    bytes) is what llama.cpp sends, for every id: CONTROL, UNKNOWN and UNUSED tokens add nothing,
    USER_DEFINED ones their text; a token spelled as an end-of-generation marker is a control token
    whatever its type (``</s>``: Gemma 3's HTML closing tag, Qwen's an ordinary piece)."""
    ref, tok = _llama_cpp_pieces(fixture), request.getfixturevalue(tokenizer)
    assert ref["model_sha256"] in {f.sha256 for e in registry.list_entries() for f in e.files}
    assert ref["vocab_size"] == tok.vocab_size
    shown = [b"" if i in tok.special_token_ids else tok.token_bytes(i) for i in range(tok.vocab_size)]
    textless = {i for i, piece in enumerate(shown) if not piece}
    llama_textless = {i for first, last in ref["textless"] for i in range(first, last + 1)}
    assert textless == llama_textless
    assert _pieces_digest(shown) == ref["pieces_sha256"]


def test_gemma3_user_defined_tokens_are_text_as_in_llama_cpp(gemma3_tokenizer):
    """``<start_of_image>`` and the HTML tags are USER_DEFINED in Gemma 3's GGUF, which llama.cpp
    writes out (``llama-server`` with this file sends ``<start_of_image>`` for token 255999 and
    ``<iframe>`` for 225); the CONTROL tokens (<bos>, <unused0>, <unk>, <end_of_turn>) add nothing."""
    tok = gemma3_tokenizer
    ids = [2, 255999, 225, 6, 3, 184, 106]
    assert [tok.id_to_token(i) for i in ids] == ["<bos>", "<start_of_image>", "<iframe>", "<unused0>", "<unk>",
                                                 "<h1>", "<end_of_turn>"]
    assert tok.decode(ids, skip_special_tokens=True) == "<start_of_image><iframe><h1>"
