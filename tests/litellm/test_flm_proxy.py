"""The LiteLLM proxy serving examples/proxy_config.yaml, called with the OpenAI SDK.

Starts ``litellm --config examples/proxy_config.yaml`` as a subprocess on a free local port (the
proxy loads the model itself, in its own process; ``tests/proxy_process.py``), waits for
``/health/liveliness``, and always terminates the proxy.

The engine runs inside the proxy's process, so the tests read its stats from the proxy's output:
with ``FLM_LOG_LEVEL=DEBUG`` the engine logs a line with its stats (JSON) whenever a request is
queued or ends (``Engine.submit`` and ``Engine._end``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import time
from pathlib import Path

import litellm
import numpy as np
import openai
import proxy_process
import pytest
from forced_speculation import write_always_speculate_policy
from stream_choices import joined_choices
from test_flm_fim import MIDDLE, PREFIX, SUFFIX, TEMPLATED_IDS


REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "proxy_config.yaml"
REQUEST_S = 300  # the first request also loads the model in the proxy process
IN_FLIGHT = 100  # the disconnect test's requests; the proxy's engine queues them all (FLM_MAX_QUEUE)


@pytest.fixture(scope="module")
def proxy_url(smollm2_gguf, tmp_path_factory):
    port = proxy_process.free_port()
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    key = f"sk-{secrets.token_hex(32)}"
    # smollm2-dflash speculates at every step (its shipped cpu table speculates nowhere).
    config_home = write_always_speculate_policy(tmp_path_factory.mktemp("config"))
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-dummy-not-used",
               LITELLM_MASTER_KEY=key, FLM_LOG_LEVEL="DEBUG", FLM_MAX_QUEUE=str(IN_FLIGHT), FLM_BACKEND="cpu",
               XDG_CONFIG_HOME=str(config_home))
    proc = proxy_process.start(CONFIG, port, env, log)
    try:
        proxy_process.wait_ready(proc, port, log)
        yield f"http://127.0.0.1:{port}/v1", key, log
    finally:
        proxy_process.stop(proc)


@pytest.fixture(scope="module")
def client(proxy_url):
    url, key, _ = proxy_url
    return openai.OpenAI(base_url=url, api_key=key, timeout=REQUEST_S, max_retries=0)


def test_chat_completion_through_the_proxy(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
        extra_body={"top_k": 1},  # arrives nested in optional_params["extra_body"]
    )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24



def test_model_info_through_the_proxy_states_the_window_mode_and_supported_params(proxy_url):
    """``/v1/model/info``: what ``import litellm_flm`` registered, the parameters the handler supports included."""
    import httpx

    from litellm_flm.params import SUPPORTED_OPENAI_PARAMS

    url, key, _ = proxy_url
    r = httpx.get(f"{url}/model/info", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    info = {m["model_name"]: m["model_info"] for m in r.json()["data"]}
    assert (info["smollm2"]["max_input_tokens"], info["smollm2"]["mode"]) == (8192, "chat")
    assert info["smollm2"]["supported_openai_params"] == list(SUPPORTED_OPENAI_PARAMS)
    assert "functions" in info["gpt-4o-mini"]["supported_openai_params"]  # another provider's stays its own

def test_stream_through_the_proxy(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_token_ids_through_the_proxy(client):
    """vLLM's ``return_token_ids`` reaches the handler in ``extra_body`` and the ids (fields the
    proxy does not declare) come back, streamed or not; the DFlash deployment's greedy ids equal
    the plain one's."""
    ask = {"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "max_tokens": 8,
           "extra_body": {"return_token_ids": True}}
    r = client.chat.completions.create(model="smollm2", **ask).model_dump()
    prompt, ids = r["prompt_token_ids"], r["choices"][0]["token_ids"]
    assert (len(prompt), len(ids)) == (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) and len(ids) == 8
    for model in DEPLOYMENTS:
        chunks = [c.model_dump() for c in client.chat.completions.create(model=model, stream=True, **ask)]
        assert chunks[0]["prompt_token_ids"] == prompt
        assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []] == ids


def test_bad_param_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2, presence_penalty=3.0
        )
    assert "presence_penalty" in str(info.value)


