"""Benchmark prompts and texts: the shipped documents, prompts of an exact token budget, teacher
forcing streams across documents, short prompts from an MT-Bench style file, context specs."""

from __future__ import annotations

import hashlib
import json

import pytest

from flm_bench import documents
from flm_bench.documents import (Document, load_documents, longest_summary, short_prompts, summary_prompt,
                                         token_stream)
from flm_bench.engines import parse_contexts

# texts/README.md records these; a changed text changes every long-context figure.
SHA256 = {
    "doyle_scandal_in_bohemia.txt": "b225a127a0537857beb59258f05580ad2474cec1f0d6eb688ff44d0047ffe134",
    "darwin_origin_of_species.txt": "b90d5ec4f43599e415c26d36762db5ff44ea85372e0726153ff1d97b8739f274",
    "smith_wealth_of_nations.txt": "ab7b02d06a6b1b586c256a9872db3392b3093597959eababba77595be29f299c",
}


def test_shipped_documents_are_the_recorded_texts_and_fill_the_largest_prompt(smollm2_tokenizer):
    docs = load_documents()
    assert [d.name for d in docs] == list(SHA256)
    for d in docs:
        assert hashlib.sha256(d.text.encode()).hexdigest() == SHA256[d.name]
        assert "Gutenberg" not in d.text  # the license header and footer are not part of the text
        assert len(smollm2_tokenizer.encode(d.text)) >= 8192 - 512  # smollm2's largest prompt
    assert (documents.TEXTS_DIR / "README.md").is_file()


def test_summary_prompt_fills_the_budget_and_no_more(smollm2_tokenizer):
    doc = load_documents()[1]
    for budget in (64, 1024, 4000):
        p = summary_prompt(smollm2_tokenizer, doc, budget)
        assert budget - 4 <= len(p.ids) <= budget
        text = smollm2_tokenizer.decode(list(p.ids))
        assert documents.SUMMARY_INSTRUCTION.strip() in text and doc.text[:20] in text


def test_summary_prompt_refuses_a_short_document_or_budget(smollm2_tokenizer):
    doc = Document("tiny.txt", "tiny", "test", "Only a few words here.")
    with pytest.raises(ValueError, match="too few"):
        summary_prompt(smollm2_tokenizer, doc, 500)
    with pytest.raises(ValueError, match="cannot hold"):
        summary_prompt(smollm2_tokenizer, load_documents()[0], 5)


def test_token_stream_continues_with_the_next_documents(smollm2_tokenizer):
    docs = [Document("a.txt", "a", "t", "one two three"), Document("b.txt", "b", "t", "four five")]
    ids = token_stream(smollm2_tokenizer, docs, 1, 6)
    assert smollm2_tokenizer.decode(ids).startswith("four five\n\none")
    with pytest.raises(ValueError, match="fewer than"):
        token_stream(smollm2_tokenizer, docs, 0, 1000)


def test_documents_and_short_prompts_from_files(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    assert [d.text for d in load_documents(tmp_path)] == ["first", "second"]
    with pytest.raises(FileNotFoundError):
        load_documents(tmp_path / "none")
    questions = tmp_path / "question.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"q{i}", "follow-up"]})
                                   for i in range(5)), encoding="utf-8")
    assert short_prompts(questions, 3) == [("short-1", "q0"), ("short-2", "q1"), ("short-3", "q2")]
    assert len(short_prompts(None, 3)) == 3


def test_context_specs_clip_drop_and_name_the_largest():
    contexts, notes = parse_contexts("short, 1k,4k, 8k, 16k, max, 100", 8192, 512)
    assert [(c.label, c.tokens) for c in contexts] == [
        ("short", None), ("1k", 1024), ("4k", 4096), ("8k (7680)", 7680), ("max (7680)", 7680), ("100", 100)]
    assert len(notes) == 2 and "16k" in notes[1] and "clipped" in notes[0]
    with pytest.raises(ValueError, match="'2m'"):
        parse_contexts("2m", 8192, 32)


def test_max_is_the_longest_prompt_the_documents_fill(smollm2_tokenizer):
    docs = load_documents()
    fill = longest_summary(smollm2_tokenizer, docs)
    shortest = min(docs, key=lambda d: len(smollm2_tokenizer.encode(d.text)))
    assert shortest.name == "darwin_origin_of_species.txt"
    assert fill == 7826 + 42  # the text, then the instruction and smollm2's template with its system prompt
    assert all(budget - 4 <= len(summary_prompt(smollm2_tokenizer, d, budget).ids) <= budget
               for d in docs for budget in [fill])
    with pytest.raises(ValueError, match="1 too few"):
        summary_prompt(smollm2_tokenizer, shortest, fill + 1)
    contexts, notes = parse_contexts("4k,max", 8192, 256, fill=fill)
    assert [(c.label, c.tokens) for c in contexts] == [("4k", 4096), (f"max ({fill})", fill)]
    assert notes == [f"max is {fill} prompt tokens, not 7936: the longest prompt the documents fill"]
    assert parse_contexts("max", 8192, 512, fill=fill)[0][0].tokens == 7680  # the model's bound is the lower
