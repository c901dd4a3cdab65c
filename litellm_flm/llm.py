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
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import litellm
from litellm import CustomLLM
from litellm.types.utils import Choices, EmbeddingResponse, GenericStreamingChunk, Message, ModelResponse, Usage

from flm_runtime.engine.request import Completion, StreamEvent

from .errors import litellm_errors
from .params import (backend_of, choices_of, embedding_inputs, encoding_format, normalize_messages, raw_prompts,
                     request_fields)


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


def _start(model: str, messages: list, optional_params: dict, timeout: Any,
           litellm_params: dict | None) -> list[list]:
    """Validate, render, tokenize and submit a request (blocking: may load the model).

    ``litellm_params["drop_params"]``: leave out the OpenAI parameters we do not support
    (``request_fields``). A text completion (``litellm_params["text_completion"]``; LiteLLM makes each prompt a user
    message) continues each prompt's raw text, with no chat template: one engine request per
    prompt, all submitted before any is awaited, so the engine batches them. ``n`` > 1: each
    prompt's request has ``n`` choices (``Engine.submit_choices``: one prefill).

    Returns:
        The engine's RequestHandles, per prompt (one for a chat) its ``n`` choices.

    Raises:
        flm_runtime.errors.FlmError: the caller maps it with ``litellm_errors``.
    """
    fields = request_fields(optional_params, _drops_unsupported(litellm_params))  # before loading: fail fast
    n = choices_of(optional_params)
    raw = (litellm_params or {}).get("text_completion") is True
    prompts = raw_prompts(messages) if raw else None
    chat = None if raw else normalize_messages(messages)
    engine = _get_engine(model, backend_of(optional_params))
    params = engine.sampling_params(**fields)  # the model's default sampler fills unset fields
    texts = prompts if raw else [engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True)]
    groups: list[list] = []
    try:
        for text in texts:
            groups.append(engine.submit_choices(engine.tokenizer.encode(text), params, n,
                                                timeout=_timeout_seconds(timeout)))
    except BaseException:  # one prompt refused (too long, queue full): none of them runs
        _cancel(groups)
        raise
    return groups


def _cancel(groups: list[list]) -> None:
    for handles in groups:
        for handle in handles:
            handle.cancel()


def build_response(model_response: ModelResponse, model: str, groups: list[list[Completion]]) -> ModelResponse:
    """Fill LiteLLM's pre-made ``ModelResponse`` from finished requests: per prompt its ``n``
    choices, numbered in that order (OpenAI's for a list of prompts), and ``usage``
    (``usage_fields``).

    LiteLLM leaves usage at zero and ``model`` unset for custom handlers; ``model`` is the tag as
    LiteLLM passed it, the same name its stream wrapper puts on streamed chunks.
    ``_hidden_params["flm_stats"]`` is the request's stats (``RequestStats.as_dict``), or with
    several choices a list of them in choice order.
    """
    dones = [done for group in groups for done in group]
    model_response.choices = [
        Choices(index=i, finish_reason=done.finish_reason, message=Message(content=done.text, role="assistant"))
        for i, done in enumerate(dones)
    ]
    model_response.model = model
    model_response.created = int(time.time())
    setattr(model_response, "usage", Usage(**usage_fields(groups)))  # not a declared field of ModelResponse
    stats = [done.stats.as_dict() for done in dones]
    model_response._hidden_params["flm_stats"] = stats[0] if len(stats) == 1 else stats
    return model_response


def usage_fields(groups: list[list[Completion | StreamEvent]]) -> dict:
    """OpenAI usage fields of finished requests: per prompt, its choices' ``Completion``s or final
    ``StreamEvent``s (same fields). Each prompt counts once, however many choices share it; every
    choice's completion tokens count.

    With speculative decoding (``stats.spec`` set) ``completion_tokens_details`` says
    how the draft's proposals fared: ``accepted_prediction_tokens`` = drafted tokens the target
    kept, ``rejected_prediction_tokens`` = the other drafted tokens. These are OpenAI's "predicted
    outputs" fields applied to the draft's predictions; unlike OpenAI's, rejected tokens are not
    part of ``completion_tokens`` (always the tokens delivered). The full per-request stats
    (acceptance length and all) are in ``_hidden_params["flm_stats"]``.
    """
    dones = [done for group in groups for done in group]
    prompt_tokens = sum(group[0].prompt_tokens for group in groups)
    completion_tokens = sum(done.completion_tokens for done in dones)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    spec = [done.stats.spec for done in dones if done.stats is not None and done.stats.spec is not None]
    if spec:
        accepted = sum(s.accepted for s in spec)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": sum(s.drafted for s in spec) - accepted}
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


def interleave(streams: list[Iterator]) -> Iterator[tuple[int, Any]]:
    """``(i, item)`` of ``streams[i]``, one item of each stream in turn, until all are exhausted
    (the choices of a request decode in the same steps, so their events come in step)."""
    live = list(enumerate(streams))
    while live:
        for entry in list(live):
            item = next(entry[1], _EXHAUSTED)
            if item is _EXHAUSTED:
                live.remove(entry)
            else:
                yield entry[0], item


async def ainterleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """``interleave`` of async iterators."""
    live = list(enumerate(streams))
    while live:
        for entry in list(live):
            item = await anext(entry[1], _EXHAUSTED)
            if item is _EXHAUSTED:
                live.remove(entry)
            else:
                yield entry[0], item


