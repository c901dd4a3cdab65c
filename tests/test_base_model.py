"""A base model (a GGUF without a chat template): ``run`` and text completions continue the text,
chat requests are refused with ``NoChatTemplateError`` (LiteLLM's ``BadRequestError``)."""

from __future__ import annotations

import litellm
import pytest
from loading.tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf

import litellm_flm  # noqa: F401  (registers the flm provider)
from flm_runtime import api, cli, registry

TAG = "tiny-base:1m"
PROMPT = "the world in"


@pytest.fixture
def base_engine(tmp_path, monkeypatch):
    """The engine of ``TAG``: a tiny random Llama GGUF without a chat template, named in a user
    models file; dropped afterwards."""
    config = tiny_config()
    gguf = write_tiny_gguf(tmp_path / "base.gguf", config, random_hf_weights(config), chat_template=None)
    (tmp_path / "models.yaml").write_text(f"{TAG}: {gguf}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    monkeypatch.setenv("FLM_BACKEND", "cpu")
    registry.reload()
    engine = api.get_engine(TAG)
    assert engine.tokenizer.chat_template is None
    yield engine
    api.default_runtime.forget(TAG)


def greedy_continuation(engine, max_tokens: int):
    """The engine's greedy continuation of ``PROMPT``'s raw tokens (no template): the reference."""
    ids = engine.tokenizer.encode(PROMPT)
    return ids, engine.submit(ids, engine.sampling_params(temperature=0.0, max_tokens=max_tokens)).result()


def test_run_continues_the_prompt_of_a_base_model(base_engine, capsys):
    ids, want = greedy_continuation(base_engine, 6)
    assert cli.main(["run", TAG, PROMPT, "--temperature", "0", "--max-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n"
    assert err.startswith(f"[{TAG}: {len(ids)} prompt tokens, {want.stats.completion_tokens} completion tokens")


def test_run_refuses_a_system_message_for_a_base_model(base_engine, capsys):
    assert cli.main(["run", TAG, PROMPT, "--system", "Be brief."]) == 1
    err = capsys.readouterr().err
    assert f"{TAG} is a base model without a chat template" in err and "system" in err


def test_text_completion_continues_and_a_chat_is_refused(base_engine):
    _, want = greedy_continuation(base_engine, 6)
    r = litellm.text_completion(model=f"flm/{TAG}", prompt=PROMPT, temperature=0, max_tokens=6)
    assert r.choices[0].text == want.text
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=f"flm/{TAG}", messages=[{"role": "user", "content": PROMPT}], max_tokens=6)
    msg = str(info.value)
    assert "base model without a chat template" in msg and "text_completion" in msg
    assert info.value.status_code == 400


def test_the_registry_says_which_built_in_files_carry_a_chat_template(gemma3_gguf, smollm2_gguf):
    """``ModelEntry.chat`` is declared (LiteLLM's mode is registered before any file is read):
    it must say what the files say."""
    from flm_runtime.loading.gguf import open_gguf

    for tag, path in (("gemma3:270m", gemma3_gguf), ("smollm2:135m", smollm2_gguf)):
        assert registry.resolve(tag).chat is ("tokenizer.chat_template" in open_gguf(path).metadata)
    assert registry.resolve("gemma3:270m").chat is False
