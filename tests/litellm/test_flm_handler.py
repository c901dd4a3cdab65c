"""The handler through litellm's public API, against the scripted FakeEngine (no model loaded).

These test the translation layer only: what litellm hands the handler, and what the caller gets
back from litellm. The real model runs in test_flm_e2e.py.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import replace

import litellm
import numpy as np
import pytest

import litellm_flm
from flm_runtime import errors as rt
from flm_fake_engine import FakeTokenizer
from litellm_flm.llm import FlmLLM, StreamChunks, usage_fields
from stream_choices import joined_choices
from flm_runtime.request import Completion, ProposerCounts, RequestStats, SpecStats, StreamEvent, TokenLogprob
from flm_runtime.sampling.sampler import choice_seed

MODEL = "flm/smollm2:135m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_astreaming_is_an_async_generator():
    assert inspect.isasyncgenfunction(FlmLLM.astreaming)


def test_completion(fake_engine):
    r = litellm.completion(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=100)
    assert fake_engine.requested_tags == ["smollm2:135m"]  # litellm strips the provider prefix
    assert r.choices[0].message.content == fake_engine.reply
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    prompt_ids, params, _ = fake_engine.submitted[0]
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(fake_engine.reply)
    assert r.usage.total_tokens == len(prompt_ids) + len(fake_engine.reply)
    assert r.model == MODEL  # as LiteLLM's own local providers name it (ollama/<model>)
    assert params.temperature == 0.0 and params.max_tokens == 100


def test_prompt_is_the_chat_template_of_the_messages(fake_engine):
    litellm.completion(model=MODEL, messages=[{"role": "system", "content": "S"}, *MESSAGES], max_tokens=5)
    rendered = fake_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, MESSAGES[0]], add_generation_prompt=True
    )
    assert fake_engine.submitted[0][0] == fake_engine.tokenizer.encode(rendered)


def test_max_tokens_gives_length(fake_engine):
    r = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content == fake_engine.reply[:5]


def test_extra_body_and_top_k_reach_the_engine(fake_engine):
    litellm.completion(model=MODEL, messages=MESSAGES, top_k=7, extra_body={"min_p": 0.05, "seed": 11})
    params = fake_engine.submitted[0][1]
    assert (params.top_k, params.min_p, params.seed) == (7, 0.05, 11)


def test_timeout_reaches_the_engine(fake_engine):
    litellm.completion(model=MODEL, messages=MESSAGES, timeout=3)
    litellm.completion(model=MODEL, messages=MESSAGES)
    assert [t for _, _, t in fake_engine.submitted] == [3.0, 600.0]  # litellm's default is 600 s


def test_engine_timeout_is_litellm_timeout(fake_engine):
    fake_engine.stream_error = rt.RequestTimeoutError("deadline of 3.0 s passed")
    with pytest.raises(litellm.Timeout) as info:
        litellm.completion(model=MODEL, messages=MESSAGES, timeout=3)
    assert isinstance(info.value.__cause__, rt.RequestTimeoutError)


def test_context_overflow(fake_engine):
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=MODEL, messages=[{"role": "user", "content": "x" * 300}])


@pytest.mark.parametrize("stream", [False, True])
def test_bad_param_is_bad_request_at_call_time(fake_engine, stream):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=MODEL, messages=MESSAGES, presence_penalty="high", stream=stream)
    assert "presence_penalty" in str(info.value)
    assert fake_engine.requested_tags == []  # refused before the model is even looked up


@pytest.mark.parametrize("messages, param, message", [
    ([{"content": "Hi"}], "messages[0].role",
     "messages[0].role is missing; give one of ['assistant', 'developer', 'system', 'tool', 'user']"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}], "messages[1].content",
     "messages[1].content is missing; a user message needs it"),
    ([{"role": "user", "content": None}], "messages[0].content",
     "messages[0].content is missing; a user message needs it"),
])
@pytest.mark.parametrize("call", ["completion", "acompletion", "stream", "astream"])
async def test_a_message_without_role_or_content_is_a_bad_request_naming_it(fake_engine, messages, param, message,
                                                                           call):
    """LiteLLM gives a message without a role the role "assistant" before the handler sees it:
    refused all the same, as OpenAI does, and nothing runs."""
    with pytest.raises(litellm.BadRequestError) as info:
        if call == "astream":  # an async stream raises at its first chunk
            [_ async for _ in await litellm.acompletion(model=MODEL, messages=messages, stream=True)]
        elif call == "acompletion":
            await litellm.acompletion(model=MODEL, messages=messages)
        else:
            litellm.completion(model=MODEL, messages=messages, stream=call == "stream")
    assert (info.value.body["param"], info.value.body["message"]) == (param, message)
    assert fake_engine.submitted == []


def test_overloaded_engine_is_rate_limit(fake_engine):
    fake_engine.submit_error = rt.EngineOverloadedError("queue full")
    with pytest.raises(litellm.RateLimitError):
        litellm.completion(model=MODEL, messages=MESSAGES)


def test_stream_chunks():
    chunks = StreamChunks("smollm2:135m", None)
    [first] = chunks(0, StreamEvent("Pa", (1, 2), None, 10, 2))
    assert (first.choices[0].delta.role, first.choices[0].delta.content, first.choices[0].finish_reason) == (
        "assistant", "Pa", None)
    assert first.model == MODEL
    [mid] = chunks(0, StreamEvent("ri", (3,), None, 10, 3))
    assert (mid.choices[0].delta.role, mid.choices[0].delta.content, mid.id) == (None, "ri", first.id)
    # The last event: its delta with the usage (none here), then the finish_reason alone.
    last, finish = chunks(0, StreamEvent("", (), "length", 10, 5))
    assert (last.choices[0].delta.content, last.choices[0].finish_reason) == (None, None)
    assert last.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert (finish.choices[0].delta.content, finish.choices[0].finish_reason, finish.id) == (None, "length", first.id)
    assert chunks.finished


def test_choice_zero_finishes_the_stream_after_the_others():
    """LiteLLM ends the stream at the first finish_reason: choice 0's finish waits for the others,
    which finish with a ``sibling_finish_reason`` chunk; the usage counts the prompt once."""
    chunks = StreamChunks("smollm2:135m", None, n=3, total=3)
    [zero] = chunks(0, StreamEvent("ab", (1,), "stop", 10, 1))  # its text now, its finish last
    assert (zero.choices[0].index, zero.choices[0].delta.content, zero.choices[0].finish_reason) == (0, "ab", None)
    text, sibling = chunks(1, StreamEvent("c", (2,), "length", 10, 4))
    assert (text.choices[0].index, text.choices[0].delta.role, text.choices[0].delta.content) == (1, "assistant", "c")
    assert sibling == {"text": "", "is_finished": False, "finish_reason": "", "index": 1, "tool_use": None,
                       "usage": None, "choice_index": 1, "sibling_finish_reason": "length"}
    assert not chunks.finished
    sibling, usage, finish = chunks(2, StreamEvent("", (), "stop", 10, 2))
    assert (sibling["choice_index"], sibling["sibling_finish_reason"]) == (2, "stop")
    assert (usage.choices[0].index, usage.choices[0].delta.content) == (0, None)
    assert usage.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 10, "completion_tokens": 1 + 4 + 2, "total_tokens": 17}
    assert (finish.choices[0].index, finish.choices[0].finish_reason) == (0, "stop") and chunks.finished


def test_stream_chunks_carry_their_tokens_logprobs():
    """Each chunk carries the entries of the tokens whose text it sends; a token with no text (a
    special token) gets a chunk of its own; -inf becomes vLLM's floor, -9999.0."""
    chunks = StreamChunks("smollm2:135m", None, token_bytes=FakeTokenizer().token_bytes)
    pa = (TokenLogprob(ord("P"), -0.5, ((ord("P"), -0.5), (ord("Q"), -np.inf))), TokenLogprob(ord("a"), -0.25))
    [first] = chunks(0, StreamEvent("Pa", (ord("P"), ord("a")), None, 10, 2, logprobs=pa))
    assert [e.model_dump() for e in first.choices[0].logprobs.content] == [
        {"token": "P", "logprob": -0.5, "bytes": [80],
         "top_logprobs": [{"token": "P", "logprob": -0.5, "bytes": [80]},
                          {"token": "Q", "logprob": -9999.0, "bytes": [81]}]},
        {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []}]
    [special] = chunks(0, StreamEvent("", (258,), None, 10, 3, logprobs=(TokenLogprob(258, -1.0),)))
    assert special.choices[0].delta.content is None
    assert [(e.token, e.bytes) for e in special.choices[0].logprobs.content] == [(chr(258), list(chr(258).encode()))]
    last, finish = chunks(0, StreamEvent("", (), "stop", 10, 3, logprobs=()))
    assert last.choices[0].logprobs is None and finish.choices[0].logprobs is None


