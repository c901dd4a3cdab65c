"""Reading a stream of several choices back: each choice's text and finish reason by its index."""

from __future__ import annotations


def joined_choices(chunks) -> tuple[dict[int, str], dict[int, str]]:
    """``(texts, finish reasons)`` by choice index, from chat chunks (LiteLLM's or the OpenAI
    SDK's: ``chunk.choices[j]`` with ``index``, ``delta.content``, ``finish_reason``)."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes
