"""Runtime errors -> LiteLLM exceptions: class, status, model, provider, chaining."""

from __future__ import annotations

from pathlib import Path

import litellm
import pytest

from flm_runtime import errors as rt
from litellm_flm.errors import litellm_errors, to_litellm

CASES = [
    (rt.ContextLengthError(prompt_tokens=9000, max_tokens=10, context_length=8192), litellm.ContextWindowExceededError, 400),
    (rt.KVBudgetError(engine="smollm2:135m", prompt_tokens=30, max_tokens=9000, need_bytes=416_102_400,
                      budget_bytes=46_080_000, bytes_per_token=46_080), litellm.ContextWindowExceededError, 400),
    (rt.InvalidRequestError("top_p must lie in (0.0, 1.0], got 0", param="top_p"), litellm.BadRequestError, 400),
    (rt.RequestTimeoutError("deadline of 3.0 s passed"), litellm.Timeout, 408),
    (rt.EngineOverloadedError("queue full (64 requests)"), litellm.RateLimitError, 429),
    (rt.BackendUnavailableError("npu: no device"), litellm.ServiceUnavailableError, 503),
    (rt.EngineDrainingError("engine 'smollm2:135m' is shutting down"), litellm.ServiceUnavailableError, 503),
    (rt.ModelDownloadError("sha256 mismatch"), litellm.ServiceUnavailableError, 503),
    (rt.DiskSpaceError(Path("/m/.converted/k-auto.flmw"), need_bytes=10, free_bytes=2), litellm.ServiceUnavailableError,
     503),
    (rt.UnknownModelError("no model 'nope:1b'"), litellm.NotFoundError, 404),
    (rt.ModelFilesMissingError("missing model.gguf"), litellm.NotFoundError, 404),
    (rt.ModelFormatError("unsupported quant Q2_K"), litellm.BadRequestError, 400),
    (rt.EngineFaultError("engine 'smollm2:135m' failed on this request (KernelFault: injected)"),
     litellm.InternalServerError, 500),
    (rt.FlmError("something else"), litellm.InternalServerError, 500),
]