def test_a_choice_that_ends_on_a_token_without_text_sends_its_entry_under_its_index():
    """Two choices, each ending on a special token (no text): choice 1's entry comes on a chunk of
    its own before its sibling finish; choice 0's on the chunk with the usage, before its finish."""
    chunks = StreamChunks("smollm2:135m", None, n=2, total=2, token_bytes=FakeTokenizer().token_bytes)
    one, sibling = chunks(1, StreamEvent("", (258,), "stop", 10, 1, logprobs=(TokenLogprob(258, -1.0),)))
    assert (one.choices[0].index, one.choices[0].delta.content) == (1, None)
    assert [(e.token, e.logprob) for e in one.choices[0].logprobs.content] == [(chr(258), -1.0)]
    assert (sibling["choice_index"], sibling["sibling_finish_reason"]) == (1, "stop")
    zero, finish = chunks(0, StreamEvent("", (259,), "stop", 10, 1, logprobs=(TokenLogprob(259, -2.0),)))
    assert (zero.choices[0].index, zero.usage.completion_tokens) == (0, 2)
    assert [(e.token, e.logprob) for e in zero.choices[0].logprobs.content] == [(chr(259), -2.0)]
    assert (finish.choices[0].index, finish.choices[0].finish_reason, finish.choices[0].logprobs) == (0, "stop", None)


