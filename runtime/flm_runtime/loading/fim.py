"""A vocabulary's fill-in-the-middle (FIM) tokens, found as llama.cpp finds them.

A code model trained for FIM (Qwen2.5-Coder, StarCoder, CodeLlama, DeepSeek-Coder, Granite) reads
``<prefix token>{prefix}<suffix token>{suffix}<middle token>`` and writes the text that goes
between the two (Bavarian et al. 2022, "PSM" order). llama.cpp (``llama_vocab::impl::load`` in
src/llama-vocab.cpp, the llama.cpp of llama-cpp-python 0.3.36) takes each of the six FIM tokens
from its GGUF key when the file has one, else from a vocabulary entry whose text is one it knows
(``FIM_TOKEN_TEXTS``; of several, whichever its hash map yields first: here the first in that
table's order). The pad, repository and file-separator tokens then end generation (they are in
its end-of-generation set): a model that has filled the gap goes on with padding or with the
next file of a repository.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# Each FIM token's texts, in llama.cpp's order (its comments name the families: Qwen's first).
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
               "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
               "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
               "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}

# Each FIM token's GGUF keys; llama.cpp reads the deprecated one (second) last, so it wins.
GGUF_FIM_KEYS: dict[str, tuple[str, ...]] = {
    "prefix": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suffix": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "middle": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "repo": ("tokenizer.ggml.fim_rep_token_id",),
    "file_sep": ("tokenizer.ggml.fim_sep_token_id",),
}


class FimTokens(NamedTuple):
    """A vocabulary's FIM token ids; None where it has no such token."""

    prefix: int | None = None
    suffix: int | None = None
    middle: int | None = None
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    @property
    def missing(self) -> tuple[str, ...]:
        """The names of the tokens a prefix-suffix-middle prompt needs and the vocabulary lacks."""
        return tuple(name for name in ("prefix", "suffix", "middle") if getattr(self, name) is None)

    @property
    def end_ids(self) -> frozenset[int]:
        """The FIM tokens that end generation (llama.cpp's end-of-generation set): pad, repo, file_sep."""
        return frozenset(i for i in (self.pad, self.repo, self.file_sep) if i is not None)


def gguf_fim_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    """The FIM token ids a GGUF file's metadata gives (``GGUF_FIM_KEYS``), by name."""
    found = {}
    for name, keys in GGUF_FIM_KEYS.items():
        for key in keys:
            if meta.get(key) is not None:
                found[name] = meta[key]
    return found


def find_fim_tokens(token_to_id: Callable[[str], int | None], given: Mapping[str, int] | None = None) -> FimTokens:
    """The FIM tokens of a vocabulary: each one ``given`` by id (a GGUF key), else the first of its
    ``FIM_TOKEN_TEXTS`` that ``token_to_id`` (the vocabulary's text -> id) finds; None if none."""
    given = given or {}
    ids = {}
    for name, texts in FIM_TOKEN_TEXTS.items():
        ids[name] = given.get(name)
        if ids[name] is None:
            ids[name] = next((i for i in map(token_to_id, texts) if i is not None), None)
    return FimTokens(**ids)
