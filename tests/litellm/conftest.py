from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map

import pytest

import litellm_flm.llm

from flm_fake_engine import FakeEngine
from forced_speculation import DFLASH_TAG, write_always_speculate_policy


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


@pytest.fixture
def speculation_forced(tmp_path, monkeypatch):
    """``flm/smollm2-dflash:135m`` served by a fresh engine that speculates at every step (cpu):
    its user policy table is ``forced_speculation.ALWAYS_SPECULATE_TABLE``. The engine is dropped afterwards."""
    from flm_runtime import api

    monkeypatch.setenv("FLM_BACKEND", "cpu")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(write_always_speculate_policy(tmp_path / "config")))
    api.default_runtime.forget(DFLASH_TAG)
    yield f"flm/{DFLASH_TAG}"
    api.default_runtime.forget(DFLASH_TAG)
