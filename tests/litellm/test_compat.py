"""``litellm_flm.compat``: one test per use of LiteLLM's internals. Each checks, in LiteLLM itself,
what the use relies on (the behaviour a patch corrects, a private name, an undocumented key) and
fails naming the use when a LiteLLM upgrade changes it: re-check that use against the new LiteLLM,
then move ``compat.LITELLM_VERSION`` with the pin. The SIGTERM chain's tests are in
``test_flm_shutdown.py`` (its tie to LiteLLM: the proxy's module name, checked here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import re
from pathlib import Path

import litellm
import pytest
from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper
from litellm.text_completions.streaming_iterator import TextCompletionStreamWrapper
from litellm.types.utils import Delta, ModelResponseStream, StreamingChoices
from stream_choices import joined_choices

from flm_runtime.errors import InvalidRequestError
from flm_runtime.request import RequestStats
from flm_runtime.sampling.sampler import choice_seed
from litellm_flm import compat, llm
from litellm_flm.params import SUPPORTED_OPENAI_PARAMS

MODEL = "flm/smollm2:135m"
MESSAGES = [{"role": "user", "content": "hi"}]
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_litellm_is_the_version_compat_was_checked_on():
    pin = re.search(r'"litellm==([^"]+)"', PYPROJECT.read_text(encoding="utf-8")).group(1)
    assert (importlib.metadata.version("litellm"), pin) == (compat.LITELLM_VERSION,) * 2, (
        "LiteLLM moved: re-check every use in litellm_flm/compat.py, then set LITELLM_VERSION to the pin")
    assert compat.check_version() is True


def test_setup_custom_providers_puts_the_map_in_the_provider_lists(monkeypatch):
    monkeypatch.setattr(litellm, "custom_provider_map", [{"provider": "flm-compat-probe", "custom_handler": llm.FlmLLM()}])
    monkeypatch.setattr(litellm, "provider_list", list(litellm.provider_list))
    monkeypatch.setattr(litellm, "_custom_providers", list(litellm._custom_providers))
    compat.setup_custom_providers()
    assert "flm-compat-probe" in litellm.provider_list and "flm-compat-probe" in litellm._custom_providers, (
        "litellm.utils.custom_llm_setup no longer registers custom_provider_map: see compat.setup_custom_providers")


def test_stream_text_as_strings_is_needed_and_gives_a_final_text_of_empty():
    patched = TextCompletionStreamWrapper.convert_to_text_completion_object
    wrapper = TextCompletionStreamWrapper.__new__(TextCompletionStreamWrapper)
    wrapper.include_usage, wrapper.custom_llm_provider = False, "flm"
    last = ModelResponseStream(model=MODEL, choices=[StreamingChoices(index=0, delta=Delta(), finish_reason="length")])
    assert patched.__wrapped__(wrapper, last).choices[0].text is None, (
        "LiteLLM's text-completion stream now gives a final text itself: compat.stream_text_as_strings can go")
    assert patched(wrapper, last).choices[0].text == ""


def test_streams_named_as_served_is_needed(fake_engine, monkeypatch):
    init = CustomStreamWrapper.__init__
    assert {"model", "custom_llm_provider"} <= set(inspect.signature(init.__wrapped__).parameters), (
        "CustomStreamWrapper's constructor changed: compat.streams_named_as_served binds these arguments")
    monkeypatch.setattr(CustomStreamWrapper, "__init__", init.__wrapped__)
    bare = {c.model for c in litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)}
    assert bare == {MODEL, "smollm2:135m"}, (
        "LiteLLM's own stream chunks now name the model as called: compat.streams_named_as_served can go")
    monkeypatch.setattr(CustomStreamWrapper, "__init__", init)
    assert {c.model for c in litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)} == {MODEL}


def test_model_info_lists_supported_params_is_needed(monkeypatch):
    patched = litellm.utils._build_model_info
    monkeypatch.setattr(litellm.utils, "_build_model_info", patched.__wrapped__)
    litellm.get_model_info.cache_clear()
    try:
        listed = litellm.get_model_info(MODEL)["supported_openai_params"]
    finally:
        monkeypatch.setattr(litellm.utils, "_build_model_info", patched)
        litellm.get_model_info.cache_clear()
    assert "functions" in listed and "prediction" in listed, (
        "LiteLLM now lists a custom provider's own parameters: compat.model_info_lists_supported_params can go")
    assert litellm.get_model_info(MODEL)["supported_openai_params"] == list(SUPPORTED_OPENAI_PARAMS)


@pytest.fixture
def handed(monkeypatch) -> dict:
    """What LiteLLM hands the handler (its arguments to ``parse_request``); the call then fails."""
    seen: dict = {}

    def capture(messages, optional_params, litellm_params=None, logging_obj=None):
        seen.update(messages=messages, optional_params=optional_params, logging_obj=logging_obj)
        raise InvalidRequestError("captured", param="probe")

    monkeypatch.setattr(llm, "parse_request", capture)
    return seen


def test_sent_params_keep_the_name_litellm_renames(handed):
    with pytest.raises(litellm.BadRequestError, match="captured"):
        litellm.completion(model=MODEL, messages=MESSAGES, max_completion_tokens=5)
    assert (handed["optional_params"].get("max_tokens"), "max_completion_tokens" in handed["optional_params"]) == (
        5, False), "LiteLLM no longer renames max_completion_tokens: compat.sent_params may go"
    assert compat.sent_params(handed["logging_obj"])["max_completion_tokens"] == 5, (
        "Logging.model_call_details no longer keeps the caller's keys: see compat.sent_params")


def test_sent_messages_drop_the_role_litellm_fills_in(handed):
    with pytest.raises(litellm.BadRequestError, match="captured"):
        litellm.completion(model=MODEL, messages=[*MESSAGES, {"content": "no role"}])
    assert handed["messages"][1].get("role") == "assistant", (
        "LiteLLM no longer fills in a missing role: compat.sent_messages can go")
    assert compat.sent_messages(handed["messages"], handed["logging_obj"]) == [*MESSAGES, {"content": "no role"}], (
        "Logging.messages no longer keeps the caller's messages: see compat.sent_messages")


def test_proxy_request_body_is_where_the_proxy_puts_the_request():
    # Behaviour: tests/litellm/test_flm_proxy.py's base64 embeddings, whose encoding_format LiteLLM drops.
    # Read, not imported: importing the proxy's modules takes seconds.
    source = Path(importlib.util.find_spec("litellm.proxy.litellm_pre_call_utils").origin).read_text(encoding="utf-8")
    assert 'data["proxy_server_request"] = {' in source and '"body"' in source, (
        "the proxy no longer hands litellm_params['proxy_server_request']['body']: see compat.proxy_request_body")
    assert compat.proxy_request_body({"proxy_server_request": {"body": {"encoding_format": "base64"}}}) == {
        "encoding_format": "base64"}


def test_put_stats_reach_the_caller_in_hidden_params(fake_engine):
    fake_engine.stats = RequestStats(prompt_tokens=9, completion_tokens=3, generated_tokens=3, queue_s=0.0, ttft_s=0.1,
                                     decode_s=0.2, total_s=0.3)
    r = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert compat.request_stats(r) == r._hidden_params["flm_stats"] == fake_engine.stats.as_dict(), (
        "LiteLLM no longer passes the handler's _hidden_params on: see compat.put_stats")


def test_sibling_finish_finishes_a_choice_of_a_stream(fake_engine):
    fake_engine.seeded_replies = {4: "abc", choice_seed(4, 1): "x"}
    chunks = list(litellm.completion(model=MODEL, messages=MESSAGES, n=2, seed=4, max_tokens=2, stream=True))
    assert joined_choices(chunks) == ({0: "ab", 1: "x"}, {0: "length", 1: "stop"}), (
        "LiteLLM's stream wrapper no longer reads choice_index / sibling_finish_reason: see compat.sibling_finish")


def test_drain_on_sigterm_knows_the_proxys_module():
    assert importlib.util.find_spec(compat.PROXY_SERVER) is not None, (
        "a LiteLLM proxy no longer loads this module: compat.drain_on_sigterm would never install")
