"""Tokenizers built from a model's own files (GGUF metadata or tokenizer.json): byte-level BPE and
SentencePiece BPE.

Encoding runs in Hugging Face ``tokenizers`` (Rust). Decoding is ours: every token id maps to the
exact bytes it stands for (``token_bytes``, precomputed), and ``decode`` joins those bytes. The
engine's incremental detokenizer uses the same table, so streamed text and ``decode`` agree by
construction.

Byte-level BPE (GPT-2, Radford et al. 2019; GGUF ``tokenizer.ggml.model == "gpt2"``, or a
tokenizer.json with a ``ByteLevel`` decoder) writes each byte as one printable character:
printable Latin-1 bytes stand for themselves, the 68 others for ``chr(256 + n)`` in byte order
(space -> ``Ġ``, newline -> ``Ċ``). Added/special tokens (``<|im_start|>``) are plain UTF-8 text.

SentencePiece BPE (Kudo & Richardson 2018; GGUF ``tokenizer.ggml.model == "llama"``: Llama 2,
Gemma) stores pieces as UTF-8 text with ``▁`` (U+2581) for a space, a score per piece and no merges,
plus 256 byte tokens ``<0x00>`` .. ``<0xFF>`` for characters no piece covers (byte fallback).
llama.cpp's tokenizer (``llm_tokenizer_spm`` in ``src/llama-vocab.cpp``) starts from the text's
characters and repeatedly joins the adjacent pair whose concatenation is the piece of highest
score; BPE whose merges are ranked by the score of the piece they make does the same
(``sentencepiece_merges``). Text is cut at control and user-defined tokens first, and a space is
put before each remaining fragment when ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default:
true; Gemma's GGUF says false). A tokenizer.json of this kind is not read yet.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from flm_runtime.errors import InvalidRequestError, ModelFormatError
from flm_runtime.loading.chat_template import (TOOL_CALL_MARKERS, ThinkingFormat, check_chat_template,
                                               render_chat_template, thinking_format)
from flm_runtime.loading.fim import FIM_TOKEN_TEXTS, GGUF_FIM_KEYS, find_fim_tokens, gguf_fim_ids
from flm_runtime.loading.hf_files import read_hf_tokenizer_files

# GGUF tokenizer.ggml.token_type values (llama.cpp llama_token_type).
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5

SPACE_PIECE = "\u2581"  # "▁": SentencePiece's space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token

# Tokens that end generation, by their text: llama.cpp's end-of-generation list (src/llama-vocab.cpp),
# less the markers of formats we do not load. Each that is an added token stops generation; in a
# GGUF, llama.cpp makes each a control token whatever its type says (Qwen 2.5's vocabulary holds
# "</s>" as a normal token: llama.cpp reads "</s>" in a prompt as one token and stops at it).
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
)

# llama.cpp's split rules per ``tokenizer.ggml.pre`` name (``llama_vocab::impl::load`` and
# ``llm_tokenizer_bpe`` in src/llama-vocab.cpp, the llama.cpp of llama-cpp-python 0.3.36): the
# regexes run in turn, each splitting the pieces the one before left; text no regex matches stays a
# piece of its own. Where llama.cpp rewrites a tokenizer.json regex for its own regex engine
# (case-insensitive contractions, ``\p{Lu}``-style classes), the original is written here: the
# ``tokenizers`` engine reads it, and the corpus tests hold the two equal on real vocabularies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizerRule(NamedTuple):
    """How llama.cpp cuts text before byte-level BPE for one ``tokenizer.ggml.pre`` family."""

    splits: tuple[str, ...]  # regexes, applied in turn
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is taken as it is


_RULES = {
    "default": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt2": PreTokenizerRule((_GPT2_SPLIT,)),
    "smollm": PreTokenizerRule((r"\p{N}", _GPT2_SPLIT)),
    "llama3": PreTokenizerRule((_LLAMA3_SPLIT,), ignore_merges=True),
    "qwen2": PreTokenizerRule((_QWEN2_SPLIT,)),
    "tekken": PreTokenizerRule((_TEKKEN_SPLIT,), ignore_merges=True),
    "gpt4o": PreTokenizerRule((_GPT4O_SPLIT,)),
}
# The names llama.cpp's GGUF writer gives the families we load, and llama.cpp's aliases of them.
PRE_TOKENIZERS = {
    "default": _RULES["default"],
    "gpt-2": _RULES["gpt2"],  # GPT-2 and Phi-2
    "smollm": _RULES["smollm"],  # SmolLM, SmolLM2
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), _RULES["llama3"]),  # Llama 3.x
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _RULES["qwen2"]),  # Qwen 2, 2.5, 3
    "tekken": _RULES["tekken"],  # Mistral Nemo, Mistral Small 3
    **dict.fromkeys(("gpt-4o", "llama4"), _RULES["gpt4o"]),  # Phi-4-mini
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (the 188 printable Latin-1 bytes keep their code point)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
# The table as str.translate's (each character to the Latin-1 character of its byte), and the
# characters outside it: one C-speed pass per token over a 49k vocabulary at every load.
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _UNICODE_TO_BYTE.items()})
_OUTSIDE_TABLE = re.compile(f"[^{re.escape(''.join(_UNICODE_TO_BYTE))}]")


def byte_level_to_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for (``"Ġworld"`` -> ``b" world"``).

    A character outside the table (possible only in a malformed vocabulary) is kept as UTF-8.
    """
    if _OUTSIDE_TABLE.search(token) is None:
        return token.translate(_TO_LATIN1).encode("latin-1")
    table = _UNICODE_TO_BYTE
    return b"".join(bytes([table[c]]) if c in table else c.encode() for c in token)