@pytest.mark.parametrize("error, cls, status", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_mapping(error, cls, status):
    exc = to_litellm(error, "smollm2:135m")
    assert type(exc) is cls
    assert exc.status_code == status
    assert exc.model == "smollm2:135m" and exc.llm_provider == "flm"
    assert str(error) in str(exc)


EXACT = [
    (rt.ContextLengthError(prompt_tokens=9000, max_tokens=10, context_length=8192),
     "litellm.ContextWindowExceededError: this model's context length is 8192 tokens; the prompt has 9000 tokens "
     "and max_tokens asks for 10 more (9010 in all)"),
    (rt.ContextLengthError(prompt_tokens=9000, max_tokens=None, context_length=8192),
     "litellm.ContextWindowExceededError: this model's context length is 8192 tokens; the prompt has 9000 tokens, "
     "which leaves no room for a completion"),
    (rt.InvalidRequestError("top_p must lie in (0.0, 1.0], got 0", param="top_p"),
     "litellm.BadRequestError: top_p must lie in (0.0, 1.0], got 0"),
    (rt.EngineOverloadedError("queue full"), "litellm.RateLimitError: queue full"),
    (rt.RequestTimeoutError("deadline passed"), "litellm.Timeout: deadline passed"),
    (rt.BackendUnavailableError("npu: no device"), "litellm.ServiceUnavailableError: npu: no device"),
    # Files without a download are not told to pull; a pullable tag's message says so itself.
    (rt.ModelFilesMissingError("x:1b needs its model files: put config.json in /m/; now config.json is missing. "
                               "These files have no automatic download."),
     "litellm.NotFoundError: x:1b needs its model files: put config.json in /m/; now config.json is missing. "
     "These files have no automatic download."),
    (rt.ModelFilesMissingError("smollm2:135m is not installed (x is missing): run `litellm-flm pull smollm2:135m`"),
     "litellm.NotFoundError: smollm2:135m is not installed (x is missing): run `litellm-flm pull smollm2:135m`"),
]


@pytest.mark.parametrize("error, message", EXACT, ids=[f"{type(c[0]).__name__}-{i}" for i, c in enumerate(EXACT)])
def test_messages_carry_the_litellm_prefix_once(error, message):
    exc = to_litellm(error, "m")
    assert str(exc) == exc.message == message


def test_a_prompt_over_the_context_with_max_tokens_unset_names_both_lengths(fake_engine):
    with pytest.raises(litellm.ContextWindowExceededError) as info:
        litellm.completion(model="flm/smollm2:135m", messages=[{"role": "user", "content": "x" * 300}])
    n_prompt = len(fake_engine.submitted[0][0])
    assert str(info.value) == (f"litellm.ContextWindowExceededError: this model's context length is "
                               f"{fake_engine.context_length} tokens; the prompt has {n_prompt} tokens, which leaves "
                               "no room for a completion")



@pytest.mark.parametrize("stream", [False, True])
def test_max_completion_tokens_is_named_as_sent_though_litellm_renames_it(fake_engine, stream):
    """LiteLLM hands the handler ``max_tokens``; the errors name what the caller sent."""
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model="flm/smollm2:135m", messages=messages, max_completion_tokens=0, stream=stream)
    assert info.value.body["param"] == "max_completion_tokens"
    assert str(info.value) == "litellm.BadRequestError: max_completion_tokens must be an integer >= 1, got 0"
    with pytest.raises(litellm.ContextWindowExceededError) as info:
        litellm.completion(model="flm/smollm2:135m", messages=messages, max_completion_tokens=300, stream=stream)
    assert str(info.value).endswith("the prompt has 22 tokens and max_completion_tokens asks for 300 more (322 in all)")
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model="flm/smollm2:135m", messages=messages, max_tokens=0, stream=stream)
    assert info.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("prompt, name", [("x" * 300, "prompt"), (["a", "x" * 300], "prompt[1]")])
def test_a_text_prompt_over_the_context_is_named_as_the_prompt(fake_engine, prompt, name):
    with pytest.raises(litellm.ContextWindowExceededError) as info:
        litellm.text_completion(model="flm/smollm2:135m", prompt=prompt, max_tokens=5)
    assert info.value.body["param"] == name
    assert str(info.value) == ("litellm.ContextWindowExceededError: this model's context length is 256 tokens; "
                               "the prompt has 300 tokens and max_tokens asks for 5 more (305 in all)")

def test_context_window_error_is_a_bad_request_with_the_counts():
    exc = to_litellm(rt.ContextLengthError(prompt_tokens=9000, max_tokens=10, context_length=8192), "m")
    assert isinstance(exc, litellm.BadRequestError)
    assert "9000" in str(exc) and "8192" in str(exc)
    assert exc.code == "context_length_exceeded"


def test_kv_budget_error_is_a_context_window_error_naming_max_tokens():
    exc = to_litellm(rt.KVBudgetError(engine="e", prompt_tokens=30, max_tokens=9000, need_bytes=416_102_400,
                                      budget_bytes=46_080_000, bytes_per_token=46_080), "m")
    assert (exc.code, exc.param) == ("context_length_exceeded", "max_tokens")
    assert "KV budget of 46,080,000 bytes (1000 tokens)" in str(exc)


def test_bad_request_carries_the_param():
    exc = to_litellm(rt.InvalidRequestError("must be >= 1, got 0", param="max_tokens"), "m")
    assert exc.param == "max_tokens"
    assert "max_tokens" in str(exc)  # named in the message even when the runtime's message does not


def test_context_manager_chains_and_lets_other_errors_through():
    with pytest.raises(litellm.RateLimitError) as info:
        with litellm_errors("m"):
            raise rt.EngineOverloadedError("full")
    assert isinstance(info.value.__cause__, rt.EngineOverloadedError)
    with pytest.raises(KeyError):
        with litellm_errors("m"):
            raise KeyError("not ours")


