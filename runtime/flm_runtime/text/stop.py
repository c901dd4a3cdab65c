"""When a sequence stops, and what it delivers: stop strings, EOS / end-of-turn ids, the budget.

- ``StopStringMatcher`` works on text: it releases text as soon as it cannot be part of a stop
  string, holds back a suffix that is a prefix of one, and when a stop string completes releases
  the text before the earliest match and nothing after.
- ``StopChecker`` works on tokens (detokenizer + matcher + end-of-turn ids + ``max_tokens``): the
  engine, and the speculative step token by token through an accepted block, pushes each
  generated token and gets a ``Delivery``.

Finish reasons: an EOS / end-of-turn token or a completed stop string -> "stop" (even in the token
that reaches ``max_tokens``); the budget, ``min(max_tokens, context - prompt)`` -> "length".

*Delivered* tokens (docs/design.md, "Contract", items 4 and 8): each character of the output
belongs to the token whose bytes completed it; a generated token is delivered iff it is not an
EOS / end-of-turn token (unless ``ignore_eos``) and a delivered character belongs to it or to a
later token, or the sequence ends on ``length``. So a token whose text runs into a stop string is
delivered, tokens wholly inside or after it are not; a token holding a character's first bytes is
delivered with the one completing it; a ``length`` cut inside a character ends the text at the
last whole character, its tokens still delivered. An EOS / end-of-turn token after an incomplete
character turns it into U+FFFD. The delivered tokens (one logprob entry each) are a prefix of the
generated ones, and their bytes joined are the text's followed only by the rest of the token a
stop string begins inside, or the first bytes of a character a ``length`` cut splits.

Streaming releases a token in the event that releases its first delivered character; since the
released text only grows, streamed and final counts agree and the joined events are the
non-streamed text and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flm_runtime.request import FinishReason
from flm_runtime.text.detokenizer import Detokenizer


class StopStringMatcher:
    """Holds back text that may start a stop string; cuts the text at the first complete one.

    Args:
        stop: the stop strings (non-empty). Empty tuple: everything passes through at once.
    """

    def __init__(self, stop: Iterable[str] = ()):
        self._stops = tuple(stop)
        assert all(self._stops), "stop strings must be non-empty"
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to deliver now, whether a stop string completed).

        After a match the returned text ends right before the earliest stop string in the stream
        and the matcher must not be pushed again.
        """
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = len(buf) - self._held_length(buf)
        self._held = buf[keep:]
        return buf[:keep], False

    def flush(self) -> str:
        """End of the stream without a match: the held-back text is ordinary text after all."""
        held, self._held = self._held, ""
        return held

    @property
    def held(self) -> str:
        """The text held back now (a proper prefix of some stop string)."""
        return self._held

    def _held_length(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


@dataclass(frozen=True)
class Delivery:
    """What one pushed token releases to the caller.

    Attributes:
        text: whole characters, possibly "".
        token_ids: the tokens delivered now (see the module docstring), possibly ().
        finish_reason: None while the sequence goes on, else "stop" or "length".
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


class StopChecker:
    """Decides, token by token, what a sequence delivers and when it finishes.

    Args:
        detokenizer: the sequence's own ``Detokenizer``.
        stop: stop strings.
        stop_token_ids: EOS / end-of-turn ids (``tok.stop_token_ids``).
        max_tokens: the budget of generated tokens (>= 1), context already folded in.
        ignore_eos: generate past ``stop_token_ids`` (they are then ordinary delivered tokens).

    Attributes:
        generated: tokens pushed so far (the EOS / end-of-turn token and stop-string tokens
            included; never more than ``max_tokens``).
        delivered: tokens delivered so far (``completion_tokens``).
        finish_reason: None until finished.
    """

    def __init__(self, detokenizer: Detokenizer, *, stop: Iterable[str], stop_token_ids: Iterable[int],
                 max_tokens: int, ignore_eos: bool = False):
        assert max_tokens >= 1, f"max_tokens budget must be >= 1, got {max_tokens}"
        self._detok = detokenizer
        self._matcher = StopStringMatcher(stop)
        self._stop_ids = frozenset() if ignore_eos else frozenset(stop_token_ids)
        self._max_tokens = max_tokens
        self._pending: list[list[int]] = []   # [token_id, first char, end char] not delivered yet
        self._produced = 0                     # characters out of the detokenizer so far
        self._released = 0                     # characters released to the caller so far
        self.generated = 0
        self.delivered = 0
        self.finish_reason: FinishReason | None = None

    def push(self, token_id: int) -> Delivery:
        """Add one generated token.

        Raises:
            AssertionError: pushed after the sequence finished (an engine bug).
        """
        assert self.finish_reason is None, "push after finish"
        self.generated += 1
        if token_id in self._stop_ids:
            return self._finish_flush("stop")
        piece = self._detok.push(token_id)
        start, self._produced = self._produced, self._produced + len(piece)
        self._pending.append([token_id, start, self._produced])
        text, matched = self._matcher.push(piece)
        if matched:
            return self._finish_cut(text)
        if self.generated >= self._max_tokens:
            return self._finish_flush("length", head=text)
        return Delivery(text, self._release(len(text)), None)

    def _release(self, n_chars: int) -> tuple[int, ...]:
        """Count ``n_chars`` more characters released; returns the tokens that become delivered."""
        self._released += n_chars
        last = -1
        for i, (_, first, end) in enumerate(self._pending):
            if first >= self._released:
                break
            if end > first:
                last = i
        out = tuple(t for t, _, _ in self._pending[: last + 1])
        del self._pending[: last + 1]
        self.delivered += len(out)
        return out

    def _finish_cut(self, text: str) -> Delivery:
        """A stop string completed: deliver up to it, drop the rest."""
        ids = self._release(len(text))
        self._pending.clear()
        self.finish_reason = "stop"
        return Delivery(text, ids, "stop")

    def _finish_flush(self, reason: FinishReason, head: str = "") -> Delivery:
        """No more tokens: flush the detokenizer's tail and the held-back text, deliver all; a
        ``length`` cut inside a character leaves its first bytes out of the text instead (see the
        module docstring)."""
        # The model did not end the text there, so the cut bytes are not its U+FFFD.
        tail = "" if reason == "length" and self._detok.pending_bytes else self._detok.flush()
        if tail and self._pending:            # U+FFFD of a dangling tail belongs to its token
            self._pending[-1][2] += len(tail)
        self._produced += len(tail)
        more, matched = self._matcher.push(tail)
        if matched:
            return self._finish_cut(head + more)
        text = head + more + self._matcher.flush()
        ids = tuple(t for t, _, _ in self._pending)
        self._pending.clear()
        self._released += len(text)
        self.delivered += len(ids)
        self.finish_reason = reason
        return Delivery(text, ids, reason)