_EXHAUSTED = object()


class ChunkStream:
    """The events of a request's choices -> LiteLLM chunks, each naming its choice.

    LiteLLM 1.110.2's stream wrapper (docs/design.md, "LiteLLM facts") numbers a custom provider's
    chunk by its ``choice_index`` key (not ``GenericStreamingChunk``'s ``index``, which it
    ignores), ends the stream after the first chunk with ``is_finished`` (whose ``finish_reason``
    it gives choice 0), and finishes any other choice with a chunk's ``sibling_finish_reason``. So
    choice ``i > 0`` finishes with ``sibling_finish_reason``, and choice 0's finish, carrying the
    usage of all (``usage_fields``), is the last chunk: it waits for every other choice.

    Args:
        n: choices per prompt; choice ``i`` belongs to prompt ``i // n``.
        total: choices in all (prompts times ``n``).

    Attributes:
        finished: every choice has finished.
    """

    def __init__(self, n: int, total: int):
        self.n = n
        self.total = total
        self.finals: dict[int, StreamEvent] = {}

    @property
    def finished(self) -> bool:
        return len(self.finals) == self.total

    def chunks(self, index: int, event: StreamEvent) -> list[GenericStreamingChunk]:
        """The chunks that choice ``index``'s ``event`` makes (0, 1 or 2)."""
        if event.finish_reason is None:
            return [build_chunk(index, event.text)]
        self.finals[index] = event
        out = []
        if index:
            out.append(build_chunk(index, event.text, sibling_finish_reason=event.finish_reason))
        elif not self.finished and event.text:
            out.append(build_chunk(0, event.text))  # its finish waits for the other choices
        if self.finished:
            first = self.finals[0]
            groups = [[self.finals[i] for i in range(p, p + self.n)] for p in range(0, self.total, self.n)]
            text = first.text if index == 0 else ""
            out.append(build_chunk(0, text, finish_reason=first.finish_reason, usage=usage_fields(groups)))
        return out


def build_chunk(index: int, text: str, *, finish_reason: str | None = None, usage: dict | None = None,
                sibling_finish_reason: str | None = None) -> GenericStreamingChunk:
    """One LiteLLM chunk of choice ``index`` (``ChunkStream``): ``finish_reason`` and ``usage``
    end the stream; ``sibling_finish_reason`` ends choice ``index`` > 0 only."""
    chunk = GenericStreamingChunk(text=text, is_finished=finish_reason is not None, finish_reason=finish_reason or "",
                                  index=index, tool_use=None, usage=usage)
    chunk["choice_index"] = index  # what LiteLLM reads (see ChunkStream)
    if sibling_finish_reason is not None:
        chunk["sibling_finish_reason"] = sibling_finish_reason
    return chunk


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
            groups = _start(model, messages, optional_params, timeout, litellm_params)
            try:
                dones = [[handle.result() for handle in handles] for handles in groups]
            except BaseException:  # KeyboardInterrupt, or an engine error: free the sequences
                _cancel(groups)
                raise
        return build_response(model_response, model, dones)

    async def acompletion(
        self, model: str, messages: list, model_response: ModelResponse, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> ModelResponse:
        with litellm_errors(model):
            groups = await asyncio.to_thread(_start, model, messages, optional_params, timeout, litellm_params)
            try:
                dones = [list(await asyncio.gather(*(handle.aresult() for handle in handles))) for handles in groups]
            except BaseException:  # CancelledError: the client went away
                _cancel(groups)
                raise
        return build_response(model_response, model, dones)

    def streaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> Iterator[GenericStreamingChunk]:
        # A plain function returning a generator: a bad request or a full context raises here, at
        # call time, not at the first next().
        with litellm_errors(model):
            groups = _start(model, messages, optional_params, timeout, litellm_params)
        stream = self._stream(model, groups)
        # Its ``finally`` runs only once it has started: a stream dropped before its first chunk
        # frees the sequences when it is collected (at once, by reference counting).
        weakref.finalize(stream, _cancel, groups)
        return stream

    @staticmethod
    def _stream(model: str, groups: list[list]) -> Iterator[GenericStreamingChunk]:
        handles = [handle for group in groups for handle in group]
        out = ChunkStream(len(groups[0]), len(handles))
        try:
            with litellm_errors(model):
                for index, event in interleave([iter(handle) for handle in handles]):
                    yield from out.chunks(index, event)
        finally:
            if not out.finished:  # the caller stopped reading, or an error: free the sequences now
                _cancel(groups)

    async def astreaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, **_: Any
    ) -> AsyncIterator[GenericStreamingChunk]:
        # Must be an async generator (docs/design.md, "LiteLLM facts"): litellm iterates the
        # object it gets back.
        groups, out = [], None
        try:
            with litellm_errors(model):
                groups = await asyncio.to_thread(_start, model, messages, optional_params, timeout, litellm_params)
                handles = [handle for group in groups for handle in group]
                out = ChunkStream(len(groups[0]), len(handles))
                async for index, event in ainterleave([handle.aiter() for handle in handles]):
                    for chunk in out.chunks(index, event):
                        yield chunk
        finally:
            if out is not None and not out.finished:
                _cancel(groups)

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
