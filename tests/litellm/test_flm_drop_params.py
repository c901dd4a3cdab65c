"""``drop_params`` on the real embedded model: an OpenAI parameter the provider does not support is
left out and the request answers as if it had not been sent; without the flag it is a
``BadRequestError`` naming it. Greedy and short, so each comparison is exact text.
"""

from __future__ import annotations

from pathlib import Path

import litellm
import pytest
from litellm.utils import get_optional_params

from litellm_flm.params import IGNORED, KEYS, NEUTRAL_ONLY, SUPPORTED_OPENAI_PARAMS

UNSUPPORTED_KEYS = [k for k, key in KEYS.items() if key.kind == NEUTRAL_ONLY]

MODEL = "flm/smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}
FUNCTION = {"name": "capital", "parameters": {"type": "object", "properties": {}}}

# One request-level value of each unsupported parameter a user is likely to send, named by the
# parameter the error must name.
UNSUPPORTED = {
    "functions": {"functions": [FUNCTION]},
    "modalities": {"modalities": ["text", "audio"]},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
}


@pytest.fixture(scope="module")
def plain(smollm2_engine) -> str:
    """The greedy answer to QUESTION with no unsupported parameter."""
    return litellm.completion(model=MODEL, messages=QUESTION, **GREEDY).choices[0].message.content


@pytest.fixture
def router(smollm2_engine):
    def make(**deployment):
        params = {"model": MODEL, **deployment}
        return litellm.Router(model_list=[{"model_name": "local", "litellm_params": params}], num_retries=0)

    return make


def test_litellm_is_told_tools_and_structured_output_but_no_images():
    assert litellm.supports_function_calling(model=MODEL) is True
    assert litellm.supports_response_schema(model=MODEL) is True
    assert litellm.supports_parallel_function_calling(model=MODEL) is True
    assert litellm.utils.supports_tool_choice(model=MODEL) is True
    assert litellm.supports_vision(model=MODEL) is False


def test_every_parameter_litellm_forwards_is_supported_ignored_or_droppable():
    # What LiteLLM forwards to any custom provider (litellm 1.110.2: one OpenAI-compatible list);
    # extra_headers is LiteLLM's own and never reaches optional_params.
    forwarded = set(litellm.utils.get_supported_openai_params(model="smollm2:135m", custom_llm_provider="flm"))
    known = set(SUPPORTED_OPENAI_PARAMS) | set(UNSUPPORTED_KEYS) | {k for k, key in KEYS.items() if key.kind == IGNORED}
    assert forwarded - known == {"extra_headers"}
    assert not set(SUPPORTED_OPENAI_PARAMS) & set(UNSUPPORTED_KEYS)


def test_readme_lists_every_supported_and_unsupported_parameter():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Parameters", 1)[1].split("\n### ", 1)[0]
    assert [p for p in (*SUPPORTED_OPENAI_PARAMS, *UNSUPPORTED_KEYS) if f"`{p}`" not in section] == []


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_completion_drops_or_names_the_parameter(plain, name):
    extra = UNSUPPORTED[name]
    r = litellm.completion(model=MODEL, messages=QUESTION, drop_params=True, **GREEDY, **extra)
    assert [c.message.content for c in r.choices] == [plain]
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=QUESTION, **GREEDY, **extra)
    assert name in str(info.value)


def test_stream_drops_the_parameter(plain):
    chunks = litellm.completion(
        model=MODEL, messages=QUESTION, stream=True, drop_params=True, **GREEDY, **UNSUPPORTED["functions"]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain


def test_global_drop_params_drops_the_parameter(plain, monkeypatch):
    monkeypatch.setattr(litellm, "drop_params", True)  # what the proxy's litellm_settings set
    r = litellm.completion(model=MODEL, messages=QUESTION, **GREEDY, **UNSUPPORTED["functions"])
    assert r.choices[0].message.content == plain


@pytest.mark.parametrize("name", ["functions", "modalities"])
def test_router_deployment_drops_or_names_the_parameter(plain, router, name):
    extra = UNSUPPORTED[name]
    r = router(drop_params=True).completion(model="local", messages=QUESTION, **GREEDY, **extra)
    assert r.choices[0].message.content == plain
    with pytest.raises(litellm.BadRequestError) as info:
        router().completion(model="local", messages=QUESTION, **GREEDY, **extra)
    assert name in str(info.value)


async def test_router_request_drop_params_async(plain, router):
    r = await router().acompletion(
        model="local", messages=QUESTION, drop_params=True, **GREEDY, **UNSUPPORTED["audio"]
    )
    assert r.choices[0].message.content == plain


@pytest.mark.parametrize("name", ["modalities", "audio"])
def test_drop_params_does_what_litellm_does_for_a_builtin_provider(plain, name):
    """ollama_chat does not support these either: LiteLLM's own rule (get_optional_params)
    refuses each without drop_params and drops it with; flm gives the same two outcomes."""
    extra = UNSUPPORTED[name]
    assert name not in litellm.get_supported_openai_params(model="llama3", custom_llm_provider="ollama_chat")
    with pytest.raises(litellm.BadRequestError, match=name):
        get_optional_params(model="llama3", custom_llm_provider="ollama_chat", temperature=0, **extra)
    kept = get_optional_params(model="llama3", custom_llm_provider="ollama_chat", temperature=0, drop_params=True,
                               **extra)
    assert not set(extra) & set(kept) and kept["temperature"] == 0

    with pytest.raises(litellm.BadRequestError, match=name):
        litellm.completion(model=MODEL, messages=QUESTION, **GREEDY, **extra)
    r = litellm.completion(model=MODEL, messages=QUESTION, drop_params=True, **GREEDY, **extra)
    assert r.choices[0].message.content == plain