# ---- structured output and tools, on the plain and the DFlash deployment ----

DEPLOYMENTS = ["smollm2", "smollm2-dflash"]
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "tier": {"enum": ["free", "pro", "enterprise"]}},
                 "required": ["name", "tier"], "additionalProperties": False},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 20}, "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["product", "quantity"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    "status": {"enum": ["pending", "shipped", "delivered"]},
}, "required": ["customer", "items", "status"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("model", DEPLOYMENTS)
def test_json_mode_through_the_proxy(client, model):
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=100, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Give me a JSON object describing a cat, with keys "name" and "color".'}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("model", DEPLOYMENTS)
def test_json_schema_through_the_proxy(client, model):
    """A nested object, enums and an array: the answer validates against the schema."""
    import jsonschema

    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}},
        messages=[{"role": "user",
                   "content": "Record an order: Ann, a pro customer, bought two books. It has shipped."}])
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)


@pytest.mark.parametrize("model", DEPLOYMENTS)
def test_a_named_tool_call_through_the_proxy(client, model):
    import jsonschema

    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=100, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed = client.chat.completions.create(
        model=model, temperature=0, max_tokens=100, tools=[WEATHER_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)]


def _stream_logprobs(client, model: str, **kw) -> tuple[str, list, int]:
    """A stream's text, logprobs entries (in order) and completion_tokens."""
    chunks = list(client.chat.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    return text, entries, chunks[-1].usage.completion_tokens


def _tokens_and_values(entries) -> tuple[list, list]:
    """Each logprobs entry's token and top tokens, and its logprob and top logprobs."""
    return ([(e.token, [t.token for t in e.top_logprobs]) for e in entries],
            [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in entries])


def test_streamed_logprobs_through_the_proxy_on_both_tags(client):
    """``logprobs`` with ``top_logprobs=5``, streamed, on smollm2 and on smollm2-dflash (speculating
    at every step): one entry per completion token in OpenAI's shape, equal to the non-streamed
    ones, and the same tokens and values (1e-4) on both tags, penalties and bias included. On the
    DFlash tag the non-streamed request repeats the streamed one, which the suffix proposer then
    proposes: other verify passes, so the float32 values may differ by rounding (1e-4)."""
    request = dict(messages=[{"role": "user", "content": "Name three colours of the rainbow."}], temperature=0,
                   max_tokens=10, logprobs=True, top_logprobs=5, presence_penalty=0.4, frequency_penalty=0.2,
                   logit_bias={"28": 1.5}, extra_body={"repetition_penalty": 1.1})
    results = {}
    for model in ("smollm2", "smollm2-dflash"):
        text, entries, completion_tokens = _stream_logprobs(client, model, **request)
        whole = client.chat.completions.create(model=model, **request)
        assert text == whole.choices[0].message.content and len(entries) == completion_tokens == 10
        if model == "smollm2":
            assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.choices[0].logprobs.content]
        else:  # it speculated: drafted tokens were verified, some (maybe all, from the suffix index) kept
            assert whole.usage.completion_tokens_details.accepted_prediction_tokens >= 1
            tokens, values = _tokens_and_values(entries)
            whole_tokens, whole_values = _tokens_and_values(whole.choices[0].logprobs.content)
            assert tokens == whole_tokens
            np.testing.assert_allclose(values, whole_values, atol=1e-4)
        for e in entries:
            assert len(e.top_logprobs) == 5 and e.top_logprobs[0].token == e.token
            assert bytes(e.bytes).decode() == e.token
        results[model] = (text, *_tokens_and_values(entries))
    (text, tokens, values), (spec_text, spec_tokens, spec_values) = results["smollm2"], results["smollm2-dflash"]
    assert (spec_text, spec_tokens) == (text, tokens)
    np.testing.assert_allclose(spec_values, values, atol=1e-4)


def first_line_and_rest(message: str) -> tuple[str, str]:
    """Our message, and the notes the proxy's Router appends on lines of their own (which
    fallbacks it had; none names a class again)."""
    ours, _, notes = message.partition("\n")
    assert not re.search(r"litellm\.\w+(Error|Timeout):", notes), notes
    return ours, notes


