"""``FlmLLM``: the LiteLLM ``CustomLLM`` that runs ``flm/<tag>`` models on ``flm_runtime``.

A request travels (docs/design.md, "The way a request travels"): LiteLLM strips the ``flm/`` prefix
and calls one of the methods below with ``optional_params``; the handler parses the call once
(``params.parse_request``: a ``ChatRequest``), renders the prompt with the model's own chat
template (``_render``), submits it to the tag's engine, which counts the prompt tokens and queues
it (or raises ``ContextLengthError`` / ``KVBudgetError`` / ``EngineOverloadedError``;
``_submit``), and responds: the engine's events become a ``ModelResponse`` or
``ModelResponseStream`` chunks, a reasoning model's thinking split out into ``reasoning_content``
(``reasoning``). Nothing deeper: sampling, stop strings, UTF-8-safe detokenizing and token
counting are the engine's.

Blocking work (loading a model, tokenizing, waiting for tokens) never runs on the event loop: the
async methods hand it to a worker thread or to the engine's own async iterator.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NamedTuple

import httpx
from litellm import CustomLLM
from litellm.types.utils import (ChatCompletionMessageToolCall, ChatCompletionTokenLogprob, ChoiceLogprobs, Choices,
                                 Delta, EmbeddingResponse, Function, GenericStreamingChunk, Message, ModelResponse,
                                 ModelResponseStream, StreamingChoices, TopLogprob, Usage)

from flm_runtime import (Completion, StreamEvent, TokenLogprob, ToolCall, ToolCallStream, chat_messages, compiler_for,
                         parse_tool_calls)

from . import compat
from .errors import PROVIDER, litellm_errors
from .params import ChatRequest, named_as_sent, parse_embedding_request, parse_request
from .reasoning import Reasoning, template_switch
from .structured import OutputFormat


def _get_engine(tag: str, backend: str | None = None):
    """The process-wide engine of ``tag`` on ``backend`` (auto / cpu / npu; None: ``$FLM_BACKEND``),
    loaded, and pulled if need be, on first use.

    Imported lazily so that ``import litellm_flm`` (what the proxy does at startup) stays cheap;
    tests replace this function with a fake engine.
    """
    from flm_runtime import get_engine

    return get_engine(tag, backend)


def served_name(tag: str) -> str:
    """The ``model`` a response and each of its chunks name: ``flm/<tag>``, as the caller named it
    and as LiteLLM's own local providers do (``ollama/<model>``). LiteLLM finds a response's provider
    and price by this name (``stream_chunk_builder``, ``completion_cost``): the bare tag is no
    provider's, and LiteLLM prints its "Provider List" banner for it."""
    return f"{PROVIDER}/{tag}"


def _timeout_seconds(timeout: float | httpx.Timeout | None) -> float | None:
    """LiteLLM's ``timeout`` (seconds, 600 by default, or an httpx.Timeout) -> the engine's deadline.

    LiteLLM does not enforce timeouts for custom handlers: the engine does. Of an httpx.Timeout
    only ``read`` (time without new data) has a local meaning.
    """
    if isinstance(timeout, httpx.Timeout):
        return timeout.read
    return None if timeout is None else float(timeout)


class Started(NamedTuple):
    """A submitted request (``_start``).

    Attributes:
        groups: the engine's RequestHandles, per prompt (one for a chat) its ``n`` choices.
        reasoning: how to split a chat's output into reasoning and content (None: all content).
        token_bytes: the model's ``id -> bytes`` of a token (for logprobs).
        output: what the output is held to, and whether its answers hold tool calls.
        prompt_ids: with ``return_token_ids``, the chat's prompt as the engine got it (token
            ids); else None.
    """

    groups: list[list]
    reasoning: Reasoning | None
    token_bytes: Callable[[int], bytes]
    output: OutputFormat
    prompt_ids: list[int] | None = None


