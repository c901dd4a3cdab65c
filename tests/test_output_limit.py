"""The default output limit: a request without ``max_tokens`` ends with ``finish_reason``
``length`` after the tag's ``sampling: max_tokens`` (models file), else ``$FLM_MAX_TOKENS``,
else 4096 tokens, fewer where the prompt leaves less of the context; a client's own value, or a
LiteLLM deployment's ``max_tokens``, wins (README, "Parameters"). End to end through LiteLLM on
the embedded model's file, greedy, streamed and not."""

from __future__ import annotations

import litellm
import pytest

import litellm_flm  # noqa: F401  (registers the flm provider)
from flm_runtime import api, registry
from flm_runtime.errors import InvalidRequestError
from flm_runtime.settings import MAX_TOKENS, Settings

STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture
def tags(tmp_path, monkeypatch, smollm2_gguf):
    """Tags of smollm2's file, greedy: ``limited:135m`` (``sampling: max_tokens: 7``), ``plain:135m``
    (none: ``$FLM_MAX_TOKENS``, 6 here), ``short:135m`` (``context_length`` 48, a limit of 4096, the
    default's value); ``zero:135m`` (an invalid limit, 0); a runtime of its own."""
    models = tmp_path / "models.yaml"
    entry = f"path: {smollm2_gguf}, weights: auto"
    models.write_text(f"limited:135m: {{{entry}, sampling: {{temperature: 0, max_tokens: 7}}}}\n"
                      f"plain:135m: {{{entry}, sampling: {{temperature: 0}}}}\n"
                      f"short:135m: {{{entry}, context_length: 48, sampling: {{temperature: 0, max_tokens: 4096}}}}\n"
                      f"zero:135m: {{{entry}, sampling: {{max_tokens: 0}}}}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(models))
    monkeypatch.setenv("FLM_MAX_TOKENS", "6")
    monkeypatch.setenv("FLM_BACKEND", "cpu")
    registry.reload()
    runtime = api.Runtime()
    monkeypatch.setattr(api, "default_runtime", runtime)
    yield models
    runtime.close()


def completion_and_stream(model: str, **kwargs) -> tuple[litellm.ModelResponse, str, str, int]:
    """The answer, then the same request streamed: its text, finish_reason and completion tokens."""
    r = litellm.completion(model=model, messages=STORY, **kwargs)
    chunks = list(litellm.completion(model=model, messages=STORY, stream=True,
                                     stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    return r, text, finish[-1], usage[-1].completion_tokens


@pytest.mark.parametrize(("tag", "limit"), [("limited:135m", 7), ("plain:135m", 6)])
def test_a_request_without_max_tokens_ends_at_the_default_limit(tags, tag, limit):
    r, text, finish, tokens = completion_and_stream(f"flm/{tag}")
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", limit)
    assert (text, finish, tokens) == (r.choices[0].message.content, "length", limit)
    # the client's own value wins, above the default and below it
    for asked in (limit + 5, 3):
        r, text, finish, tokens = completion_and_stream(f"flm/{tag}", max_tokens=asked)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens, finish, tokens) == ("length", asked, "length",
                                                                                          asked)


def test_the_default_limit_is_cut_to_what_the_context_leaves(tags):
    r, text, finish, tokens = completion_and_stream("flm/short:135m")
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 48  # 4096 by default, cut: not refused
    assert (r.choices[0].finish_reason, finish, tokens) == ("length", "length", r.usage.completion_tokens)
    with pytest.raises(litellm.ContextWindowExceededError, match="context length is 48 tokens"):
        litellm.completion(model="flm/short:135m", messages=STORY, max_tokens=48)  # a request's own: refused


def test_a_deployments_max_tokens_is_a_default_the_client_overrides(tags):
    router = litellm.Router(model_list=[{"model_name": "coder", "litellm_params": {
        "model": "flm/plain:135m", "max_tokens": 5}}])
    r = router.completion(model="coder", messages=STORY)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)
    r = router.completion(model="coder", messages=STORY, max_tokens=2)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 2)


def test_a_bad_limit_is_refused_naming_where_it_was_set(tags, monkeypatch):
    assert Settings().output_limit() == MAX_TOKENS == 4096 and Settings(max_tokens="12").output_limit() == 12
    with pytest.raises(InvalidRequestError, match="FLM_MAX_TOKENS must be a positive integer, got '0'"):
        Settings(max_tokens="0").output_limit()
    with pytest.raises(litellm.BadRequestError, match=f"{tags}.*zero:135m.*max_tokens"):
        litellm.completion(model="flm/zero:135m", messages=STORY)