def sentencepiece_to_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: ``"▁world"`` -> ``b" world"``, a byte token
    ``"<0x0A>"`` -> ``b"\\n"``."""
    if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
        return bytes([int(m.group(1), 16)])
    return piece.replace(SPACE_PIECE, " ").encode("utf-8")


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template.

    Built over a ``tokenizers.Tokenizer`` (``hf``); ``piece_bytes`` maps one of its vocabulary
    pieces to the bytes it stands for (``byte_level_to_bytes`` or ``sentencepiece_to_bytes``);
    ``textless_ids`` are vocabulary tokens that are no text although ``hf`` has them as pieces
    (GGUF UNKNOWN and UNUSED: see ``special_token_ids``).

    Attributes:
        vocab_size: number of token ids (V); ids are ``0 .. V-1``.
        bos_token_id, eos_token_id: ``None`` when the model has none.
        add_bos: ``encode`` prepends BOS (the model's ``add_bos_token``).
        stop_token_ids: ids that end generation: EOS plus the end-of-turn tokens present
            (``END_OF_TURN_TOKENS``, GGUF ``eot``/``eom`` ids, every generation_config EOS) and
            the FIM tokens that end a fill-in (``fim.end_ids``).
        fim: the vocabulary's fill-in-the-middle tokens (``flm_runtime.loading.fim``).
        special_token_ids: the tokens that stand for no text of the user's: dropped by
            ``decode(skip_special_tokens=True)`` and from generated text, and special (never
            spelled by text) to a grammar. llama.cpp's rule (``token_to_piece`` without
            ``special``): GGUF CONTROL and UNKNOWN tokens, and UNUSED ones, which stand for no
            bytes there; USER_DEFINED tokens are text (Gemma 3's ``<start_of_image>`` and HTML
            tags). From a tokenizer.json: the added tokens marked ``special``. Never the markers a
            parser reads from the output, which llama.cpp keeps as its ``preserved_tokens``: the
            thinking markers (``thinking``) and the tool-call markers (``TOOL_CALL_MARKERS``).
        missing_bytes: byte values no token stands for; ``encode`` drops them, as the model's
            Hugging Face tokenizer does (SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and
            bytes never seen in UTF-8). Text without them round-trips exactly.
        chat_template: Jinja source, or ``None``: a base model (``apply_chat_template`` raises
            ``NoChatTemplateError``).
        thinking: the template's thinking switch and output markers (``thinking_format``), or
            ``None`` when the template has no switch. A registry entry may declare its own
            (``flm_runtime.api.load_model`` sets it then; setting it updates ``special_token_ids``).
    """

    def __init__(self, hf: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None, source: str,
                 piece_bytes: Callable[[str], bytes] = byte_level_to_bytes, fim_ids: Mapping[str, int] | None = None,
                 textless_ids: frozenset[int] = frozenset()):
        self._hf = hf
        self._encode_lock = threading.Lock()  # literal encoding flips the shared tokenizer's encode_special_tokens
        self.source = source
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.add_bos = add_bos
        self.chat_template = chat_template or None
        check_chat_template(self.chat_template, source)
        added = hf.get_added_tokens_decoder()  # id -> AddedToken
        self._special_ids = frozenset(i for i, t in added.items() if t.special) | textless_ids
        self._added_ids = {t.content: i for i, t in added.items()}
        self.thinking = thinking_format(self.chat_template)
        self._token_bytes = _token_bytes_table(hf, added, piece_bytes)
        self.vocab_size = len(self._token_bytes)
        self.missing_bytes = _missing_bytes(self._token_bytes, added)
        eot = {i for i, t in added.items() if t.content in END_OF_TURN_TOKENS}
        self.fim = find_fim_tokens(hf.token_to_id, fim_ids)
        self.stop_token_ids = frozenset({*eos_token_ids, *eot, *self.fim.end_ids})

    @property
    def thinking(self) -> ThinkingFormat | None:
        return self._thinking

    @thinking.setter
    def thinking(self, fmt: ThinkingFormat | None) -> None:
        # A vocabulary may make the markers control tokens; the output must keep them to be parsed.
        self._thinking = fmt
        markers = (fmt.start, fmt.end, *TOOL_CALL_MARKERS) if fmt is not None else TOOL_CALL_MARKERS
        self.special_token_ids = self._special_ids - {self._added_ids.get(m) for m in markers}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], *, source: str = "GGUF") -> "Tokenizer":
        """Build from the ``tokenizer.*`` metadata of a GGUF file.

        Args:
            meta: the file's metadata (``flm_runtime.loading.gguf.open_gguf(path).metadata``).
            source: file name for error messages.

        Raises:
            ModelFormatError: a tokenizer model other than byte-level BPE (``"gpt2"``) or
                SentencePiece (``"llama"``), an unknown ``tokenizer.ggml.pre``, missing tokens,
                merges (``gpt2``) or scores (``llama``), a ``tokenizer.*`` value of the wrong
                type or a special token id outside the vocabulary (``check_gguf_tokenizer_keys``),
                or a chat template that names an attribute outside its sandbox
                (``check_chat_template``).
        """
        check_gguf_tokenizer_keys(meta, source)
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind == "gpt2":
            hf, piece_bytes = _byte_level_bpe(meta, source), byte_level_to_bytes
        elif kind == "llama":
            hf, piece_bytes = _sentencepiece_bpe(meta, source), sentencepiece_to_bytes
        else:
            raise ModelFormatError(
                f"{source}: tokenizer model {kind!r} is not supported "
                f"(byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
        token_types = meta.get("tokenizer.ggml.token_type") or []
        _add_gguf_special_tokens(hf, tokens, token_types)
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
        # llama.cpp renders an UNKNOWN token as a control one and an UNUSED one as no bytes at all.
        textless = frozenset(i for i, k in enumerate(token_types) if k in (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_UNUSED))
        return cls(hf, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=list(dict.fromkeys(eos)),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"), source=source,
                   piece_bytes=piece_bytes, fim_ids=gguf_fim_ids(meta), textless_ids=textless)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Build from a Hugging Face model directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (chat template, BOS/EOS
        text, ``add_bos_token``), ``chat_template.jinja``, ``generation_config.json`` and
        ``config.json`` (EOS ids; generation_config's list wins).

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``path``.
            ModelFormatError: not a byte-level BPE tokenizer, unreadable JSON, or a chat template
                that names an attribute outside its sandbox (``check_chat_template``).
        """
        files = read_hf_tokenizer_files(Path(path))
        hf = HFTokenizer.from_str(files.tokenizer_json)
        bos = hf.token_to_id(files.bos_token) if files.bos_token else None
        bos = files.bos_token_id if bos is None else bos
        # The tokenizer's own EOS first (HF's tokenizer.eos_token_id), then generation_config's.
        eos_text_id = hf.token_to_id(files.eos_token) if files.eos_token else None
        eos = [i for i in (eos_text_id, *files.eos_token_ids) if i is not None]
        add_bos = files.add_bos_token
        if add_bos is None:
            add_bos = _post_processor_adds_bos(hf, bos)
        return cls(hf, bos_token_id=bos, eos_token_ids=list(dict.fromkeys(eos)),
                   add_bos=add_bos, chat_template=files.chat_template, source=str(path))

    # -- encoding / decoding -----------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their single id.

        Args:
            text: any Unicode string.
            add_bos: prepend BOS; ``None`` -> the model's own setting (``self.add_bos``). BOS is
                never doubled: text that already starts with the BOS token keeps only that one.
            parse_special: False: the text of a control token is encoded as the plain text it is
                (user-defined tokens still match whole), as llama.cpp's ``parse_special=false``.

        Returns:
            ids, each in ``0 .. vocab_size-1``.
        """
        with self._encode_lock:
            self._hf.encode_special_tokens = not parse_special
            try:
                ids = self._hf.encode(text, add_special_tokens=False).ids
            finally:
                self._hf.encode_special_tokens = False
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_fim(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt of the gap between ``prefix`` and ``suffix``:
        ``[BOS] <prefix token> prefix <suffix token> suffix <middle token>`` as token ids, the
        model then writing the middle (BOS only where the model adds one).

        The prefix and suffix are literal text (``parse_special=False``), as llama.cpp's
        ``/infill`` encodes them: code that spells a control token cannot break the template.

        Raises:
            InvalidRequestError: ``param="suffix"``; the vocabulary lacks a FIM prefix, suffix or
                middle token (``fim``).
        """
        if missing := self.fim.missing:
            raise InvalidRequestError(
                f"suffix (fill-in-the-middle) needs a model trained for it; this model's vocabulary has no FIM "
                f"{'/'.join(missing)} token (Qwen2.5-Coder has {', '.join(FIM_TOKEN_TEXTS[m][0] for m in missing)})",
                param="suffix")
        ids = [self.fim.prefix, *self.encode(prefix, add_bos=False, parse_special=False), self.fim.suffix,
               *self.encode(suffix, add_bos=False, parse_special=False), self.fim.middle]
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD.

        Equal to ``b"".join(token_bytes(i)).decode("utf-8", "replace")``.
        """
        table = self._token_bytes
        if skip_special_tokens:
            special = self.special_token_ids
            data = b"".join([table[i] for i in ids if i not in special])
        else:
            data = b"".join([table[i] for i in ids])
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (a special token: its UTF-8 text).

        A single token may hold part of a multi-byte character (emoji are often 2-4 tokens).
        """
        return self._token_bytes[token_id]

    @property
    def token_bytes_table(self) -> list[bytes]:
        """``token_bytes`` for every id, as one list (index = token id); do not mutate."""
        return self._token_bytes

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of a token (``"Ġworld"`` byte-level, ``"▁world"`` SentencePiece)."""
        return self._hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or ``None``."""
        return self._hf.token_to_id(token)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (its own ``decode`` is an independent check)."""
        return self._hf

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` with the model's chat template (see ``chat_template``).

        Raises:
            InvalidRequestError: ``param="messages"``; the template or the messages are invalid.
            ModelFormatError: the template reached outside its sandbox.
        """
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id), template_source=self.source, **extra)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token_id}, stop={sorted(self.stop_token_ids)})")


def _is_list_of(*types: type) -> Callable[[Any], bool]:
    return lambda v: type(v) is list and all(type(x) in types for x in v)


# GGUF tokenizer key -> (test of its value, what it must be).
_GGUF_TOKENIZER_TYPES = {
    **dict.fromkeys(("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"),
                    (lambda v: type(v) is str, "a string")),
    **dict.fromkeys(("tokenizer.ggml.tokens", "tokenizer.ggml.merges"), (_is_list_of(str), "an array of strings")),
    "tokenizer.ggml.token_type": (_is_list_of(int), "an array of integers"),
    "tokenizer.ggml.scores": (_is_list_of(int, float), "an array of numbers"),
    **dict.fromkeys(("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"),
                    (lambda v: type(v) in (bool, int), "a boolean")),
}
_GGUF_TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                   "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id",
                   *(key for keys in GGUF_FIM_KEYS.values() for key in keys))


def check_gguf_tokenizer_keys(meta: dict[str, Any], source: str) -> None:
    """Check the types of a GGUF file's ``tokenizer.*`` values, and that its special token ids
    are ids of its vocabulary (``tokenizer.ggml.tokens``).

    Raises:
        ModelFormatError: naming ``source``, the key and what its value must be.
    """
    for key, (test, expected) in _GGUF_TOKENIZER_TYPES.items():
        if meta.get(key) is not None and not test(meta[key]):
            raise ModelFormatError(f"{source}: metadata key {key} is not {expected}")
    n = len(meta.get("tokenizer.ggml.tokens") or [])
    for key in _GGUF_TOKEN_IDS:
        value = meta.get(key)
        if value is not None and not (type(value) is int and 0 <= value < n):
            raise ModelFormatError(f"{source}: metadata key {key} is {value!r}, not a token id (0 to {n - 1})")


def _byte_level_bpe(meta: dict[str, Any], source: str) -> HFTokenizer:
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelFormatError(f"{source}: tokenizer.ggml.tokens or .merges is missing")
    pre = meta.get("tokenizer.ggml.pre", "default")
    hf = HFTokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=_pre_tokenizer_rule(pre, source).ignore_merges,
    ))
    hf.pre_tokenizer = gguf_pre_tokenizer(pre, source)
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(meta: dict[str, Any], source: str) -> HFTokenizer:
    tokens, scores = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.scores")
    if not tokens or scores is None or len(scores) != len(tokens):
        raise ModelFormatError(f"{source}: tokenizer.ggml.tokens or .scores is missing, or they differ in length")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    hf = HFTokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=sentencepiece_merges(tokens, scores),
        unk_token=tokens[unk] if unk is not None else None,
        byte_fallback=True,  # a character no piece covers becomes its UTF-8 bytes' <0xNN> tokens
    ))
    steps = [normalizers.Replace(" ", SPACE_PIECE)]
    unprefix = []
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # Prepend runs per fragment between added tokens: llama.cpp's space after a special token.
        steps.insert(0, normalizers.Prepend(SPACE_PIECE))
        unprefix = [decoders.Strip(" ", 1, 0)]
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse(), *unprefix])
    return hf


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece BPE over ``tokens`` (pieces) and ``scores``.

    Every split of a piece into two pieces is a merge, ranked by the score of the piece it makes
    (highest first: the order in which llama.cpp's ``llm_tokenizer_spm`` joins pairs), then by
    that piece's id, then by the ids of the two halves (the list Hugging Face's
    ``SentencePieceExtractor`` builds). Byte tokens make no merges (only text, never a ``<0xNN>``
    literal, is merged).

    Returns:
        (left, right) pairs, best first.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i in sorted(range(len(tokens)), key=lambda i: -scores[i]):  # stable: equal scores by id
        piece = tokens[i]
        if _BYTE_PIECE.fullmatch(piece):
            continue
        splits = [(left, right) for cut in range(1, len(piece))
                  if (left := piece[:cut]) in ids and (right := piece[cut:]) in ids]
        if len(splits) > 1:
            splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        merges += splits
    return merges


def gguf_pre_tokenizer(pre: str, source: str = "GGUF") -> Any:
    """The ``tokenizers`` pre-tokenizer that cuts text as llama.cpp does for ``tokenizer.ggml.pre``
    (``PRE_TOKENIZERS``), then maps bytes to GPT-2's characters.

    Raises:
        ModelFormatError: a name not in ``PRE_TOKENIZERS``, listing those that are.
    """
    rule = _pre_tokenizer_rule(pre, source)
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in rule.splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer_rule(pre: str, source: str) -> PreTokenizerRule:
    if (rule := PRE_TOKENIZERS.get(pre)) is None:
        raise ModelFormatError(f"{source}: pre-tokenizer {pre!r} is not supported "
                               f"(supported: {', '.join(PRE_TOKENIZERS)})")
    return rule


def _add_gguf_special_tokens(hf: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    # CONTROL tokens are special (skippable); USER_DEFINED are matched whole but kept in text.
    types = [*token_types, *[None] * (len(tokens) - len(token_types))]
    control = [t for t, k in zip(tokens, types) if k == TOKEN_TYPE_CONTROL or t in END_OF_TURN_TOKENS]
    user = [t for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED and t not in END_OF_TURN_TOKENS]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _token_bytes_table(hf: HFTokenizer, added: dict[int, AddedToken],
                       piece_bytes: Callable[[str], bytes]) -> list[bytes]:
    vocab = hf.get_vocab(with_added_tokens=False)  # piece -> id
    size = max([*vocab.values(), *added.keys()]) + 1
    table = [b""] * size  # ids the vocabulary skips stand for nothing
    for token, i in vocab.items():
        table[i] = piece_bytes(token)
    for i, t in added.items():
        table[i] = t.content.encode("utf-8")
    return table


def _missing_bytes(table: list[bytes], added: dict[int, AddedToken]) -> frozenset[int]:
    single = {t[0] for i, t in enumerate(table) if len(t) == 1 and i not in added}
    return frozenset(set(range(256)) - single)


def _post_processor_adds_bos(hf: HFTokenizer, bos: int | None) -> bool:
    if bos is None:
        return False
    with_special = hf.encode("a", add_special_tokens=True).ids
    without = hf.encode("a", add_special_tokens=False).ids
    return with_special[:1] == [bos] and without[:1] != [bos]