def _start(model: str, messages: list, optional_params: dict, timeout: Any,
           litellm_params: dict | None, logging_obj: Any = None) -> Started:
    """Parse, render and submit a request (blocking: may load the model); its errors name each
    parameter as the caller sent it (``ChatRequest.names``).

    A chat's tools, calls and tool results are rendered by the model's template where it writes
    Hermes tool calls itself (Qwen2.5's), else in the generic tool-call format
    (``flm_runtime.text.tool_format.chat_messages``); a text completion continues each prompt's
    raw text, with no chat template, or with a ``suffix`` fills the gap between each prompt and it
    (``Tokenizer.encode_fim``; a model without FIM tokens refuses it, naming ``suffix``).

    Raises:
        flm_runtime.errors.FlmError: the caller maps it with ``litellm_errors``.
    """
    request = parse_request(messages, optional_params, litellm_params, logging_obj)  # before loading: fail fast
    with named_as_sent(request.names):
        engine = _get_engine(model, request.backend)
        params = engine.sampling_params(**request.sampling)  # the model's default sampler fills unset fields
        predicted = () if request.prediction is None else engine.tokenizer.encode(request.prediction, add_bos=False,
                                                                                   parse_special=False)
        params = dataclasses.replace(params, speculation=request.speculation, prediction=tuple(predicted))
        prompt_ids, reasoning = _render(engine, request)
        return _submit(engine, request, params, prompt_ids, reasoning, timeout)


def _render(engine, request: ChatRequest) -> tuple[list[list[int]], Reasoning | None]:
    """The prompts' token ids (a chat's one prompt by the model's template, with the request's
    thinking switch and tools; a text completion's as given), and how to split the output into
    reasoning and content (None: all content).

    Raises:
        InvalidRequestError: thinking asked on for a model without a switch (``template_switch``),
            a message the template cannot render, a ``suffix`` for a model without FIM tokens.
    """
    fmt = None if request.text_completion else engine.tokenizer.thinking
    switch = template_switch(fmt, request.thinking, drop=request.drop)
    if request.text_completion:
        texts, reasoning = request.prompts, None
    else:  # how the tools reach the prompt depends on the model's template
        chat, tools = chat_messages(request.messages, request.output.functions, engine.tokenizer.chat_template)
        texts = [engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, **tools, **switch)]
        reasoning = Reasoning.of_prompt(fmt, texts[0])
    suffix = request.suffix
    prompt_ids = [engine.tokenizer.encode(text) if suffix is None else engine.tokenizer.encode_fim(text, suffix)
                  for text in texts]
    return prompt_ids, reasoning


def _submit(engine, request: ChatRequest, params, prompt_ids: list[list[int]], reasoning: Reasoning | None,
            timeout: Any) -> Started:
    """Submit each prompt with ``request.n`` choices (``Engine.submit_choices``: one prefill), all
    before any is awaited, so the engine batches them; a response format or tool choice becomes a
    grammar compiled for each choice (``flm_runtime.sampling.grammar``). One prompt refused (too
    long, queue full, a grammar that fails): none of them runs.

    Returns:
        The handles, the reasoning split, the tokens' bytes and the output format (``Started``).
    """
    output = request.output
    grammar_text = output.grammar_for(engine.tokenizer)
    compiler = compiler_for(engine.tokenizer) if grammar_text is not None else None

    def grammar() -> list:  # each choice's own matcher: its state follows that choice's tokens
        return [compiler.processor(grammar_text, param=output.param)] if compiler else []

    from flm_runtime import with_output_limit  # deferred, as in _get_engine: it loads the engine's modules

    groups: list[list] = []
    raw = request.text_completion
    try:
        for i, ids in enumerate(prompt_ids):
            # The engine names a prompt "messages": a text completion's is "prompt", or "prompt[i]" of several.
            with named_as_sent({"messages": "prompt" if len(prompt_ids) == 1 else f"prompt[{i}]"} if raw else {}):
                groups.append(engine.submit_choices(ids, with_output_limit(engine, params, len(ids), request.n),
                                                    request.n, timeout=_timeout_seconds(timeout), processors=grammar))
    except BaseException:
        _cancel(groups)
        raise
    return Started(groups, reasoning, engine.tokenizer.token_bytes, output,
                   list(prompt_ids[0]) if request.return_token_ids else None)


def _cancel(groups: list[list]) -> None:
    for handles in groups:
        for handle in handles:
            handle.cancel()