def test_error_messages_carry_the_litellm_prefix_once(client):
    from flm_runtime.api import get_engine

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], n=0)
    ours, _ = first_line_and_rest(info.value.body["message"])
    assert ours == "litellm.BadRequestError: n must be an integer >= 1, got 0"
    long = [{"role": "user", "content": "cat " * 8200}]  # the prompt alone fills the context; max_tokens unset
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=long)
    engine = get_engine("smollm2:135m")
    n_prompt = len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(long, add_generation_prompt=True)))
    assert first_line_and_rest(info.value.body["message"])[0] == (
        f"litellm.ContextWindowExceededError: this model's context length is {engine.context_length} tokens; the "
        f"prompt has {n_prompt} tokens, which leaves no room for a completion")


CHOICE_QUESTION = [{"role": "user", "content": "Name a colour and say why you like it."}]
CHOICE_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 16}


@pytest.mark.parametrize("name, tag", [("smollm2", "smollm2:135m"), ("smollm2-dflash", "smollm2-dflash:135m")])
def test_n_choices_with_a_seed_through_the_proxy(client, name, tag):
    """``n=3`` with a seed: the same three choices each time, each what this process's engine
    gives the one-choice request seeded as that choice; the prompt counted once; streamed too."""
    from flm_runtime.api import get_engine
    from flm_runtime.sampling.sampler import choice_seed

    kw = dict(model=name, messages=CHOICE_QUESTION, n=3, seed=1234, **CHOICE_SAMPLING)
    first, second = (client.chat.completions.create(**kw) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in second.choices] == texts and len(set(texts)) == 3
    engine = get_engine(tag)
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHOICE_QUESTION, add_generation_prompt=True))
    singles = [engine.submit(ids, engine.sampling_params(seed=choice_seed(1234, i), **CHOICE_SAMPLING)).result()
               for i in range(3)]
    assert texts == [s.text for s in singles]
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (
        len(ids), sum(s.completion_tokens for s in singles))

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed, finishes = joined_choices(chunks)
    assert streamed == dict(enumerate(texts))
    assert finishes == {c.index: c.finish_reason for c in first.choices}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        first.usage.prompt_tokens, first.usage.completion_tokens)


EMBED_TEXTS = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Stock markets fell sharply on Monday."]


def test_embeddings_through_the_proxy_as_floats_and_base64(client):
    local = np.array([d["embedding"] for d in litellm.embedding(model="flm/smollm2:135m", input=EMBED_TEXTS).data])
    floats = client.embeddings.create(model="smollm2", input=EMBED_TEXTS, encoding_format="float")
    default = client.embeddings.create(model="smollm2", input=EMBED_TEXTS)  # the SDK asks base64 and decodes it
    raw = client.embeddings.create(model="smollm2", input=EMBED_TEXTS, encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1, 2]
    as_floats = np.array([d.embedding for d in floats.data])
    np.testing.assert_allclose(as_floats, local, rtol=0, atol=2e-6)  # the proxy's own engine, same weights
    assert np.array_equal(np.array([d.embedding for d in default.data]), as_floats)
    assert all(isinstance(d.embedding, str) for d in raw.data)
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    assert np.array_equal(decoded, as_floats)
    assert floats.usage.prompt_tokens == raw.usage.prompt_tokens == default.usage.prompt_tokens > 0


def test_completions_through_the_proxy_continue_each_prompt(client):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    r = client.completions.create(model="smollm2", prompt=prompts, temperature=0, max_tokens=8)
    alone = [client.completions.create(model="smollm2", prompt=p, temperature=0, max_tokens=8) for p in prompts]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = client.completions.create(model="smollm2", prompt=prompts[1], temperature=0, max_tokens=8, stream=True)
    # LiteLLM's text stream wrapper sends the finishing chunk with text null (OpenAI sends "").
    assert "".join(c.choices[0].text or "" for c in streamed if c.choices) == alone[1].choices[0].text


