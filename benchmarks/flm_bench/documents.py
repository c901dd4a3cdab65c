"""Prompts and texts for the benchmarks: short chat prompts, long documents, and prompts of an
exact token budget built from them.

- ``short_prompts``: the "~30 tokens" context of the speed table. Three prompts of our own (a
  writing, a coding and a reasoning request) or, with a path, the first turns of an MT-Bench style
  ``question.jsonl`` (``{"turns": [first, ...], ...}`` per line).
- ``load_documents``: the long documents that the long-context prompts summarize. By default the
  three public-domain texts shipped in ``texts/`` (sources and licenses in ``texts/README.md``); with
  a directory, every ``*.txt`` in it, sorted by name.
- ``summary_prompt``: "summarize this" around the longest prefix of a document that fits a token
  budget once the model's chat template is applied.
- ``longest_summary``: the largest prompt ``summary_prompt`` can fill from every given document,
  which bounds the ``max`` context of the speed tables.
- ``token_stream``: raw tokens of real text for teacher forcing (``agreement``), one document
  followed by the others when a context is longer than it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flm_runtime import InvalidRequestError

TEXTS_DIR = Path(__file__).resolve().parent / "texts"

# Shipped documents: file, title, where it comes from (all public domain; texts/README.md).
SHIPPED = (
    ("doyle_scandal_in_bohemia.txt", "A Scandal in Bohemia",
     "Arthur Conan Doyle, The Adventures of Sherlock Holmes (1892), Project Gutenberg #1661"),
    ("darwin_origin_of_species.txt", "On the Origin of Species, Introduction and Chapter I",
     "Charles Darwin (1859, 1st edition), Project Gutenberg #1228"),
    ("smith_wealth_of_nations.txt", "The Wealth of Nations, Introduction and Book I, Chapters I-II",
     "Adam Smith (1776), Project Gutenberg #3300"),
)

# Our own short prompts (a writing, a coding and a reasoning request): 35-40 tokens each once
# smollm2's chat template, with its default system prompt, is applied.
SHORT_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue? Explain briefly.",
)

SUMMARY_INSTRUCTION = "Summarize the following text in a few paragraphs.\n\n"


@dataclass(frozen=True)
class Document:
    """One long text.

    Attributes:
        name: the file name (stable identifier in reports).
        title: a human title.
        source: where the text comes from.
        text: the whole text.
    """

    name: str
    title: str
    source: str
    text: str


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt ready for the engine.

    Attributes:
        name: where it comes from (``short-1``, a document name, ...).
        ids: the prompt token ids (chat template applied).
        text_tokens: tokens of the document excerpt in it (0 for a short prompt).
    """

    name: str
    ids: tuple[int, ...]
    text_tokens: int = 0


def load_documents(directory: str | Path | None = None) -> list[Document]:
    """The shipped documents, or every ``*.txt`` of ``directory`` (sorted by name).

    Raises:
        FileNotFoundError: ``directory`` does not exist or holds no ``*.txt`` file.
    """
    if directory is None:
        return [Document(f, title, source, (TEXTS_DIR / f).read_text(encoding="utf-8"))
                for f, title, source in SHIPPED]
    directory = Path(directory).expanduser()
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise FileNotFoundError(2, "no *.txt documents in", str(directory))
    return [Document(p.name, p.stem, str(p), p.read_text(encoding="utf-8")) for p in files]


def short_prompts(path: str | Path | None = None, n: int = 3) -> list[tuple[str, str]]:
    """``n`` short user messages as (name, text): ours, or the first turns of a question.jsonl.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        InvalidRequestError: a line of ``path`` has no ``turns``.
    """
    if path is None:
        texts = list(SHORT_PROMPTS)
    else:
        texts = []
        for i, line in enumerate(Path(path).expanduser().read_text(encoding="utf-8").splitlines()):
            if line.strip():
                turns = json.loads(line).get("turns")
                if not turns:
                    raise InvalidRequestError(f"{path}: line {i + 1} has no 'turns'", param="--prompts")
                texts.append(turns[0])
    return [(f"short-{i + 1}", t) for i, t in enumerate(texts[:n])]


def chat_ids(tokenizer, user_text: str, *, thinking: bool | None = None) -> list[int]:
    """Token ids of one user turn in the model's chat template (with the generation prompt).

    ``thinking`` sets the template's thinking switch (``Tokenizer.thinking``) when not None; a
    template without one ignores it.
    """
    fmt = tokenizer.thinking
    extra = {} if thinking is None or fmt is None else {fmt.switch: thinking}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                             add_generation_prompt=True, **extra)
    return tokenizer.encode(rendered)


def supports_thinking(tokenizer) -> bool:
    """Whether the model's chat template has a thinking switch (``Tokenizer.thinking``)."""
    return tokenizer.thinking is not None


def summary_prompt(tokenizer, document: Document, budget: int, *, thinking: bool | None = None) -> Prompt:
    """"Summarize" + the longest prefix of ``document`` whose rendered prompt has <= ``budget`` tokens.

    The excerpt is cut on a token boundary of the document's own tokenization; re-encoding the
    joined prompt can merge a token or two at the seams, so the cut is corrected until it fits.

    Raises:
        InvalidRequestError: ``budget`` cannot hold the instruction and template, or the document is too
            short to fill it (the message says by how much).
    """
    doc_ids = tokenizer.encode(document.text)
    overhead = len(chat_ids(tokenizer, SUMMARY_INSTRUCTION, thinking=thinking))
    keep = budget - overhead
    if keep <= 0:
        raise InvalidRequestError(f"a budget of {budget} tokens cannot hold the summary instruction "
                                  f"({overhead} tokens)", param="--contexts")
    if keep > len(doc_ids):
        raise InvalidRequestError(f"{document.name} has {len(doc_ids)} tokens, {keep - len(doc_ids)} too few for "
                                  f"a {budget}-token prompt; use longer documents", param="--documents")
    while True:
        excerpt = tokenizer.decode(doc_ids[:keep])
        ids = chat_ids(tokenizer, SUMMARY_INSTRUCTION + excerpt, thinking=thinking)
        if len(ids) <= budget:
            return Prompt(document.name, tuple(ids), keep)
        keep -= len(ids) - budget


def longest_summary(tokenizer, documents: list[Document], *, thinking: bool | None = None) -> int:
    """The largest budget ``summary_prompt`` fills from every one of ``documents``, in tokens: the
    shortest document's tokens plus the instruction and chat template around it."""
    overhead = len(chat_ids(tokenizer, SUMMARY_INSTRUCTION, thinking=thinking))
    return min(len(tokenizer.encode(d.text)) for d in documents) + overhead


def token_stream(tokenizer, documents: list[Document], first: int, n_tokens: int) -> list[int]:
    """``n_tokens`` tokens of raw text: document ``first``, then the next ones in turn as needed
    (separated by a blank line).

    Raises:
        InvalidRequestError: all the documents together hold fewer than ``n_tokens`` tokens.
    """
    ids: list[int] = []
    for k in range(len(documents)):
        doc = documents[(first + k) % len(documents)]
        ids += tokenizer.encode(doc.text if not ids else "\n\n" + doc.text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise InvalidRequestError(f"the documents hold {len(ids)} tokens together, fewer than the {n_tokens} "
                              "needed", param="--documents")
