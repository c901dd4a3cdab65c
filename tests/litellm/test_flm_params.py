"""A request's parameters -> its ``ChatRequest`` (``parse_request``) and SamplingParams, on payloads
shaped the way litellm 1.110.2 passes them."""

from __future__ import annotations

import pytest

from flm_runtime.errors import InvalidRequestError
from flm_runtime.sampling.sampler import FALLBACK_SAMPLING, SamplingDefaults
from litellm_flm.params import (KEYS, NEUTRAL_ONLY, OPTION, SUPPORTED_OPENAI_PARAMS, ChatRequest, normalize_messages,
                                parse_request)

CHAT = [{"role": "user", "content": "hi"}]


def parse(optional_params: dict, **litellm_params) -> ChatRequest:
    return parse_request(CHAT, optional_params, litellm_params)


def to_sampling_params(optional_params: dict, defaults: SamplingDefaults = FALLBACK_SAMPLING):
    """The request's sampling fields resolved as the engine resolves them against its model's defaults."""
    return defaults.resolve(**parse(optional_params).sampling)


def test_empty_request_sets_nothing_and_gets_the_default_sampler_with_no_token_cap():
    assert parse({}).sampling == {}
    p = to_sampling_params({})
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (
        FALLBACK_SAMPLING.temperature, FALLBACK_SAMPLING.top_k, FALLBACK_SAMPLING.top_p, FALLBACK_SAMPLING.min_p
    )
    assert p.max_tokens is None and p.stop == () and p.seed is None


def test_a_model_default_sampler_fills_only_unset_fields():
    p = to_sampling_params({"top_p": 0.5}, SamplingDefaults(temperature=0.2, top_k=10, top_p=0.9, min_p=0.05))
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.2, 10, 0.5, 0.05)


def test_every_mapped_param_reaches_the_runtime():
    # What litellm hands a custom provider for: temperature=0, max_completion_tokens=7, stop="END",
    # seed=3, top_p=0.5, top_k=5, extra_body={"min_p": 0.1, "ignore_eos": True}, stream=True (Router).
    p = to_sampling_params(
        {
            "temperature": 0,
            "max_tokens": 7,
            "stop": "END",
            "seed": 3,
            "top_p": 0.5,
            "top_k": 5,
            "extra_body": {"min_p": 0.1, "ignore_eos": True},
            "stream": True,
            "max_retries": 0,
        }
    )
    assert p == type(p)(
        temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=3, max_tokens=7, stop=("END",), ignore_eos=True
    )


def test_penalties_bias_and_logprobs_reach_the_runtime():
    # As the OpenAI SDK sends them: logit_bias keys are JSON strings; repetition_penalty in extra_body.
    p = to_sampling_params({"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"50256": -100, "7": 2.5},
                            "logprobs": True, "top_logprobs": 20, "extra_body": {"repetition_penalty": 1.2}})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == {50256: -100.0, 7: 2.5} and (p.logprobs, p.top_logprobs) == (True, 20)


def test_request_values_override_the_default_per_field():
    p = to_sampling_params({"temperature": 0.7})
    assert p.temperature == 0.7 and p.top_k == FALLBACK_SAMPLING.top_k and p.top_p == FALLBACK_SAMPLING.top_p


def test_max_completion_tokens_is_max_tokens():
    assert KEYS["max_completion_tokens"].field == "max_tokens"
    assert to_sampling_params({"max_completion_tokens": 9}).max_tokens == 9


def test_stop_list_and_none():
    assert to_sampling_params({"stop": ["a", "b"]}).stop == ("a", "b")
    assert to_sampling_params({"stop": None}).stop == ()


def test_neutral_values_of_unsupported_params_are_accepted():
    to_sampling_params(
        {
            "modalities": ["text"],
        }
    )


def test_ignored_params_are_ignored():
    # Each of these reached a custom handler's optional_params in a probe of litellm 1.110.2.
    ignored = {
        "user": "u1", "metadata": {"k": "v"}, "max_retries": 2, "stream": True, "stream_options": {"include_usage": True},
        "safety_identifier": "s", "store": True,
    }
    assert parse(ignored).sampling == {}


@pytest.mark.parametrize(
    "params, name",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"50256": -101}}, "logit_bias"),
        ({"logit_bias": {"the": 5}}, "logit_bias"),
        ({"logit_bias": {"-3": 5}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"max_completion_tokens": "5"}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"extra_body": "min_p=0.1"}, "extra_body"),
        ({"top_p": 0.5, "extra_body": {"top_p": 0.9}}, "top_p"),
    ],
)
def test_rejected_params_are_named(params, name):
    with pytest.raises(InvalidRequestError) as info:
        to_sampling_params(params)
    assert info.value.param == name
    assert name in str(info.value)