def build_response(model_response: ModelResponse, model: str, groups: list[list[Completion]],
                   started: Started) -> ModelResponse:
    """Fill LiteLLM's pre-made ``ModelResponse`` from finished requests: per prompt its ``n``
    choices, numbered in that order (OpenAI's for a list of prompts), each with its thinking in
    ``reasoning_content`` where ``started.reasoning`` says how to find it and its own ``logprobs``
    when asked for (``choice_logprobs``); ``usage`` (``usage_fields``). When the output reads tool
    calls (``started.output``) an answer's calls become the message's ``tool_calls`` (``content``
    None) and its ``finish_reason`` ``tool_calls``. With ``return_token_ids``
    (``started.prompt_ids`` set) the response's ``prompt_token_ids`` and each choice's
    ``token_ids`` (the tokens delivered, ``usage.completion_tokens`` of them: the end-of-turn token
    that ended the answer, which vLLM's server includes, is not), as vLLM's server names them.

    LiteLLM leaves usage at zero and ``model`` unset for custom handlers; ``model`` is
    ``served_name`` of the tag LiteLLM passed, the name streamed chunks carry too.
    ``_hidden_params["flm_stats"]`` is the request's stats (``RequestStats.as_dict``), or with
    several choices a list of them in choice order.
    """
    dones = [done for group in groups for done in group]
    model_response.choices = []
    ids = started.prompt_ids is not None
    for i, done in enumerate(dones):
        message = _message(done.text, started.reasoning, started.output.reads_tool_calls)
        extra = {"token_ids": list(done.token_ids)} if ids else {}
        model_response.choices.append(Choices(
            index=i, finish_reason=_finish_reason(done.finish_reason, bool(message.tool_calls)), message=message,
            logprobs=None if done.logprobs is None else choice_logprobs(done.logprobs, started.token_bytes), **extra))
    if ids:
        setattr(model_response, "prompt_token_ids", started.prompt_ids)  # not a declared field, as usage
    model_response.model = served_name(model)
    model_response.created = int(time.time())
    setattr(model_response, "usage", Usage(**usage_fields(groups)))  # not a declared field of ModelResponse
    stats = [done.stats.as_dict() for done in dones]
    compat.put_stats(model_response, stats[0] if len(stats) == 1 else stats)
    return model_response


# What a log-probability of -inf (a token the request's filters left no probability) becomes in
# JSON, which has no infinity: vLLM's OpenAI server's floor.
LOGPROB_FLOOR = -9999.0


def choice_logprobs(records: list[TokenLogprob] | tuple[TokenLogprob, ...],
                    token_bytes: Callable[[int], bytes]) -> ChoiceLogprobs:
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


