"""Structured output and tools through ``litellm.completion`` on the embedded SmolLM2-135M:
JSON mode, json_schema (a pydantic class too), tool calls under every tool_choice, streamed calls
equal to non-streamed ones, tool results in the next turn, errors that name the parameter, and 50
sampled json_schema requests over 5 schemas that all parse and validate."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import litellm
import pydantic
import pytest

MODEL = "flm/smollm2:135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0, "max_tokens": 120}


def arguments_of(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_json_mode_gives_a_json_object(smollm2_engine):
    r = litellm.completion(model=MODEL, messages=[{"role": "user", "content": 'Give me a JSON object describing a cat, '
                                                                              'with keys "name" and "color".'}],
                           response_format={"type": "json_object"}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    species: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog", "bird"]})
    age: int = pydantic.Field(ge=0, le=30)


def test_a_pydantic_response_format_validates(smollm2_engine):
    r = litellm.completion(model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}],
                           response_format=Pet, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    Pet.model_validate_json(r.choices[0].message.content)


def test_a_named_tool_choice_calls_that_tool(smollm2_engine):
    r = litellm.completion(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments_of(call, WEATHER)


def test_required_calls_a_tool_and_none_calls_none(smollm2_engine):
    required = litellm.completion(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", **GREEDY)
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        arguments_of(call, {"get_weather": WEATHER, "add": ADD}[call.function.name])
    none = litellm.completion(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", **GREEDY)
    assert none.choices[0].finish_reason in ("stop", "length") and none.choices[0].message.content
    assert not none.choices[0].message.tool_calls


def test_a_call_cut_by_max_tokens_is_dropped_not_left_as_text(smollm2_engine):
    """The calls before the cut stay, the cut one is dropped, content stays None, in a stream too."""
    ask = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    full = litellm.completion(**ask, max_tokens=120)
    whole, n = full.choices[0].message.tool_calls, full.usage.completion_tokens
    assert full.choices[0].finish_reason == "tool_calls"
    calls = lambda m: [(c.function.name, c.function.arguments) for c in m.tool_calls or []]  # noqa: E731
    for cut in (12, n - 1):  # inside the first call's JSON; short of the last call's closing tag
        r = litellm.completion(**ask, max_tokens=cut)
        choice = r.choices[0]
        assert (choice.finish_reason, choice.message.content, r.usage.completion_tokens) == ("length", None, cut)
        kept = calls(choice.message)
        assert kept == [(c.function.name, c.function.arguments) for c in whole[:len(kept)]]
        assert len(kept) == (0 if cut == 12 else len(whole) - 1)
        chunks = [c for c in litellm.completion(**ask, max_tokens=cut, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert [(d.function.name, d.function.arguments) for c in chunks for d in c.choices[0].delta.tool_calls or []
                ] == kept


def test_auto_answers_in_text_or_calls(smollm2_engine):
    r = litellm.completion(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto", **GREEDY)
    message = r.choices[0].message
    if message.tool_calls:   # whichever the model chooses, the answer is one or the other, whole
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    else:
        assert "<tool_call>" not in message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_streamed_call_equals_the_non_streamed_one(smollm2_engine, choice):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    whole = litellm.completion(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, **GREEDY)
    chunks = list(litellm.completion(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, stream=True,
                                     **GREEDY))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.choices[0].message.tool_calls)]
    assert all(d.id.startswith("call_") for d in deltas)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_results_flow_back_into_the_next_turn(smollm2_engine, monkeypatch):
    first = litellm.completion(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    [call] = first.choices[0].message.tool_calls
    history = ASK_WEATHER + [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius."}]
    prompts, submit = [], smollm2_engine.submit_choices
    monkeypatch.setattr(smollm2_engine, "submit_choices",
                        lambda ids, *a, **kw: prompts.append(ids) or submit(ids, *a, **kw))
    second = litellm.completion(model=MODEL, messages=history, tools=TOOLS, **GREEDY)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    # The next turn's prompt holds the tools, the call as the model wrote it, and its result.
    prompt = smollm2_engine.tokenizer.decode(prompts[0])
    call_text = f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>'
    assert "<tools>" in prompt
    assert f"<|im_start|>assistant\n{call_text}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nSunny, 24 degrees celsius.\n</tool_response><|im_end|>" in prompt


@pytest.mark.parametrize("kwargs, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}}, "response_format", "nowhere"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice", "mul"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools", "nonsense"),
])
def test_bad_structured_requests_are_bad_requests_saying_why(smollm2_engine, kwargs, param, says):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=ASK_WEATHER, max_tokens=4, **kwargs)
    assert param in str(info.value) and says in str(info.value)


# Strings, arrays and numbers bounded: an unbounded one lets a sampled 135M model write until
# max_tokens (a fraction's digits forever), and text cut short does not parse.
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "country": {"type": "string", "maxLength": 24}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "percent": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "percent"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "minItems": 1, "maxItems": 4}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]}}, "required": ["person", "role"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech"]},
                                               "maxItems": 3},
                                      "published": {"type": "boolean"}},
     "required": ["title", "tags", "published"], "additionalProperties": False},
]
QUESTIONS = ["Where is the Eiffel Tower?", "Is the sky blue?", "What should I buy at the market?",
             "Describe a user of a website.", "Write a headline about a football match."]


async def test_twenty_concurrent_sampled_json_schema_requests_all_parse_and_validate(smollm2_engine):
    async def ask(i):
        schema, question = SCHEMAS[i % 5], QUESTIONS[i % 5]
        r = await litellm.acompletion(model=MODEL, messages=[{"role": "user", "content": question}], temperature=1.0,
                                      seed=i, max_tokens=200,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": f"s{i % 5}", "schema": schema}})
        return r.choices[0], schema

    results = await asyncio.gather(*(ask(i) for i in range(20)))  # four of each schema, batched
    valid = 0
    for choice, schema in results:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
        valid += 1
    assert valid == 20


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_sampled_choices_follows_the_schema_with_its_own_grammar(smollm2_engine, stream):
    # One grammar matcher per choice: a shared one would advance on the other choices' tokens.
    schema = SCHEMAS[3]
    format_ = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    asked = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[3]}], temperature=1.0, seed=7,
                 max_tokens=200, n=3, response_format=format_)
    if stream:
        texts = ["", "", ""]
        for chunk in litellm.completion(stream=True, **asked):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        texts = [c.message.content for c in litellm.completion(**asked).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # sampled choices, each its own
