"""Constrained decoding: a request's output held to a grammar by a token mask (llguidance).

`llguidance <https://github.com/guidance-ai/llguidance>`_ (the engine behind llama.cpp's, vLLM's
and SGLang's structured output) compiles a grammar (a JSON schema, or a Lark grammar that may
inline JSON schemas with ``%json { ... }``) against a tokenizer's vocabulary; its ``LLMatcher``
then answers, after each token, which tokens may come next (a bitmask, one bit per token id) and
follows the tokens emitted. Any token sequence that spells a string of the grammar is allowed, not
only the canonical tokenization of that string.

``GrammarProcessor`` is that matcher as a request's ``processors.LogitsProcessor``: ``process``
sets the logits of the tokens the grammar forbids to ``-inf``, ``accept`` advances the matcher.
The request's picker runs it on every position whose token it picks (plain decode, batched rows,
each row of a speculative verify pass), so a drafted token the grammar forbids ends the accepted
prefix and speculation stays lossless. Before the verify pass, ``speculate`` tells the
speculative step which of a proposal's tokens the grammar allows and which it forces (advancing
the matcher over them and rolling it back), so that a proposal is cut where it would be rejected
and forced tokens cost no draft. Once the grammar is complete only the stop tokens (EOS,
end-of-turn) are allowed, so a constrained request ends with ``finish_reason="stop"`` unless
``max_tokens`` cuts it first.

JSON is generated compact-but-spaced (``{"a": 1, "b": [2, 3]}``: ``", "`` and ``": "`` as
separators, no other whitespace, ``JSON_OPTIONS``): a small model left free to add whitespace
tends to write newlines forever, and this is the form ``json.dumps`` writes.

The bridge to our tokenizer (``_Vocabulary``, built by ``compiler_for``) hands llguidance the exact bytes of every token id
(``Tokenizer.token_bytes_table``, the table our detokenizer uses), so the mask and the delivered
text agree by construction; it is built once per tokenizer.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from flm_runtime.errors import InvalidRequestError

# llguidance's JSON compile options for every JSON grammar (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Any, *, param: str = "response_format") -> str:
    """The llguidance grammar of JSON text that validates against ``schema``.

    Args:
        schema: a JSON schema (a dict; llguidance's supported subset of draft 2020-12:
            https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).
        param: the request parameter to name in errors.

    Returns:
        the grammar (llguidance's serialized form), to compile with ``GrammarCompiler.processor``,
        which reports what in the schema cannot be compiled.

    Raises:
        InvalidRequestError: ``schema`` is not a JSON object.
    """
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"the JSON schema must be an object, got {type(schema).__name__}", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"the JSON schema cannot be read: {e}", param=param) from e


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's JSON mode, ``{"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text in llguidance's dialect (``%json { ... }`` inlines a schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarProcessor:
    """One request's grammar: masks each position's logits and follows the tokens emitted
    (``processors.LogitsProcessor``).

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` of the request's grammar (not in error).
        vocab_size: the tokenizer's vocabulary; a model's logits rows may be longer (a padded
            vocabulary), and the ids past it are never text, so never allowed.

    Raises (from ``process`` / ``accept``):
        RuntimeError: the matcher failed (a token the mask forbade was emitted, or llguidance hit
            a resource limit); the message carries llguidance's. The engine fails that request
            alone.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32, reused

    def allowed(self, size: int | None = None) -> np.ndarray:
        """``[size]`` bool (default: the tokenizer's vocabulary): the tokens the grammar allows at
        the next position."""
        fill_next_token_bitmask(self._matcher, self._bitmask)
        self._check()
        # Bit t of the little-endian int32 words is token t; unpacking past them gives False.
        bits = self._bitmask.view(np.uint8)
        return np.unpackbits(bits, count=size or self._vocab_size, bitorder="little").view(bool)

    def process(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` ``[V]`` float32 with every token the grammar forbids set to ``-inf`` (in
        place); once the grammar is complete only the stop tokens stay."""
        allowed = self.allowed(logits.shape[-1])
        if not allowed.any():
            raise RuntimeError(f"the grammar allows no token here: {self._matcher.get_error() or 'no stop token'}")
        np.putmask(logits, ~allowed, -np.inf)
        return logits

    def accept(self, token: int) -> None:
        """``token`` was emitted: the matcher moves past it."""
        self._matcher.consume_token(int(token))
        self._check()

    def speculate(self, proposal: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a speculative step may verify after those accepted so far, given a
        proposal: the proposal cut at the first token the grammar forbids, with the tokens the
        grammar forces in their places.

        Position by position from the next one: where the grammar forces tokens (llguidance's
        fast-forward tokens, ``compute_ff_tokens``: a forced string's canonical tokens, the only
        tokens the mask then allows), those; else the proposal's token at that position, while
        the grammar allows it; once the grammar is complete, a stop token of the proposal's ends
        them (nothing after the output's end is worth a verify row). The proposal is followed
        only while it agrees with the forced tokens, since its later tokens continue a token the
        grammar forbids. It stops at ``most`` tokens, or where the grammar forbids the proposal's
        token (or it has none) and forces nothing.

        Args:
            proposal: ``[k]`` int proposed tokens (``proposal[j]`` for the ``j``-th next position).
            most: the most tokens to return.
        Returns:
            ``(ids, forced)``: ``[g]`` int64 tokens (``g <= most``), and ``[g]`` bool, True where
            the grammar forced the token; where it did not, ``ids[j] == proposal[j]``.
        Raises:
            RuntimeError: the matcher failed (as ``accept``).

        The matcher is advanced over the tokens and rolled back: it is left as it was.
        """
        matcher, tokens, flags, consumed = self._matcher, [], [], 0
        ids = proposal.tolist()
        outside = [j for j, t in enumerate(ids) if not 0 <= t < self._vocab_size]  # llguidance fails on them
        ids, follow = ids[: outside[0] if outside else len(ids)], 0  # follow: the proposal's next, or len(ids)
        try:
            while len(tokens) < most:
                if matcher.is_stopped():  # complete: validate_tokens allows nothing, the mask the stop tokens
                    if follow < len(ids) and self.allowed()[ids[follow]]:
                        tokens.append(ids[follow])
                        flags.append(False)
                    break
                run = matcher.compute_ff_tokens()[: most - len(tokens)]
                if run:
                    follow = follow + len(run) if ids[follow : follow + len(run)] == run else len(ids)
                    taken = run
                elif follow < len(ids) and matcher.validate_tokens(ids[follow : follow + 1]):
                    taken, follow = ids[follow : follow + 1], follow + 1
                else:
                    break
                matcher.consume_tokens(taken)
                consumed += len(taken)
                tokens += taken
                flags += [bool(run)] * len(taken)
        finally:
            matcher.rollback(consumed)
        self._check()
        return np.array(tokens, dtype=np.int64), np.array(flags, dtype=bool)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")


class GrammarCompiler:
    """Compiles grammars against one tokenizer's vocabulary (``compiler_for`` keeps one per
    tokenizer).

    Args:
        tokenizer: ``flm_runtime.loading.Tokenizer``-like: ``token_bytes_table`` (``[V]`` bytes),
            ``special_token_ids``, ``stop_token_ids``, ``bos_token_id``, ``eos_token_id`` and
            ``encode(text, add_bos=False)``.
    """

    def __init__(self, tokenizer):
        self.vocab_size = len(tokenizer.token_bytes_table)
        self.llg_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                                    n_vocab=self.vocab_size,
                                                    eos_token=sorted(tokenizer.stop_token_ids))

    def processor(self, grammar: str, *, param: str = "response_format") -> GrammarProcessor:
        """A fresh ``GrammarProcessor`` of ``grammar`` (from ``json_schema_grammar``,
        ``json_object_grammar`` or ``lark_grammar``).

        Raises:
            InvalidRequestError: the grammar cannot be compiled (an unsupported or contradictory
                schema keyword, a Lark syntax error ...): llguidance's reason, naming ``param``.
        """
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param} cannot be compiled to a grammar: {matcher.get_error()}", param=param)
        return GrammarProcessor(matcher, self.vocab_size)


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer) -> GrammarCompiler:
    """The ``GrammarCompiler`` of ``tokenizer``, built on first use and kept while the tokenizer lives."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, the special ids, and an
    encoder (it tokenizes grammar literals with it)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes_table
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, text: str) -> list[int]:
        # TokenizerWrapper first tries bytes and falls back to str when that raises.
        if not isinstance(text, str):
            raise TypeError("the vocabulary encodes str only")
        return self._tokenizer.encode(text, add_bos=False)