def test_stream(fake_engine):
    chunks = list(
        litellm.completion(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=12, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == fake_engine.reply[:12]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(fake_engine.submitted[0][0]), 12)



@pytest.mark.parametrize("n", [1, 2])
def test_stream_chunk_builder_rebuilds_the_non_streamed_response_quietly(fake_engine, capsys, n):
    """Every chunk names the model as the response does, ``flm/<tag>`` (LiteLLM's own final
    chunks included), so ``stream_chunk_builder`` finds its provider and price without printing
    LiteLLM's "Provider List" banner."""
    full = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=12, n=n)
    chunks = list(litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=12, n=n, stream=True))
    capsys.readouterr()
    built = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert capsys.readouterr().out == ""
    assert {c.model for c in chunks} == {built.model} == {full.model} == {MODEL}
    assert [c.message.content for c in built.choices] == [c.message.content for c in full.choices] == \
        [fake_engine.reply[:12]] * n
    assert built._hidden_params["response_cost"] == 0.0

SPEC_STATS = RequestStats(prompt_tokens=9, completion_tokens=12, generated_tokens=13, queue_s=0.0, ttft_s=0.1,
                          decode_s=1.2, total_s=1.3,
                          spec=SpecStats(proposers={
                              "draft": ProposerCounts(3, 21, 4, 7, 2, 1), "ngram": ProposerCounts(1, 7, 5, 6),
                              "grammar": ProposerCounts(1, 3, 3, 4, 3, 3)}))
# A request that gave a predicted output: its proposer's counts beside the others'.
PREDICTED_STATS = replace(SPEC_STATS, spec=SpecStats(proposers={
    **SPEC_STATS.spec.proposers, "prediction": ProposerCounts(2, 14, 9, 11)}))


