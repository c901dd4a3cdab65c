"""register(): idempotent, model metadata in litellm, and the Router path (FakeEngine)."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import litellm
import pytest

import litellm_flm


def entry(tag: str, context_length: int | None = None, base: str | None = None, chat: bool = True):
    """A registry entry as ``_model_infos`` reads it (``ModelEntry``'s attributes)."""
    return SimpleNamespace(tag=tag, context_length=context_length, base=base, chat=chat,
                           known_context_length=lambda: context_length)


ENTRIES = [entry("smollm2:135m", 8192), entry("tiny-test:1m", 512)]
DFLASH = entry("smollm2-dflash:135m", base="smollm2:135m")
UNKNOWN_CONTEXT = entry("byo:7b")
BASE = entry("base:1m", 1024, chat=False)
BASE_DFLASH = entry("base-dflash:1m", base="base:1m")


@pytest.fixture
def fake_registry(monkeypatch):
    monkeypatch.setattr(litellm_flm, "_registry_entries",
                        lambda: [*ENTRIES, DFLASH, UNKNOWN_CONTEXT, BASE, BASE_DFLASH])


def test_register_is_idempotent(fake_registry, monkeypatch):
    other = {"provider": "someone-else", "custom_handler": object()}
    monkeypatch.setattr(litellm, "custom_provider_map", [other, {"provider": "flm", "custom_handler": object()}])
    for _ in range(3):
        litellm_flm.register()
    assert litellm.custom_provider_map == [other, {"provider": "flm", "custom_handler": litellm_flm.handler}]
    assert litellm._custom_providers.count("flm") == 1
    assert litellm.provider_list.count("flm") == 1


def test_registered_models_are_free_chat_models_with_their_context(fake_registry):
    litellm_flm.register()
    for entry in ENTRIES:
        info = litellm.get_model_info(f"flm/{entry.tag}")
        assert info["max_input_tokens"] == entry.context_length
        assert info["max_output_tokens"] == entry.context_length
        assert info["input_cost_per_token"] == 0.0 and info["output_cost_per_token"] == 0.0
        assert info["litellm_provider"] == "flm" and info["mode"] == "chat"


def test_a_base_model_and_its_dflash_tag_are_completion_models(fake_registry):
    """A tag without a chat template (``chat`` False) refuses chats: LiteLLM's mode says so."""
    litellm_flm.register()
    for tag in (BASE.tag, BASE_DFLASH.tag):
        info = litellm.get_model_info(f"flm/{tag}")
        assert (info["mode"], info["max_input_tokens"]) == ("completion", 1024)


def test_dflash_tags_get_their_base_context_and_unknown_contexts_stay_unset(fake_registry):
    litellm_flm.register()
    assert litellm.get_model_info(f"flm/{DFLASH.tag}")["max_input_tokens"] == 8192
    info = litellm.get_model_info(f"flm/{UNKNOWN_CONTEXT.tag}")
    assert info["max_input_tokens"] is None and info["input_cost_per_token"] == 0.0


def test_a_broken_models_file_does_not_break_registration(monkeypatch):
    import flm_runtime.registry
    from flm_runtime.errors import ModelFormatError

    def broken():
        raise ModelFormatError("~/.config/litellm-flm/models.yaml: line 3: bad indentation")

    monkeypatch.setattr(flm_runtime.registry, "list_entries", broken)
    litellm_flm.register()
    assert litellm_flm.handler in [e["custom_handler"] for e in litellm.custom_provider_map]


def test_the_real_registry_is_registered():
    litellm_flm.register()
    assert litellm.get_model_info("flm/smollm2:135m")["max_input_tokens"] == 8192
    assert litellm.get_model_info("flm/smollm2:135m")["mode"] == "chat"
    assert litellm.get_model_info("flm/gemma3:270m")["mode"] == "completion"  # a base model


def test_model_info_lists_the_parameters_the_handler_supports():
    """Not LiteLLM's one list for every custom provider, which holds ``functions``, ``audio``, ..."""
    from litellm_flm.params import KEYS, NEUTRAL_ONLY, SUPPORTED_OPENAI_PARAMS

    litellm_flm.register()
    assert litellm.get_model_info("flm/smollm2:135m")["supported_openai_params"] == list(SUPPORTED_OPENAI_PARAMS)
    assert {k for k, key in KEYS.items() if key.kind == NEUTRAL_ONLY} <= set(litellm.get_model_info("openai/gpt-4o-mini")["supported_openai_params"])


def test_completion_cost_is_zero(fake_registry, fake_engine):
    litellm_flm.register()
    r = litellm.completion(model="flm/smollm2:135m", messages=[{"role": "user", "content": "hi"}])
    assert litellm.completion_cost(r) == 0.0


def test_router(fake_registry, fake_engine):
    litellm_flm.register()
    router = litellm.Router(
        model_list=[{"model_name": "smollm2", "litellm_params": {"model": "flm/smollm2:135m"}}], num_retries=0
    )
    r = router.completion(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.content == fake_engine.reply[:4]
    assert r.usage.completion_tokens == 4
    stream = router.completion(model="smollm2", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == fake_engine.reply


async def test_router_async_and_context_window_fallback(fake_registry, fake_engine):
    litellm_flm.register()
    router = litellm.Router(
        model_list=[
            {"model_name": "small", "litellm_params": {"model": "flm/tiny-test:1m"}},
            {"model_name": "big", "litellm_params": {"model": "flm/smollm2:135m"}},
        ],
        context_window_fallbacks=[{"small": ["big"]}],
        num_retries=0,
    )
    fake_engine.context_length = 40  # the FakeEngine serves both tags; make "small" overflow first
    calls = []
    original = fake_engine.submit

    def submit(prompt_ids, params, **kw):
        calls.append(fake_engine.requested_tags[-1])
        if len(calls) == 2:
            fake_engine.context_length = 1000  # the fallback model has room
        return original(prompt_ids, params, **kw)

    fake_engine.submit = submit
    r = await router.acompletion(model="small", messages=[{"role": "user", "content": "x" * 30}])
    assert calls == ["tiny-test:1m", "smollm2:135m"]
    assert r.choices[0].message.content == fake_engine.reply


@pytest.fixture
def flm_loggers(monkeypatch):
    """The flm_runtime and litellm_flm loggers, restored after the test."""
    loggers = [logging.getLogger(name) for name in ("flm_runtime", "litellm_flm")]
    for logger in loggers:
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "propagate", logger.propagate)
        monkeypatch.setattr(logger, "level", logger.level)
    return loggers


def test_flm_log_level_sends_the_runtime_lines_to_stderr(flm_loggers, monkeypatch):
    for _ in range(2):
        litellm_flm.configure_logging(" info ")
    assert [(lg.level, lg.propagate, len(lg.handlers)) for lg in flm_loggers] == [(logging.INFO, False, 1)] * 2
    handler = flm_loggers[0].handlers[0]
    assert handler is flm_loggers[1].handlers[0] and isinstance(handler, logging.StreamHandler)
    monkeypatch.setattr(handler, "stream", io.StringIO())
    logging.getLogger("flm_runtime.scheduling.engine").info("request finished; engine stats {}")
    logging.getLogger("flm_runtime.scheduling.engine").debug("not at INFO")
    out = handler.stream.getvalue()
    assert out.endswith(" flm_runtime.scheduling.engine INFO: request finished; engine stats {}\n") and "not at" not in out


def test_flm_log_level_unset_leaves_logging_alone_and_a_bad_one_is_named(flm_loggers):
    before = [(lg.level, lg.propagate, list(lg.handlers)) for lg in flm_loggers]
    litellm_flm.configure_logging("")
    assert [(lg.level, lg.propagate, list(lg.handlers)) for lg in flm_loggers] == before
    with pytest.raises(ValueError, match="FLM_LOG_LEVEL must be a logging level .* got 'loud'"):
        litellm_flm.configure_logging("loud")