def test_litellm_passes_our_exceptions_through_unchanged():
    # litellm's exception_type() returns its own exception types as they are: what we raise is
    # what the caller catches.
    from litellm.litellm_core_utils.exception_mapping_utils import exception_type

    exc = to_litellm(rt.EngineOverloadedError("full"), "m")
    with pytest.raises(litellm.RateLimitError) as info:
        raise exception_type(model="m", custom_llm_provider="flm", original_exception=exc)
    assert info.value is exc


MSG = [{"role": "user", "content": "hi"}]


def overloaded_for(fake_engine, tag: str, times: int | None = None) -> list[str]:
    """Make ``fake_engine`` raise ``EngineOverloadedError`` for ``tag`` (the first ``times`` times,
    or always); returns the list of tags it was asked for, in order."""
    calls, submit = [], fake_engine.submit

    def full_or_submit(prompt_ids, params, **kw):
        calls.append(fake_engine.requested_tags[-1])
        if calls[-1] == tag and (times is None or calls.count(tag) <= times):
            raise rt.EngineOverloadedError(f"engine {tag!r} is full")
        return submit(prompt_ids, params, **kw)

    fake_engine.submit = full_or_submit
    return calls


async def test_router_falls_back_from_a_full_engine(fake_engine):
    """A full engine is a 429 the Router acts on: the request goes to the fallback group."""
    router = litellm.Router(model_list=[{"model_name": "local", "litellm_params": {"model": "flm/smollm2:135m"}},
                                        {"model_name": "spare", "litellm_params": {"model": "flm/tiny-test:1m"}}],
                            fallbacks=[{"local": ["spare"]}], num_retries=0)
    calls = overloaded_for(fake_engine, "smollm2:135m")
    r = await router.acompletion(model="local", messages=MSG)
    assert calls == ["smollm2:135m", "tiny-test:1m"]
    assert r.choices[0].message.content == fake_engine.reply


async def test_router_retries_a_full_engine(fake_engine):
    router = litellm.Router(model_list=[{"model_name": "local", "litellm_params": {"model": "flm/smollm2:135m"}}],
                            num_retries=1, retry_after=0)
    calls = overloaded_for(fake_engine, "smollm2:135m", times=1)
    r = await router.acompletion(model="local", messages=MSG)
    assert calls == ["smollm2:135m", "smollm2:135m"]
    assert r.choices[0].message.content == fake_engine.reply


def test_a_models_file_path_that_is_not_gguf_is_a_bad_request_naming_the_file(tmp_path, monkeypatch):
    from flm_runtime import registry

    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model\n")
    (tmp_path / "models.yaml").write_text(f"notes:1b: {notes}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    try:
        with pytest.raises(litellm.BadRequestError) as info:
            litellm.completion(model="flm/notes:1b", messages=[{"role": "user", "content": "Hi"}])
    finally:
        registry.reload()
    assert info.value.message == f"litellm.BadRequestError: {notes}: not a readable GGUF file (GGUF magic invalid)"
    assert (info.value.status_code, info.value.body["param"]) == (400, "model")
    assert isinstance(info.value.__cause__, rt.ModelFormatError)


def test_a_hostile_config_json_is_a_bad_request_naming_the_file_the_key_and_the_value(tmp_path, monkeypatch):
    """Not a 500 (``APIConnectionError``) with a traceback: the loader's typed refusal, mapped."""
    import json

    from loading.tiny_llama_files import random_hf_weights, tiny_config, write_tiny_hf_dir

    from flm_runtime import registry

    directory = write_tiny_hf_dir(tmp_path / "hostile", tiny_config(), random_hf_weights(tiny_config()))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    (tmp_path / "models.yaml").write_text(f"hostile:1m:\n  path: {directory}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model="flm/hostile:1m", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.message == (f"litellm.BadRequestError: {directory / 'config.json'}: key num_hidden_layers is "
                                  "'2', not an integer from 1 to 1024")
    assert (info.value.status_code, info.value.body["param"]) == (400, "model")
    assert isinstance(info.value.__cause__, rt.ModelFormatError)
