"""``FlmLLM``: the LiteLLM ``CustomLLM`` that runs ``flm/<tag>`` models on ``flm_runtime``.

A request travels (docs/design.md, "The way a request travels"): LiteLLM strips the ``flm/`` prefix
and calls one of the four methods below with ``optional_params``; ``params`` validates them into
``SamplingParams`` and the messages into template input; the engine of the tag renders the model's
own chat template, counts the prompt tokens and queues the request (or raises ``ContextLengthError``
/ ``KVBudgetError`` / ``EngineOverloadedError``); its events become a ``ModelResponse`` or
``GenericStreamingChunk``s here. Nothing deeper: sampling, stop strings, UTF-8-safe detokenizing and
token counting are the engine's.

Blocking work (loading a model, tokenizing, waiting for tokens) never runs on the event loop: the
async methods hand it to a worker thread or to the engine's own async iterator.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import litellm
from litellm import CustomLLM
from litellm.types.utils import (ChatCompletionMessageToolCall, ChatCompletionTokenLogprob, ChoiceLogprobs, Choices,
                                 EmbeddingResponse, Function, GenericStreamingChunk, Message, ModelResponse,
                                 TopLogprob, Usage)

from flm_runtime.engine.grammar import compiler_for
from flm_runtime.engine.request import Completion, RequestStats, StreamEvent, TokenLogprob
from flm_runtime.tool_format import ToolCall, ToolCallStream, parse_tool_calls, render_messages

from .errors import litellm_errors
from .params import (backend_of, embedding_inputs, encoding_format, merge_extra_body, normalize_messages,
                     raw_prompts, request_fields)
from .structured import OutputFormat, output_format


def _get_engine(tag: str, backend: str | None = None):
    """The process-wide engine of ``tag`` on ``backend`` (auto / cpu / npu; None: ``$FLM_BACKEND``),
    loaded, and pulled if need be, on first use.

    Imported lazily so that ``import litellm_flm`` (what the proxy does at startup) stays cheap;
    tests replace this function with a fake engine.
    """
    from flm_runtime.api import get_engine

    return get_engine(tag, backend)


def _timeout_seconds(timeout: float | httpx.Timeout | None) -> float | None:
    """LiteLLM's ``timeout`` (seconds, 600 by default, or an httpx.Timeout) -> the engine's deadline.

    LiteLLM does not enforce timeouts for custom handlers: the engine does. Of an httpx.Timeout
    only ``read`` (time without new data) has a local meaning.
    """
    if isinstance(timeout, httpx.Timeout):
        return timeout.read
    return None if timeout is None else float(timeout)


def _drops_unsupported(litellm_params: dict | None) -> bool:
    """Whether the caller asked for ``drop_params`` (``litellm.drop_params``, the proxy's
    ``litellm_settings``, or the request's or deployment's ``drop_params``, which LiteLLM has
    already turned into a bool in ``litellm_params``)."""
    return litellm.drop_params is True or (litellm_params or {}).get("drop_params") is True


def _start(model: str, messages: list, optional_params: dict, timeout: Any, litellm_params: dict | None, *,
           stream: bool = False) -> tuple[Callable[[int], bytes], list, OutputFormat]:
    """Validate, render, tokenize and submit a request (blocking: may load the model).

    ``litellm_params["drop_params"]``: leave out the OpenAI parameters we do not support
    (``request_fields``). A text completion (``litellm_params["text_completion"]``; LiteLLM makes each prompt a user
    message) continues each prompt's raw text, with no chat template: one engine request per
    prompt, all submitted before any is awaited, so the engine batches them. A chat's tools and
    tool messages are rendered in the generic tool-call format (``flm_runtime.tool_format``); a
    response format or tool choice becomes a grammar, compiled for each engine request
    (``flm_runtime.engine.grammar``).

    Returns:
        The model's ``token_bytes`` (id -> the token's bytes: for logprobs), the engine's
        RequestHandles, one per prompt (one for a chat), and the request's ``OutputFormat`` (how
        to read its answers).

    Raises:
        flm_runtime.errors.FlmError: the caller maps it with ``litellm_errors``.
    """
    fields = request_fields(optional_params, _drops_unsupported(litellm_params))  # before loading: fail fast
    output = output_format(merge_extra_body(optional_params))
    raw = (litellm_params or {}).get("text_completion") is True
    prompts = raw_prompts(messages, stream=stream) if raw else None
    chat = None if raw else render_messages(normalize_messages(messages), output.functions)
    engine = _get_engine(model, backend_of(optional_params))
    params = engine.sampling_params(**fields)  # the model's default sampler fills unset fields
    texts = prompts if raw else [engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True)]
    compiler = compiler_for(engine.tokenizer) if output.grammar is not None else None
    handles = []
    try:
        for text in texts:
            processors = [compiler.processor(output.grammar, param=output.param)] if compiler else []
            handles.append(engine.submit(engine.tokenizer.encode(text), params, timeout=_timeout_seconds(timeout),
                                         processors=processors))
    except BaseException:  # one prompt refused (too long, queue full, a grammar that fails): none of them runs
        _cancel(handles)
        raise
    return engine.tokenizer.token_bytes, handles, output


def _cancel(handles: list) -> None:
    for handle in handles:
        handle.cancel()


def build_response(model_response: ModelResponse, model: str, dones: list[Completion],
                   token_bytes: Callable[[int], bytes], reads_tool_calls: bool = False) -> ModelResponse:
    """Fill LiteLLM's pre-made ``ModelResponse`` from finished requests: choice ``i`` is
    ``dones[i]`` (with its ``logprobs`` when asked for: ``choice_logprobs``), usage their sum.
    With ``reads_tool_calls`` an answer's calls become the message's ``tool_calls`` (``content``
    None) and its ``finish_reason`` ``tool_calls``.

    LiteLLM leaves usage at zero and ``model`` unset for custom handlers; ``model`` is the tag as
    LiteLLM passed it, the same name its stream wrapper puts on streamed chunks.
    ``_hidden_params["flm_stats"]`` is the request's stats (``RequestStats.as_dict``), or with
    several choices a list of them in choice order.
    """
    model_response.choices = [
        Choices(index=i, finish_reason=_finish_reason(done, calls), message=_message(content, calls),
                logprobs=None if done.logprobs is None else choice_logprobs(done.logprobs, token_bytes))
        for i, done in enumerate(dones)
        for content, calls in [parse_tool_calls(done.text) if reads_tool_calls else (done.text, [])]
    ]
    model_response.model = model
    model_response.created = int(time.time())
    setattr(model_response, "usage", Usage(**summed_usage(dones)))  # not a declared field of ModelResponse
    stats = [done.stats.as_dict() for done in dones]
    model_response._hidden_params["flm_stats"] = stats[0] if len(stats) == 1 else stats
    return model_response


def _message(content: str | None, calls: list[ToolCall]) -> Message:
    tool_calls = [ChatCompletionMessageToolCall(id=c.id, type="function", function=Function(name=c.name,
                                                                                            arguments=c.arguments))
                  for c in calls]
    return Message(content=content, role="assistant", tool_calls=tool_calls or None)


def _finish_reason(done: Completion, calls: list[ToolCall]) -> str:
    # A call cut short by max_tokens leaves the calls before it, and finish_reason "length".
    return "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason


# What a log-probability of -inf (a token the request's filters left no probability) becomes in
# JSON, which has no infinity: vLLM's OpenAI server's floor.
LOGPROB_FLOOR = -9999.0


def choice_logprobs(records: tuple[TokenLogprob, ...], token_bytes: Callable[[int], bytes]) -> ChoiceLogprobs:
    """The runtime's ``TokenLogprob``s -> OpenAI's ``choices[i].logprobs``: one ``content`` entry
    per token, ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``. ``token`` is
    the token's UTF-8 text, a byte that is not (part of) valid UTF-8 written ``\\xNN``; ``bytes``
    its exact bytes; ``-inf`` is ``LOGPROB_FLOOR``."""
    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": max(logprob, LOGPROB_FLOOR),
                "bytes": list(raw)}

    return ChoiceLogprobs(content=[
        ChatCompletionTokenLogprob(**entry(r.token_id, r.logprob),
                                   top_logprobs=[TopLogprob(**entry(t, lp)) for t, lp in r.top])
        for r in records
    ])


def summed_usage(dones: list[Completion]) -> dict:
    """``usage_fields`` of each finished request, added up field by field."""
    total: dict = {}
    for done in dones:
        for key, value in usage_fields(done.prompt_tokens, done.completion_tokens, done.stats).items():
            if isinstance(value, dict):
                inner = total.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            else:
                total[key] = total.get(key, 0) + value
    return total


def usage_fields(prompt_tokens: int, completion_tokens: int, stats: RequestStats | None) -> dict:
    """OpenAI usage fields of a finished request.

    With speculative decoding (``stats.spec`` set) ``completion_tokens_details`` says
    how the draft's proposals fared: ``accepted_prediction_tokens`` = drafted tokens the target
    kept, ``rejected_prediction_tokens`` = the other drafted tokens. These are OpenAI's "predicted
    outputs" fields applied to the draft's predictions; unlike OpenAI's, rejected tokens are not
    part of ``completion_tokens`` (always the tokens delivered). The full per-request stats
    (acceptance length and all) are in ``_hidden_params["flm_stats"]``.
    """
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if stats is not None and stats.spec is not None:
        accepted = stats.spec.accepted
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": stats.spec.drafted - accepted}
    return usage


def _embed(model: str, input: Any, optional_params: dict, litellm_params: dict | None) -> tuple[list, int, str]:
    """Validate, tokenize and embed ``input`` (blocking: may load the model, runs the target).

    Returns:
        The vectors (``[B, E]`` float32, unit L2 norm: ``flm_runtime.embedding``), the prompt
        tokens of all texts, and the encoding format asked for.

    Raises:
        flm_runtime.errors.FlmError: the caller maps it with ``litellm_errors``.
    """
    from flm_runtime.embedding import embed  # imports the kernels: not at ``import litellm_flm``

    request = (litellm_params or {}).get("proxy_server_request") or {}
    fmt = encoding_format(optional_params, request.get("body") if isinstance(request, dict) else None)
    texts = embedding_inputs(input)
    engine = _get_engine(model, backend_of(optional_params))
    token_lists = [engine.tokenizer.encode(t) if isinstance(t, str) else t for t in texts]
    return embed(engine.model, token_lists), sum(len(ids) for ids in token_lists), fmt


def build_embedding_response(model_response: EmbeddingResponse, model: str, vectors, prompt_tokens: int,
                             fmt: str) -> EmbeddingResponse:
    """Fill LiteLLM's pre-made ``EmbeddingResponse``: item ``i`` is ``vectors[i]`` as a list of
    floats, or for ``fmt`` ``base64`` its little-endian float32 bytes in base64 (OpenAI's)."""
    def encoded(v):
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else v.tolist()

    model_response.data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    model_response.model = model
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
    setattr(model_response, "usage", usage)  # as on a ModelResponse
    return model_response


def build_chunk(event: StreamEvent, token_bytes: Callable[[int], bytes]) -> GenericStreamingChunk:
    """One engine event -> one LiteLLM chunk; the final one (finish_reason set) carries the usage.

    The logprobs of the event's tokens, when asked for, go under ``chunk_choice_fields``: a
    ``GenericStreamingChunk`` has no logprobs field, and LiteLLM's stream wrapper (1.110.2) sets
    each key of that mapping on the chunk's choice, as it does for an OpenAI-compatible
    provider's chunks; a chunk with logprobs but no text (a special token) is still sent.
    """
    finished = event.finish_reason is not None
    usage = None
    if finished:
        usage = usage_fields(event.prompt_tokens, event.completion_tokens, event.stats)
    chunk = GenericStreamingChunk(
        text=event.text,
        is_finished=finished,
        finish_reason=event.finish_reason or "",
        index=0,
        tool_use=None,
        usage=usage,
    )
    if event.logprobs:
        chunk["chunk_choice_fields"] = {"logprobs": choice_logprobs(event.logprobs, token_bytes)}
    return chunk


class ChunkMaker:
    """One streamed request's events -> LiteLLM chunks (``chunks``).

    Plain: one ``build_chunk`` per event. With ``reads_tool_calls`` the answer goes through a
    ``ToolCallStream``: its content as content, and each call, once complete, as a chunk of its
    own whose ``tool_use`` carries its index, id, name and arguments (OpenAI's tool-call delta);
    the final chunk says ``tool_calls`` when the answer made calls and ended on its own.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], reads_tool_calls: bool):
        self._token_bytes = token_bytes
        self._reader = ToolCallStream() if reads_tool_calls else None
        self._calls = 0

    def chunks(self, event: StreamEvent) -> list[GenericStreamingChunk]:
        chunk = build_chunk(event, self._token_bytes)
        if self._reader is None:
            return [chunk]
        content, calls = self._reader.feed(event.text)
        if event.finish_reason is not None:
            content += self._reader.finish()
        out = [_call_chunk(call, self._calls + k) for k, call in enumerate(calls)]
        self._calls += len(calls)
        chunk["text"] = content
        if self._calls and event.finish_reason == "stop":
            chunk["finish_reason"] = "tool_calls"
        if content or event.finish_reason is not None or "chunk_choice_fields" in chunk:
            out.append(chunk)
        return out


def _call_chunk(call: ToolCall, index: int) -> GenericStreamingChunk:
    return GenericStreamingChunk(
        text="", is_finished=False, finish_reason="", index=0, usage=None,
        tool_use={"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments},
                  "index": index})


class FlmLLM(CustomLLM):
    """LiteLLM entry points. ``model`` is the tag with the ``flm/`` prefix already stripped.

    The signatures take what LiteLLM passes by keyword and ignore the rest (api_base, api_key,
    headers, client, ...: a local engine has no use for them); of ``litellm_params`` only
    ``drop_params``, ``text_completion`` and (for embeddings) ``proxy_server_request`` are read.
    """

    def completion(
        self, model: str, messages: list, model_response: ModelResponse, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> ModelResponse:
        with litellm_errors(model):
            token_bytes, handles, output = _start(model, messages, optional_params, timeout, litellm_params)
            try:
                dones = [handle.result() for handle in handles]
            except BaseException:  # KeyboardInterrupt, or an engine error: free the sequences
                _cancel(handles)
                raise
        return build_response(model_response, model, dones, token_bytes, output.reads_tool_calls)

    async def acompletion(
        self, model: str, messages: list, model_response: ModelResponse, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> ModelResponse:
        with litellm_errors(model):
            token_bytes, handles, output = await asyncio.to_thread(_start, model, messages, optional_params, timeout,
                                                                   litellm_params)
            try:
                dones = list(await asyncio.gather(*(handle.aresult() for handle in handles)))
            except BaseException:  # CancelledError: the client went away
                _cancel(handles)
                raise
        return build_response(model_response, model, dones, token_bytes, output.reads_tool_calls)

    def streaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> Iterator[GenericStreamingChunk]:
        # A plain function returning a generator: a bad request or a full context raises here, at
        # call time, not at the first next().
        with litellm_errors(model):
            token_bytes, [handle], output = _start(model, messages, optional_params, timeout, litellm_params,
                                                   stream=True)
        return self._stream(model, handle, ChunkMaker(token_bytes, output.reads_tool_calls))

    @staticmethod
    def _stream(model: str, handle, maker: ChunkMaker) -> Iterator[GenericStreamingChunk]:
        finished = False
        try:
            with litellm_errors(model):
                for event in handle:
                    finished = event.finish_reason is not None
                    yield from maker.chunks(event)
        finally:
            if not finished:  # the caller stopped reading, or an error: free the sequence now
                handle.cancel()

    async def astreaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> AsyncIterator[GenericStreamingChunk]:
        # Must be an async generator (docs/design.md, "LiteLLM facts"): litellm iterates the
        # object it gets back.
        finished = False
        handle = None
        try:
            with litellm_errors(model):
                token_bytes, [handle], output = await asyncio.to_thread(_start, model, messages, optional_params,
                                                                        timeout, litellm_params, stream=True)
                maker = ChunkMaker(token_bytes, output.reads_tool_calls)
                async for event in handle.aiter():
                    finished = event.finish_reason is not None
                    for chunk in maker.chunks(event):
                        yield chunk
        finally:
            if handle is not None and not finished:
                handle.cancel()

    def embedding(
        self, model: str, input: list, model_response: EmbeddingResponse, optional_params: dict,
        litellm_params=None, **_: Any
    ) -> EmbeddingResponse:
        with litellm_errors(model):
            result = _embed(model, input, optional_params, litellm_params)
        return build_embedding_response(model_response, model, *result)

    async def aembedding(
        self, model: str, input: list, model_response: EmbeddingResponse, optional_params: dict,
        litellm_params=None, **_: Any
    ) -> EmbeddingResponse:
        with litellm_errors(model):
            result = await asyncio.to_thread(_embed, model, input, optional_params, litellm_params)
        return build_embedding_response(model_response, model, *result)