def test_flm_stats_keys():
    """The public keys of ``_hidden_params["flm_stats"]``, with and without speculation."""
    plain = {"prompt_tokens": 9, "cached_tokens": 0, "completion_tokens": 12, "generated_tokens": 13, "queue_s": 0.0,
             "ttft_s": 0.1, "max_gap_s": 0.0, "decode_tokens_per_s": 10.0, "total_s": 1.3}
    assert replace(SPEC_STATS, spec=None).as_dict() == plain
    assert SPEC_STATS.as_dict() == {**plain, "spec_steps": 5, "drafted_tokens": 31, "accepted_tokens": 12,
                                    "acceptance_length": 3.4, "gated_steps": 0, "spec_switches_off": 0,
                                    "al_estimate": None, "forced_tokens": 5, "forced_accepted_tokens": 4,
                                    "draft_acceptance_length": 7 / 3, "prediction_steps": 0,
                                    "prediction_drafted_tokens": 0, "prediction_accepted_tokens": 0,
                                    "prediction_acceptance_length": None, "ngram_steps": 1,
                                    "ngram_drafted_tokens": 7, "ngram_accepted_tokens": 5,
                                    "ngram_acceptance_length": 6.0, "suffix_steps": 0, "suffix_drafted_tokens": 0,
                                    "suffix_accepted_tokens": 0, "suffix_acceptance_length": None,
                                    "grammar_steps": 1, "grammar_drafted_tokens": 3, "grammar_accepted_tokens": 3,
                                    "grammar_acceptance_length": 4.0}


def test_cached_prompt_tokens_reach_the_usage():
    """Prompt tokens from the prefix cache are OpenAI's ``prompt_tokens_details.cached_tokens``,
    counted once per prompt however many choices share it; absent when there are none."""
    def done(cached):
        return Completion("hi", (5, 6), "stop", 9, 2, replace(SPEC_STATS, spec=None, cached_tokens=cached))

    usage = usage_fields([[done(7), done(7)], [done(0)]])
    assert usage == {"prompt_tokens": 18, "completion_tokens": 6, "total_tokens": 24,
                     "prompt_tokens_details": {"cached_tokens": 7}}
    assert "prompt_tokens_details" not in usage_fields([[done(0)]])