def _finish_reason(reason: str, made_calls: bool) -> str:
    """OpenAI's finish_reason of an answer: ``tool_calls`` when it made calls and ended on its own."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _message(text: str, reasoning: Reasoning | None, reads_tool_calls: bool) -> Message:
    """The assistant message of an answer: its thinking split out, its calls read (a call cut
    short by ``max_tokens`` is dropped, the calls before it kept; ``content`` None)."""
    thought, content = (None, text) if reasoning is None else reasoning.split(text)
    content, calls = parse_tool_calls(content) if reads_tool_calls else (content, [])
    tool_calls = [ChatCompletionMessageToolCall(id=c.id, type="function",
                                                function=Function(name=c.name, arguments=c.arguments))
                  for c in calls]
    extra = {"reasoning_content": thought} if reasoning is not None else {}
    return Message(content=content, role="assistant", tool_calls=tool_calls or None, **extra)


def usage_fields(groups: list[list[Completion | StreamEvent]]) -> dict:
    """OpenAI usage fields of finished requests: per prompt, its choices' ``Completion``s or final
    ``StreamEvent``s (same fields). Each prompt counts once, however many choices share it; every
    choice's completion tokens count.

    With a predicted output (OpenAI's ``prediction``: ``SpecStats.proposers`` has the
    ``prediction`` proposer), ``completion_tokens_details`` says how it fared, in OpenAI's fields:
    ``accepted_prediction_tokens``, its tokens the verifier kept, and
    ``rejected_prediction_tokens``, its tokens verified and rejected (OpenAI counts every predicted
    token the answer lacks, which a verifier that stops at the first mismatch cannot know).
    Without one, a speculating engine's (``stats.spec`` set) say the same of every proposer's
    tokens together (our own predictions: the only per-request speculation figures a stream or a
    proxy's client gets). Like OpenAI's, they are not added to ``completion_tokens`` (always the
    tokens delivered). Every proposer's figures (acceptance length and all) are in
    ``_hidden_params["flm_stats"]``. Prompt
    tokens taken from the prefix cache instead of computed are
    ``prompt_tokens_details.cached_tokens`` (OpenAI's field), present when there are any.
    """
    dones = [done for group in groups for done in group]
    prompt_tokens = sum(group[0].prompt_tokens for group in groups)
    completion_tokens = sum(done.completion_tokens for done in dones)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    cached = sum(group[0].stats.cached_tokens for group in groups if group[0].stats is not None)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    spec = [done.stats.spec for done in dones if done.stats is not None and done.stats.spec is not None]
    predicted = any("prediction" in s.proposers for s in spec)
    counts = [s.counts("prediction") if predicted else s for s in spec]
    if counts:
        accepted = sum(c.accepted for c in counts)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": sum(c.drafted for c in counts) - accepted}
    return usage


def _embed(model: str, input: Any, optional_params: dict, litellm_params: dict | None) -> tuple[list, int, str]:
    """Validate, tokenize and embed ``input`` (blocking: may load the model, runs the target).

    Returns:
        The vectors (``[B, E]`` float32, unit L2 norm: ``flm_runtime.embedding``), the prompt
        tokens of all texts, and the encoding format asked for.

    Raises:
        flm_runtime.errors.FlmError: the caller maps it with ``litellm_errors``.
    """
    from flm_runtime import embed  # imports the kernels: not at ``import litellm_flm``

    request = parse_embedding_request(input, optional_params, litellm_params)
    engine = _get_engine(model, request.backend)
    token_lists = [engine.tokenizer.encode(t) if isinstance(t, str) else t for t in request.inputs]
    return (embed(engine.model, token_lists, engine.context_length), sum(len(ids) for ids in token_lists),
            request.encoding_format)


def build_embedding_response(model_response: EmbeddingResponse, model: str, vectors, prompt_tokens: int,
                             fmt: str) -> EmbeddingResponse:
    """Fill LiteLLM's pre-made ``EmbeddingResponse``: item ``i`` is ``vectors[i]`` as a list of
    floats, or for ``fmt`` ``base64`` its little-endian float32 bytes in base64 (OpenAI's)."""
    def encoded(v):
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64" else v.tolist()

    model_response.data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    model_response.model = served_name(model)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
    setattr(model_response, "usage", usage)  # as on a ModelResponse
    return model_response


_EXHAUSTED = object()  # what next() / anext() give for an exhausted stream


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


class StreamChunks:
    """The engine events of a streamed request's choices -> LiteLLM chunks, each under its choice.

    Content goes in ``ModelResponseStream`` chunks rather than GenericStreamingChunks because
    only their delta carries ``reasoning_content`` (docs/design.md, "LiteLLM facts"). LiteLLM
    passes a custom provider's ModelResponseStream on as it is, so each chunk has the stream's one
    id, ``model`` (``served_name``), its choice's index and the role on the choice's first. The
    first chunk with a finish_reason ends the stream for LiteLLM (it drops that chunk if it has no content or tool
    calls, and sends the finish_reason, as choice 0's, on a chunk of its own); another choice
    finishes with a GenericStreamingChunk's ``sibling_finish_reason`` (and its ``choice_index``:
    ``compat.sibling_finish``). So choice 0 finishes last, once every other has: a chunk with the usage
    of all (``usage_fields``), then its finish_reason alone.

    Logprobs, when asked for, ride on the chunk of their choice that sends their tokens' text
    (``choice_logprobs``): held back with the text that choice's splitter holds, and sent on a
    chunk of their own for tokens that have no text (a special token) or that end the choice
    with none.

    An answer that may hold tool calls (``reads_tool_calls``) goes through a ``ToolCallStream``:
    its content as content, and each call, once complete, as a chunk of its own whose
    ``delta.tool_calls`` holds it whole (index, id, name, arguments: OpenAI's tool-call delta);
    the finish_reason is ``tool_calls`` when the answer made calls and ended on its own.

    With ``prompt_ids`` (``return_token_ids``) the stream's first chunk carries
    ``prompt_token_ids``, and each choice's token ids ride as ``token_ids`` on its chunks the way
    logprobs do: joined in order, a choice's chunks give all its completion tokens.

    Args:
        model: the tag as LiteLLM passed it.
        reasoning: how to split the output (``_start``); None: all content.
        n: choices per prompt; choice ``i`` belongs to prompt ``i // n``.
        total: choices in all (prompts times ``n``).
        token_bytes: the model's ``id -> bytes`` of a token; needed for logprobs.
        reads_tool_calls: read calls out of the answers.
        prompt_ids: the prompt's token ids, to be returned with the choices'; None: no token ids.

    Attributes:
        finished: every choice has finished.
    """

    def __init__(self, model: str, reasoning: Reasoning | None, n: int = 1, total: int = 1,
                 token_bytes: Callable[[int], bytes] | None = None, reads_tool_calls: bool = False,
                 prompt_ids: list[int] | None = None):
        self._id = f"chatcmpl-{uuid.uuid4()}"
        self._created = int(time.time())
        self._model = served_name(model)
        self._n = n
        self._total = total
        self._splitters = [reasoning.splitter() if reasoning is not None else None for _ in range(total)]
        self._roles: list[str | None] = ["assistant"] * total  # on a choice's first chunk only
        self._finals: dict[int, StreamEvent] = {}
        self._token_bytes = token_bytes
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(total)]  # per choice: tokens not sent yet
        self._calls = [ToolCallStream() if reads_tool_calls else None for _ in range(total)]
        self._n_calls = [0] * total  # per choice: calls sent
        self._prompt_ids = prompt_ids  # sent on the first chunk, then None
        self._ids: list[list[int]] | None = None if prompt_ids is None else [[] for _ in range(total)]  # not sent yet

    @property
    def finished(self) -> bool:
        return len(self._finals) == self._total

    def __call__(self, index: int, event: StreamEvent) -> list[ModelResponseStream | GenericStreamingChunk]:
        """The chunks of choice ``index``'s event: none while text is held back (a marker may be
        starting)."""
        finished = event.finish_reason is not None
        thought, text = "", event.text
        splitter = self._splitters[index]
        if splitter is not None:
            thought, text = splitter.feed(event.text)
            if finished:
                tail_thought, tail_text = splitter.finish()
                thought, text = thought + tail_thought, text + tail_text
        calls: list[ToolCall] = []
        if self._calls[index] is not None:
            text, calls = self._calls[index].feed(text)
            if finished:
                text += self._calls[index].finish()
        chunks: list = []
        for call in calls:
            chunks.append(self._chunk(index, Delta(role=self._roles[index], tool_calls=[
                {"index": self._n_calls[index], "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}])))
            self._roles[index], self._n_calls[index] = None, self._n_calls[index] + 1
        pending = self._logprobs[index]
        pending.extend(event.logprobs or ())
        ids = self._ids[index] if self._ids is not None else None
        if ids is not None:
            ids.extend(event.token_ids)
        if thought or text or ((pending or ids) and (finished or not event.text)):
            chunks.append(self._chunk(index, Delta(content=text or None, reasoning_content=thought or None,
                                                   role=self._roles[index])))
            self._roles[index] = None
            if pending:
                chunks[-1].choices[0].logprobs = choice_logprobs(pending, self._token_bytes)
                self._logprobs[index] = []
            if ids:
                setattr(chunks[-1].choices[0], "token_ids", list(ids))
                ids.clear()
        if not finished:
            return self._first(index, chunks)
        self._finals[index] = event
        if index:
            chunks.append(compat.sibling_finish(index, self._finish_reason(index)))
        if self.finished:  # choice 0's last delta (its own, or an empty one) carries the usage
            if index or not chunks:
                chunks.append(self._chunk(0, Delta(role=self._roles[0])))
            groups = [[self._finals[i] for i in range(p, p + self._n)] for p in range(0, self._total, self._n)]
            chunks[-1].usage = Usage(**usage_fields(groups))
            chunks.append(self._chunk(0, Delta(), finish_reason=self._finish_reason(0)))
        return self._first(index, chunks)

    def _first(self, index: int, chunks: list) -> list:
        """``chunks`` (of choice ``index``), the stream's first of them given ``prompt_token_ids``
        when still unsent; a sibling's finish cannot carry them (LiteLLM reads only its own keys),
        so a choice that ends before any chunk was sent opens the stream with its role first."""
        if self._prompt_ids is None or not chunks:
            return chunks
        if not isinstance(chunks[0], ModelResponseStream):
            chunks.insert(0, self._chunk(index, Delta(role=self._roles[index])))
            self._roles[index] = None
        setattr(chunks[0], "prompt_token_ids", self._prompt_ids)
        self._prompt_ids = None
        return chunks

    def _finish_reason(self, index: int) -> str:
        return _finish_reason(self._finals[index].finish_reason, self._n_calls[index] > 0)

    def _chunk(self, index: int, delta: Delta, finish_reason: str | None = None) -> ModelResponseStream:
        return ModelResponseStream(id=self._id, created=self._created, model=self._model,
                                   choices=[StreamingChoices(index=index, delta=delta, finish_reason=finish_reason)])


class FlmLLM(CustomLLM):
    """LiteLLM entry points. ``model`` is the tag with the ``flm/`` prefix already stripped.

    The signatures take what LiteLLM passes by keyword and ignore the rest (api_base, api_key,
    headers, client, ...: a local engine has no use for them); of ``litellm_params`` only
    ``drop_params``, ``text_completion`` and (for embeddings) ``proxy_server_request`` are read, and
    of ``logging_obj`` the caller's parameters and messages (``compat.sent_params``, ``compat.sent_messages``).
    """

    def completion(
        self, model: str, messages: list, model_response: ModelResponse, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, logging_obj: Any = None, **_: Any
    ) -> ModelResponse:
        with litellm_errors(model):
            started = _start(model, messages, optional_params, timeout, litellm_params, logging_obj)
            try:
                dones = [[handle.result() for handle in handles] for handles in started.groups]
            except BaseException:  # KeyboardInterrupt, or an engine error: free the sequences
                _cancel(started.groups)
                raise
        return build_response(model_response, model, dones, started)

    async def acompletion(
        self, model: str, messages: list, model_response: ModelResponse, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, logging_obj: Any = None, **_: Any
    ) -> ModelResponse:
        with litellm_errors(model):
            started = await asyncio.to_thread(_start, model, messages, optional_params, timeout, litellm_params,
                                              logging_obj)
            try:
                dones = [list(await asyncio.gather(*(handle.aresult() for handle in handles)))
                         for handles in started.groups]
            except BaseException:  # CancelledError: the client went away
                _cancel(started.groups)
                raise
        return build_response(model_response, model, dones, started)

    def streaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, logging_obj: Any = None, **_: Any
    ) -> Iterator[ModelResponseStream | GenericStreamingChunk]:
        # A plain function returning a generator: a bad request or a full context raises here, at
        # call time, not at the first next().
        with litellm_errors(model):
            started = _start(model, messages, optional_params, timeout, litellm_params, logging_obj)
        stream = self._stream(model, started)
        # Its ``finally`` runs only once it has started: a stream dropped before its first chunk
        # frees the sequences when it is collected (at once, by reference counting).
        weakref.finalize(stream, _cancel, started.groups)
        return stream

    @staticmethod
    def _stream(model: str, started: Started) -> Iterator[ModelResponseStream | GenericStreamingChunk]:
        groups = started.groups
        handles = [handle for group in groups for handle in group]
        chunks = StreamChunks(model, started.reasoning, len(groups[0]), len(handles), started.token_bytes,
                              started.output.reads_tool_calls, started.prompt_ids)
        try:
            with litellm_errors(model):
                for index, event in interleave([iter(handle) for handle in handles]):
                    yield from chunks(index, event)
        finally:
            if not chunks.finished:  # the caller stopped reading, or an error: free the sequences now
                _cancel(groups)

    async def astreaming(
        self, model: str, messages: list, optional_params: dict, timeout=None,
        litellm_params: dict | None = None, logging_obj: Any = None, **_: Any
    ) -> AsyncIterator[ModelResponseStream | GenericStreamingChunk]:
        # Must be an async generator (docs/design.md, "LiteLLM facts"): litellm iterates the
        # object it gets back.
        groups, chunks = [], None
        try:
            with litellm_errors(model):
                started = await asyncio.to_thread(_start, model, messages, optional_params, timeout, litellm_params,
                                                  logging_obj)
                groups = started.groups
                handles = [handle for group in groups for handle in group]
                chunks = StreamChunks(model, started.reasoning, len(groups[0]), len(handles), started.token_bytes,
                                      started.output.reads_tool_calls, started.prompt_ids)
                async for index, event in ainterleave([handle.aiter() for handle in handles]):
                    for chunk in chunks(index, event):
                        yield chunk
        finally:
            if chunks is not None and not chunks.finished:
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
