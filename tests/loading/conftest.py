"""Fixtures of the loading tests (``smollm2_gguf`` and ``smollm2_tokenizer`` come from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_gguf):
    """All metadata of the SmolLM2 GGUF."""
    from flm_runtime.loading.gguf import open_gguf

    return open_gguf(smollm2_gguf).metadata


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_gguf):
    """``load_model_files`` on the SmolLM2 GGUF (about 7 s and 0.85 GB peak: once per session)."""
    from flm_runtime.loading import load_model_files

    return load_model_files(smollm2_gguf)
