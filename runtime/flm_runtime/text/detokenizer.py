"""Incremental detokenizer: token ids in, whole UTF-8 characters out.

Byte-level BPE tokens are byte strings that may end or begin in the middle of a character (an
emoji is 4 bytes and often 2-3 tokens). ``Detokenizer`` appends each token's exact bytes
(``tok.token_bytes``) and returns the longest prefix that forms whole characters, keeping an
incomplete tail for the next token. A byte sequence that can never complete becomes U+FFFD as soon
as that is certain; at the end ``flush`` turns a dangling tail into U+FFFD. The joined output is
exactly ``bytes.decode("utf-8", errors="replace")`` of all the bytes: it is Python's incremental
UTF-8 decoder, which makes the same replacement decisions as the one-shot decode. (A ``length`` cut
does not flush: ``StopChecker`` drops the dangling tail, see ``stop.py``.)

Characters are code points: a ZWJ emoji sequence or a base letter plus combining mark may be split
across two pushes, each half still valid UTF-8.
"""

from __future__ import annotations

import codecs
from typing import Callable, Iterable


class Detokenizer:
    """Turns a stream of token ids into a stream of text of whole characters.

    Args:
        token_bytes: ``id -> bytes``, the token's exact raw bytes (``tok.token_bytes``).
        skip_ids: ids whose bytes are never emitted (end-of-turn / EOS when ``ignore_eos`` lets
            them through: their text is a marker, not content).
    """

    def __init__(self, token_bytes: Callable[[int], bytes], skip_ids: Iterable[int] = ()):
        self._token_bytes = token_bytes
        self._skip = frozenset(skip_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; returns the characters it completes (possibly "")."""
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._token_bytes(token_id), final=False)

    def flush(self) -> str:
        """End of the stream: the incomplete tail, if any, as U+FFFD; "" otherwise."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may start a character that is not complete yet."""
        return self._decoder.getstate()[0]


def detokenize(token_bytes: Callable[[int], bytes], ids: Iterable[int]) -> str:
    """Whole-sequence decode of ``ids`` (the reference the incremental path must equal)."""
    return b"".join(token_bytes(i) for i in ids).decode("utf-8", errors="replace")
