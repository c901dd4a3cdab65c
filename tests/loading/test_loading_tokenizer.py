"""Tokenizer: the SmolLM2 vocabulary from its GGUF, and a tiny vocabulary written here."""

from __future__ import annotations

import random

import pytest
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf, write_tiny_hf_dir
from tokenizers import pre_tokenizers

from flm_runtime.errors import ModelFormatError
from flm_runtime.loading.gguf import open_gguf
from flm_runtime.loading.tokenizer import Tokenizer, gguf_pre_tokenizer

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
    assert tok.stop_token_ids == frozenset({0, 2})
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
    regex = pytest.importorskip("regex")
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
    ("gpt2", ["12345", "Ġapples"]),
    ("default", ["12345", "Ġapples"]),
    ("llama-bpe", ["123", "45", "Ġapples"]),
])
def test_pre_tokenizers_split_numbers_like_their_models(pre, pieces):
    got = [p for p, _ in gguf_pre_tokenizer(pre).pre_tokenize_str("12345 apples")]
    assert got == pieces


def test_unknown_pre_tokenizer_and_sentencepiece_are_rejected():
    with pytest.raises(ModelFormatError, match="qwen2"):
        gguf_pre_tokenizer("qwen2")
    with pytest.raises(ModelFormatError, match="'llama'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
