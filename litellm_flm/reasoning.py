"""A reasoning model's output -> OpenAI's ``reasoning_content`` and ``content``.

A model whose chat template has a thinking switch (``flm_runtime.loading.chat_template.ThinkingFormat``)
writes its thinking between two markers (``<think>`` ... ``</think>``) before its answer. The
``ReasoningSplitter`` separates the two as the text arrives, token by token or all at once, with
the same result however the text is cut (a marker split over two stream events included):

- the thinking is one block at the start of the output: the start marker may follow only
  whitespace, and a template that already ends its generation prompt with the start marker
  (``starts_inside_thinking``) has the output begin inside the block (a start marker the model
  writes again there is dropped). Otherwise any other first text makes the whole output content,
  so text that merely mentions a marker later stays as written;
- the markers appear in neither part, nor does the whitespace next to them (the newlines of
  ``<think>\\n`` ... ``\\n</think>\\n\\n`` that templates and models put there);
- a block the output never closes (a ``length`` cut while thinking) is all reasoning: the
  trailing whitespace is dropped, and so is nothing else (a partial end marker is text).
"""

from __future__ import annotations

from dataclasses import dataclass

from flm_runtime import InvalidRequestError, ThinkingFormat

_BEFORE, _THINKING, _CONTENT = "before", "thinking", "content"


def template_switch(fmt: ThinkingFormat | None, asked: tuple[bool, str] | None, *, drop: bool) -> dict[str, bool]:
    """The chat-template variables that carry the request's thinking switch.

    Args:
        fmt: the model's thinking switch (``Tokenizer.thinking``); None: its template has none.
        asked: ``params.requested_thinking``: (on, the parameter that asked), or None.
        drop: the caller's ``drop_params``.

    Returns:
        ``{fmt.switch: on}``, or nothing where the request leaves the template's default, where
        the model has no switch and thinking is asked off (it is off already), or ``drop`` is set.

    Raises:
        InvalidRequestError: thinking asked on for a model without a switch; ``param`` names the
            parameter that asked.
    """
    if asked is None:
        return {}
    on, param = asked
    if fmt is not None:
        return {fmt.switch: on}
    if on and not drop:
        raise InvalidRequestError(f"{param} turns thinking on, but this model's chat template has no thinking switch "
                                  "(an enable_thinking variable); leave it out, or set drop_params", param=param)
    return {}


@dataclass(frozen=True)
class Reasoning:
    """How to read one request's output: the model's markers, and whether its prompt left it
    inside the thinking (``starts_inside_thinking``)."""

    fmt: ThinkingFormat
    inside: bool

    @classmethod
    def of_prompt(cls, fmt: ThinkingFormat | None, prompt: str) -> Reasoning | None:
        """The reading of an output of ``prompt`` (rendered with the model's template); None
        when the model has no thinking switch (its output is all content)."""
        return None if fmt is None else cls(fmt, starts_inside_thinking(prompt, fmt))

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt, inside=self.inside)

    def split(self, text: str) -> tuple[str | None, str]:
        """``split_reasoning`` of a whole output."""
        return split_reasoning(text, self.fmt, inside=self.inside)


def starts_inside_thinking(prompt: str, fmt: ThinkingFormat) -> bool:
    """Whether the rendered ``prompt`` leaves the model inside its thinking: the generation prompt
    ends with the start marker (then whitespace at most), as templates that always think write it."""
    return prompt.rstrip().endswith(fmt.start)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` but is not all of it."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits one output's text into (reasoning, content) as it arrives (the module docstring
    says how). ``feed`` each piece in order, then ``finish`` once; the pieces they return,
    joined, are the same for any cut of the same text.

    Args:
        fmt: the template's markers.
        inside: the output begins inside the thinking (``starts_inside_thinking`` of the prompt).
    """

    def __init__(self, fmt: ThinkingFormat, *, inside: bool = False):
        self._fmt = fmt
        self._state = _BEFORE  # a start marker may open the output even after the prompt's own
        self._after_start = _THINKING if inside else _CONTENT  # where an output without one is
        self._pending = ""  # text received but not yet given out: it may still turn out to be a marker
        self._trim = True  # drop the whitespace that opens the current part (after a marker)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text``, after what came before, completes."""
        self._pending += text
        reasoning = content = ""
        if self._state == _BEFORE:
            head = self._pending.lstrip()
            if head.startswith(self._fmt.start):
                self._pending = head[len(self._fmt.start):]
                self._state = _THINKING
            elif self._fmt.start.startswith(head):  # only whitespace, or the marker's beginning so far
                return "", ""
            elif self._after_start == _THINKING:
                self._state = _THINKING
            else:
                self._state, self._trim = _CONTENT, False
        if self._state == _THINKING:
            end = self._pending.find(self._fmt.end)
            if end < 0:
                keep = _partial_suffix(self._pending, self._fmt.end)
                body = self._pending[: len(self._pending) - keep]
                reasoning, used = self._give(body.rstrip())  # whitespace waits: it may precede the end marker
                self._pending = self._pending[used:]
                return reasoning, ""
            reasoning, _ = self._give(self._pending[:end].rstrip())
            self._pending = self._pending[end + len(self._fmt.end):]
            self._state, self._trim = _CONTENT, True
        if self._state == _CONTENT:
            if self._trim:
                self._pending = self._pending.lstrip()
                self._trim = not self._pending
            content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) held back at the end of the output: an unclosed thinking
        block's last text, or a start of output that never became a marker."""
        text, self._pending = self._pending, ""
        if self._state == _BEFORE:
            self._state = self._after_start
            if self._state == _CONTENT:
                return "", text
        if self._state == _THINKING:
            return self._give(text.rstrip())[0], ""
        return "", ""  # content gives everything out at once, but whitespace after the end marker

    def _give(self, text: str) -> tuple[str, int]:
        """``text`` (the head of ``_pending``) as the next reasoning piece, without the whitespace
        that opens the block; and how many characters of ``_pending`` that used up."""
        given = text.lstrip() if self._trim else text
        if given:
            self._trim = False
        return given, len(text)


def split_reasoning(text: str, fmt: ThinkingFormat, *, inside: bool = False) -> tuple[str | None, str]:
    """A whole output's (reasoning, content): what a ``ReasoningSplitter`` fed ``text`` in one
    piece gives; reasoning is None when the output has none."""
    splitter = ReasoningSplitter(fmt, inside=inside)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.finish()
    reasoning += tail_reasoning
    return reasoning or None, content + tail_content