def test_a_predicted_outputs_figures_reach_the_usage(fake_engine):
    """A speculative engine's stats: all in _hidden_params["flm_stats"]; the predicted output's
    tokens kept and rejected in usage.completion_tokens_details, OpenAI's fields (completion_tokens
    stays the tokens delivered); the other proposers' are not predicted outputs."""
    fake_engine.stats = PREDICTED_STATS
    r = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert r._hidden_params["flm_stats"] == PREDICTED_STATS.as_dict()
    details = r.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (9, 5)
    assert r.usage.completion_tokens == 12
    chunks = list(litellm.completion(model=MODEL, messages=MESSAGES, stream=True, max_tokens=12,
                                     stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 12
    assert usage.completion_tokens_details.accepted_prediction_tokens == 9
    assert usage.completion_tokens_details.rejected_prediction_tokens == 5


def test_without_a_predicted_output_every_proposers_tokens_reach_the_usage(fake_engine):
    """Speculating without a prediction: the proposers' tokens kept and rejected, all together."""
    fake_engine.stats = SPEC_STATS
    details = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=12).usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (12, 19)


def test_plain_engine_usage_has_no_prediction_details(fake_engine):
    r = litellm.completion(model=MODEL, messages=MESSAGES, max_tokens=12)
    details = r.usage.completion_tokens_details
    assert details is None or details.accepted_prediction_tokens is None


def test_closing_a_stream_early_cancels_the_request(fake_engine):
    stream = litellm.completion(model=MODEL, messages=MESSAGES, stream=True)
    next(iter(stream))
    stream.completion_stream.close()
    assert fake_engine.handles[0].cancelled


def test_a_stream_dropped_before_its_first_chunk_cancels_the_request(fake_engine):
    stream = litellm.completion(model=MODEL, messages=MESSAGES, stream=True, n=2)
    assert not any(h.cancelled for h in fake_engine.handles)
    del stream  # never iterated: its generator's finally never runs, the finalizer does
    assert [h.cancelled for h in fake_engine.handles] == [True, True]


# ---- n choices: per prompt n engine requests, usage counting each prompt once ----

def test_n_choices(fake_engine):
    r = litellm.completion(model=MODEL, messages=MESSAGES, n=3, seed=4, max_tokens=100)
    prompt_ids = fake_engine.submitted[0][0]
    assert [(ids, p.seed) for ids, p, _ in fake_engine.submitted] == [
        (prompt_ids, 4), (prompt_ids, choice_seed(4, 1)), (prompt_ids, choice_seed(4, 2))]
    assert [(c.index, c.message.content) for c in r.choices] == [(i, fake_engine.reply) for i in range(3)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 3 * len(fake_engine.reply))
    assert len(r._hidden_params["flm_stats"]) == 3


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_n_choices_stream_each_under_its_index(fake_engine, asynchronous):
    fake_engine.seeded_replies = {4: "abcdef", choice_seed(4, 1): "xy", choice_seed(4, 2): "12345678"}
    kw = dict(model=MODEL, messages=MESSAGES, n=3, seed=4, max_tokens=7, stream=True,
              stream_options={"include_usage": True})
    if asynchronous:
        chunks = [c async for c in await litellm.acompletion(**kw)]
    else:
        chunks = list(litellm.completion(**kw))
    texts, finishes = joined_choices(chunks)
    assert texts == {0: "abcdef", 1: "xy", 2: "1234567"} and finishes == {0: "stop", 1: "stop", 2: "length"}
    n_prompt = len(fake_engine.submitted[0][0])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (n_prompt, 6 + 2 + 7)


async def test_acompletion_runs_blocking_work_off_the_event_loop(fake_engine):
    r = await litellm.acompletion(model=MODEL, messages=MESSAGES, temperature=0)
    assert r.choices[0].message.content == fake_engine.reply
    assert r.usage.completion_tokens == len(fake_engine.reply)
    assert threading.get_ident() not in fake_engine.tokenizer.encode_threads


async def test_astream_equals_acompletion(fake_engine):
    full = await litellm.acompletion(model=MODEL, messages=MESSAGES, temperature=0)
    stream = await litellm.acompletion(
        model=MODEL, messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert threading.get_ident() not in fake_engine.tokenizer.encode_threads


async def test_astream_errors_are_mapped(fake_engine):
    fake_engine.stream_error = rt.RequestTimeoutError("deadline passed")
    stream = await litellm.acompletion(model=MODEL, messages=MESSAGES, stream=True, timeout=1)
    with pytest.raises(litellm.Timeout):
        async for _ in stream:
            pass


async def test_astream_context_overflow(fake_engine):
    with pytest.raises(litellm.ContextWindowExceededError):
        stream = await litellm.acompletion(model=MODEL, messages=[{"role": "user", "content": "x" * 300}], stream=True)
        async for _ in stream:
            pass


async def test_cancelled_acompletion_cancels_the_request(fake_engine, monkeypatch):
    started = asyncio.Event()
    handles = []

    class SlowHandle:
        cancelled = False

        async def aresult(self):
            started.set()
            await asyncio.sleep(60)

        def cancel(self):
            self.cancelled = True

    def submit(prompt_ids, params, **kw):
        handles.append(SlowHandle())
        return handles[-1]

    monkeypatch.setattr(fake_engine, "submit", submit)
    task = asyncio.create_task(litellm.acompletion(model=MODEL, messages=MESSAGES))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handles[0].cancelled


def test_handler_instance_is_registered():
    entries = [e for e in litellm.custom_provider_map if e["provider"] == "flm"]
    assert entries == [{"provider": "flm", "custom_handler": litellm_flm.handler}]


# ---- text completions: the raw prompt, one choice per prompt ----

def test_text_completion_continues_the_raw_prompt(fake_engine):
    r = litellm.text_completion(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert fake_engine.submitted[0][0] == fake_engine.tokenizer.encode("Once upon a time")  # no chat template
    assert r.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, fake_engine.reply[:8], "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len("Once upon a time"), 8)


def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order_with_usage_summed(fake_engine):
    fake_engine.reply_to = lambda prompt: f"<{prompt.upper()}>"
    prompts = ["ab", "cde", "f"]
    r = litellm.text_completion(model=MODEL, prompt=prompts, max_tokens=20, seed=5)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [
        (i, f"<{p.upper()}>", "stop") for i, p in enumerate(prompts)]
    assert [ids for ids, _, _ in fake_engine.submitted] == [fake_engine.tokenizer.encode(p) for p in prompts]
    assert {p.seed for _, p, _ in fake_engine.submitted} == {5}
    assert r.usage.prompt_tokens == 2 + 3 + 1
    assert r.usage.completion_tokens == r.usage.total_tokens - r.usage.prompt_tokens == 4 + 5 + 3
    assert [s["prompt_tokens"] for s in r._hidden_params["flm_stats"]] == [2, 3, 1]


def test_prediction_details_are_summed_over_prompts(fake_engine):
    fake_engine.stats = PREDICTED_STATS
    r = litellm.text_completion(model=MODEL, prompt=["ab", "cd"], max_tokens=20)
    details = r.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (2 * 9, 2 * 5)


async def test_atext_completion_of_a_list(fake_engine):
    fake_engine.reply_to = lambda prompt: prompt[::-1]
    r = await litellm.atext_completion(model=MODEL, prompt=["abc", "xy"], max_tokens=20)
    assert [c.text for c in r.choices] == ["cba", "yx"]
    assert r.usage.prompt_tokens == 5


def test_text_completion_streams_one_prompt(fake_engine):
    """Every chunk's text is a string, "" on the last one (OpenAI's), so the texts join as they are."""
    chunks = list(litellm.text_completion(model=MODEL, prompt="Once", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == fake_engine.reply[:6]
    assert (chunks[-1].choices[0].text, chunks[-1].choices[0].finish_reason) == ("", "length")
    assert fake_engine.submitted[0][0] == fake_engine.tokenizer.encode("Once")


async def test_atext_completion_streams_one_prompt(fake_engine):
    stream = await litellm.atext_completion(model=MODEL, prompt="Once", max_tokens=6, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == fake_engine.reply[:6]
    assert (chunks[-1].choices[0].text, chunks[-1].choices[0].finish_reason) == ("", "length")


@pytest.mark.parametrize("prompt, stream, name", [
    ("", False, "prompt"),
    (["a", ""], False, "prompt[1]"),
])
def test_bad_text_prompts_are_named(fake_engine, prompt, stream, name):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.text_completion(model=MODEL, prompt=prompt, max_tokens=4, stream=stream)
    assert info.value.body["param"] == name
    assert fake_engine.submitted == []


def test_a_text_stream_of_prompts_and_choices_numbers_them_in_order(fake_engine):
    """Per prompt its n choices, as OpenAI numbers them: index = prompt * n + choice."""
    fake_engine.reply_to = lambda prompt: prompt.upper()
    chunks = list(litellm.text_completion(model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=20, stream=True))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "AB", 1: "AB", 2: "CDE", 3: "CDE"}
    r = litellm.text_completion(model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=20)
    assert [(c.index, c.text) for c in r.choices] == [(0, "AB"), (1, "AB"), (2, "CDE"), (3, "CDE")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2 + 3, 2 * 2 + 2 * 3)


def test_one_prompt_over_the_context_runs_none_of_them(fake_engine):
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.text_completion(model=MODEL, prompt=["short", "x" * 300], max_tokens=4)
    assert [h.cancelled for h in fake_engine.handles] == [True]
