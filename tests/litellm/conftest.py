from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map

import pytest

import litellm_flm.llm

from flm_fake_engine import FakeEngine


@pytest.fixture
def fake_engine(monkeypatch) -> FakeEngine:
    """Route every ``flm/<tag>`` request of the test to one FakeEngine."""
    engine = FakeEngine()
    tags: list[str] = []
    backends: list[str | None] = []

    def get_engine(tag: str, backend: str | None = None) -> FakeEngine:
        tags.append(tag)
        backends.append(backend)
        return engine

    monkeypatch.setattr(litellm_flm.llm, "_get_engine", get_engine)
    engine.requested_tags = tags
    engine.requested_backends = backends
    return engine
