"""Fixtures of the engine tests: a fake tokenizer, fake models, and engines that get closed."""

from __future__ import annotations

import pytest
from engine_fakes import FakeTokenizer

from flm_runtime.scheduling.engine import Engine


@pytest.fixture
def tok() -> FakeTokenizer:
    """The fake tokenizer padded to the fake models' vocabulary (300)."""
    return FakeTokenizer(vocab_size=300)


@pytest.fixture(scope="session")
def tiny():
    """``spec_fakes.tiny_model()``: a tiny random Llama (vocabulary 300, context 300)."""
    from spec_fakes import tiny_model

    return tiny_model()


@pytest.fixture
def make_engine():
    """``make_engine(model, tokenizer, **kw) -> Engine``; every engine is closed at teardown."""
    engines = []

    def make(model, tokenizer, **kw):
        engine = Engine(model, tokenizer, name=kw.pop("name", "fake"), **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