def test_drop_unsupported_leaves_out_every_unsupported_openai_param_at_any_value():
    unsupported = {
        "functions": [{"name": "f"}], "function_call": "auto", "modalities": ["audio"],
        "audio": {"voice": "alloy"}, "web_search_options": {},
    }
    assert set(unsupported) == {k for k, key in KEYS.items() if key.kind == NEUTRAL_ONLY}
    assert parse({**unsupported, "temperature": 0, "max_tokens": 3}, drop_params=True).sampling == {
        "temperature": 0, "max_tokens": 3
    }


@pytest.mark.parametrize(
    "params, name",
    [({"frobnicate": 1}, "frobnicate"), ({"extra_body": {"repetition_penalty": "1.1"}}, "repetition_penalty"),
     ({"temperature": "0.5", "n": 2}, "temperature")],
)
def test_drop_unsupported_still_refuses_unknown_keys_and_bad_values(params, name):
    # LiteLLM's drop_params drops only OpenAI parameters; a mistyped supported one stays an error.
    with pytest.raises(InvalidRequestError) as info:
        parse(params, drop_params=True)
    assert info.value.param == name


def test_messages_are_normalized():
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    out = normalize_messages(
        [
            {"role": "developer", "content": "be brief", "name": "ignored"},
            {"role": "user", "content": parts},
            {"role": "assistant", "content": None},
        ]
    )
    # Content goes on as given: the runtime's template renderer flattens parts.
    assert out == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None},
    ]


@pytest.mark.parametrize(
    "messages, name",
    [
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "function", "content": "42", "name": "f"}], "messages[0].role"),
        ([{"content": "no role"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": "s"}, {"role": "tool", "content": None}], "messages[1].content"),
        ([{"role": "user", "content": "a", "tool_calls": [{"id": "x"}]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "function_call": {"name": "f"}}], "messages[0].function_call"),
    ],
)
def test_bad_messages_are_named(messages, name):
    with pytest.raises(InvalidRequestError) as info:
        normalize_messages(messages)
    assert info.value.param == name


def test_n_is_the_choices_per_prompt_not_a_sampling_field():
    assert "n" in SUPPORTED_OPENAI_PARAMS and KEYS["n"].kind != NEUTRAL_ONLY
    assert [parse(p).n for p in ({}, {"n": None}, {"n": 1}, {"n": 3}, {"extra_body": {"n": 2}})] == [1, 1, 1, 3, 2]
    assert parse({"n": 3, "temperature": 0.5}).sampling == {"temperature": 0.5}


@pytest.mark.parametrize("n", [0, -1, 2.0, "2", True])
def test_bad_n_is_named(n):
    with pytest.raises(InvalidRequestError) as info:
        parse({"n": n})
    assert info.value.param == "n" and str(info.value) == f"n must be an integer >= 1, got {n!r}"


def test_each_option_is_the_chat_request_field_of_its_name():
    request = parse({"n": 2, "extra_body": {"return_token_ids": True, "backend": "cpu"}})
    assert (request.n, request.return_token_ids, request.suffix, request.backend) == (2, True, None, "cpu")
    assert {k for k, key in KEYS.items() if key.kind == OPTION} == {"n", "return_token_ids", "suffix", "backend",
                                                                  "prediction", "speculation"}


def test_max_completion_tokens_is_named_as_sent_after_the_parse_too():
    # ChatRequest.names: the engine's later errors (a range, the context) name max_tokens.
    assert parse({"max_completion_tokens": 9}).names == {"max_tokens": "max_completion_tokens"}
    assert parse({"max_tokens": 9}).names == {}
    with pytest.raises(InvalidRequestError) as info:
        parse({"max_tokens": 1, "max_completion_tokens": 2})
    assert (info.value.param, str(info.value)) == ("max_tokens", "give max_tokens or max_completion_tokens, not both")


@pytest.mark.parametrize("logprobs", [True, 1, 0])
def test_a_text_completion_refuses_logprobs_of_any_value_or_drops_them(logprobs):
    with pytest.raises(InvalidRequestError) as info:
        parse({"logprobs": logprobs}, text_completion=True)
    assert info.value.param == "logprobs"
    assert parse({"logprobs": logprobs, "top_logprobs": 2}, text_completion=True, drop_params=True).sampling == {}