def test_fill_in_the_middle_through_the_proxy(client, qwen_coder_gguf):
    # The OpenAI SDK's suffix reaches the handler as LiteLLM's text_completion passes it.
    fim = {"prompt": PREFIX, "suffix": SUFFIX, "temperature": 0, "max_tokens": 40}
    r = client.completions.create(model="qwen-coder", **fim)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (MIDDLE, "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(TEMPLATED_IDS), 11)  # MIDDLE is 11 tokens
    streamed = client.completions.create(model="qwen-coder", stream=True, **fim)
    assert "".join(c.choices[0].text or "" for c in streamed if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", **fim)
    assert info.value.param == "suffix"


ENGINE_LINE = re.compile(r"flm_runtime\.scheduling\.engine (?:DEBUG|INFO): request (\w+); engine stats (\{.*\})")
SYSTEM = {"role": "system", "content": "Be brief."}
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Name a planet.",
             "What do bees make?"]
KEPT_TOKENS = 6
DROPPED_TOKENS = 1000  # with ignore_eos: far more steps than the test takes before disconnecting


def engine_stats(log: Path) -> dict | None:
    """The engine's stats in the last engine line of the proxy's output (None before any)."""
    lines = ENGINE_LINE.findall(log.read_text(errors="replace"))
    return json.loads(lines[-1][1]) if lines else None


def requests_ended(stats: dict) -> int:
    return sum(stats[k] for k in ("finished", "failed", "cancelled", "timed_out"))


def requests_seen(stats: dict | None) -> int:
    """Requests the engine has taken: each is queued, running, or ended one way."""
    return stats["queued"] + stats["active"] + requests_ended(stats) if stats else 0


async def wait_for(cond, what: str, timeout: float = REQUEST_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"not reached within {timeout} s: {what}"
        await asyncio.sleep(0.05)


async def test_client_disconnects_free_their_sequences(proxy_url):
    """50 of 100 in-flight streams are dropped by their clients (the connection closes, queued or
    mid-stream); the proxy's engine ends up with no sequence, queued request or KV byte, and the
    other 50 give exactly what each gives alone."""
    url, key, log = proxy_url
    client = openai.AsyncOpenAI(base_url=url, api_key=key, timeout=REQUEST_S, max_retries=0)
    mid_stream = asyncio.Event()

    async def ask(question: str, max_tokens: int, **extra) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="smollm2", messages=[SYSTEM, {"role": "user", "content": question}], temperature=0,
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **extra)
        async with stream:  # leaving it, by a cancelled task too, closes the connection
            text, usage = "", None
            async for chunk in stream:
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                usage = chunk.usage or usage
                if max_tokens == DROPPED_TOKENS and text:
                    mid_stream.set()
        return text, usage.completion_tokens

    alone = [await ask(q, KEPT_TOKENS) for q in QUESTIONS]
    await wait_for(lambda: (s := engine_stats(log)) and s["active"] == s["queued"] == 0, "the engine idle")
    before = engine_stats(log)

    kept_args = {"max_tokens": KEPT_TOKENS}
    dropped_args = {"max_tokens": DROPPED_TOKENS, "extra_body": {"ignore_eos": True}}
    tasks = [asyncio.create_task(ask(QUESTIONS[i % len(QUESTIONS)], **(dropped_args if i % 2 else kept_args)))
             for i in range(IN_FLIGHT)]
    await wait_for(lambda: requests_seen(engine_stats(log)) == requests_seen(before) + IN_FLIGHT,
                   "all requests in the engine")
    await asyncio.wait_for(mid_stream.wait(), REQUEST_S)
    for task in tasks[1::2]:
        task.cancel()
    kept = await asyncio.gather(*tasks[0::2])
    assert kept == [alone[i % len(QUESTIONS)] for i in range(0, IN_FLIGHT, 2)]

    # The line of the last of the 100 to end shows what is left: nothing.
    await wait_for(lambda: requests_ended(engine_stats(log)) == requests_ended(before) + IN_FLIGHT,
                   "all requests ended")
    half = IN_FLIGHT // 2
    assert engine_stats(log) == {**before, "finished": before["finished"] + half,
                                 "cancelled": before["cancelled"] + half}
    assert (before["active"], before["queued"], before["kv_tokens"], before["kv_bytes"],
            before["kv_blocks_used"], before["failed"], before["timed_out"]) == (0, 0, 0, 0, 0, 0, 0)
