"""A scripted stand-in for ``flm_runtime``'s Engine, for the translation-layer tests.

It follows the engine contract (``tokenizer``, ``context_length``, ``submit`` / ``submit_choices`` -> handles with sync
and async iteration, ``result``/``aresult``, ``cancel``) but "generates" a fixed reply, one
character per token, so the tests can predict every chunk and count.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from flm_runtime.errors import ContextLengthError
from flm_runtime.loading.chat_template import render_chat_template, thinking_format
from flm_runtime.request import Completion, RequestStats, SamplingParams, StreamEvent
from flm_runtime.sampling.sampler import FALLBACK_SAMPLING, choice_seed


class FakeTokenizer:
    thinking = None  # no thinking switch (Tokenizer.thinking)
    chat_template = None  # renders as below, tools in the generic format

    def __init__(self) -> None:
        self.encode_threads: list[int] = []

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return [ord(c) for c in text]

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()


class TemplateTokenizer(FakeTokenizer):
    """A FakeTokenizer that renders a real Jinja chat template with the runtime's renderer, and
    finds its thinking switch as the runtime's Tokenizer does."""

    def __init__(self, template: str) -> None:
        super().__init__()
        self.chat_template = template
        self.thinking = thinking_format(template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **extra)


@dataclass
class FakeHandle:
    events: list[StreamEvent]
    fail_after: int | None = None  # raise ``error`` after this many events
    error: BaseException | None = None
    cancelled: bool = False

    def __iter__(self):
        for i, event in enumerate(self.events):
            if self.fail_after == i:
                raise self.error
            yield event

    async def aiter(self):
        for event in self:
            await asyncio.sleep(0)
            yield event

    def result(self) -> Completion:
        events = list(self)
        return Completion(
            text="".join(e.text for e in events),
            token_ids=tuple(t for e in events for t in e.token_ids),
            finish_reason=events[-1].finish_reason,
            prompt_tokens=events[-1].prompt_tokens,
            completion_tokens=events[-1].completion_tokens,
            stats=events[-1].stats or RequestStats(events[-1].prompt_tokens, events[-1].completion_tokens,
                                                   events[-1].completion_tokens, 0.0, 0.0, 0.0, 0.0),
        )

    async def aresult(self) -> Completion:
        await asyncio.sleep(0)
        return self.result()

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeEngine:
    reply: str = "Paris is the capital of France."
    reply_to: Callable[[str], str] | None = None  # the reply to a prompt's text, when set (else ``reply``)
    seeded_replies: dict[int, str] = field(default_factory=dict)  # the reply of a request so seeded, first
    context_length: int = 256
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    submit_error: BaseException | None = None
    stream_error: BaseException | None = None  # raised mid-stream, after one event
    stats: RequestStats | None = None  # stats of every request (on the final event and the result)
    submitted: list[tuple[list[int], SamplingParams, float | None]] = field(default_factory=list)
    handles: list[FakeHandle] = field(default_factory=list)
    default_sampling = FALLBACK_SAMPLING  # no default output limit: ``max_tokens`` reaches submit as sent

    def sampling_params(self, **given) -> SamplingParams:
        return self.default_sampling.resolve(**given)

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, timeout: float | None,
               processors=()) -> FakeHandle:
        assert not processors, "the fake engine has no vocabulary to constrain: test grammars on a real one"
        self.submitted.append((prompt_ids, params, timeout))
        if self.submit_error is not None:
            raise self.submit_error
        n_prompt = len(prompt_ids)
        if n_prompt + (params.max_tokens or 1) > self.context_length:  # unset: room for one token at least
            raise ContextLengthError(
                prompt_tokens=n_prompt, max_tokens=params.max_tokens, context_length=self.context_length
            )
        text = self.reply if self.reply_to is None else self.reply_to("".join(map(chr, prompt_ids)))
        text, finish = self.seeded_replies.get(params.seed, text), "stop"
        for s in params.stop:
            if s in text:
                text = text[: text.index(s)]
        budget = min(params.max_tokens or self.context_length, self.context_length - n_prompt)
        if len(text) > budget:
            text, finish = text[:budget], "length"
        events = [
            StreamEvent(ch, (ord(ch),), finish if i == len(text) - 1 else None, n_prompt, i + 1)
            for i, ch in enumerate(text)
        ] or [StreamEvent("", (), finish, n_prompt, 0)]
        events[-1] = replace(events[-1], stats=self.stats)
        handle = FakeHandle(events, fail_after=1 if self.stream_error else None, error=self.stream_error)
        self.handles.append(handle)
        return handle

    def submit_choices(self, prompt_ids: list[int], params: SamplingParams, n: int, *,
                       timeout: float | None, processors=tuple) -> list[FakeHandle]:
        """``n`` requests, choice ``i`` seeded as the engine seeds it (``processors``: each choice's
        factory, as ``Engine.submit_choices``)."""
        return [self.submit(prompt_ids, replace(params, seed=choice_seed(params.seed, i)), timeout=timeout,
                            processors=processors()) for i in range(n)]
