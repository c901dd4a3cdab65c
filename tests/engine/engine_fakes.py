"""Tiny stand-ins for the tokenizer and the model the engine drives (same interfaces, no weights).

Tokenizer: ids 0..255 are the bytes themselves; 256 ``<eos>`` and 257 ``<|im_end|>`` are stop
tokens, 258 ``<|im_start|>`` a special that is not a stop; 259.. are extra byte strings given by
the test (whole words, or fragments of a multi-byte character).

Models: ``HashModel`` gives logits that are a fixed pseudo-random function of (last token,
position); ``ScriptModel`` emits a given list of tokens after any prompt (the prompt ends where the
engine first asks a cache's logits). Both own a real-looking cache (``length``, ``capacity``) and
keep weak references to the caches they made, so tests can see a cache being freed.

``FaultyModel`` wraps any model (a fake or a real one) to inject a kernel error into the passes of
chosen sequences (``FaultAt``: one prompt's, from a position on): the engine's model is the
injection point, no kernel is patched.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from flm_runtime.kv_cache import BlockPool, BlockTable
from flm_runtime.model_config import ModelConfig
from flm_runtime.outputs import ForwardOutput

EOS, EOT, BOT = 256, 257, 258
SPECIALS = {EOS: b"<eos>", EOT: b"<|im_end|>", BOT: b"<|im_start|>"}


PAD_TEXT = "the quick brown fox 你好世界 안녕 😀🎉 jumps".encode()


class FakeTokenizer:
    """``extra``: byte strings given ids 259..; ``vocab_size``: pad up to it with 2-3 byte pieces
    of ``PAD_TEXT`` (some of them fragments of a multi-byte character)."""

    def __init__(self, extra: list[bytes] = (), vocab_size: int = 0):
        self.vocab = [bytes([i]) for i in range(256)] + [SPECIALS[i] for i in (EOS, EOT, BOT)] + list(extra)
        pad = dict.fromkeys(PAD_TEXT[i:i + n] for n in (2, 3) for i in range(len(PAD_TEXT) - n))
        self.vocab += [p for p in pad if p not in self.vocab][: max(vocab_size - len(self.vocab), 0)]
        assert len(self.vocab) >= vocab_size, "PAD_TEXT too short for this vocab_size"
        self.stop_token_ids = frozenset({EOS, EOT})
        self.special_token_ids = frozenset(SPECIALS)
        self.bos_token_id, self.eos_token_id = None, EOS
        self._longest_first = sorted(range(259, len(self.vocab)), key=lambda t: -len(self.vocab[t]))  # for encode

    @property
    def token_bytes_table(self) -> list[bytes]:
        return self.vocab

    def id_of(self, piece: bytes | str) -> int:
        piece = piece.encode() if isinstance(piece, str) else piece
        return self.vocab.index(piece, 259) if len(piece) > 1 else piece[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Greedy longest match over the non-special vocabulary (there is no BOS)."""
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            t = next((t for t in self._longest_first if data.startswith(self.vocab[t], i)), data[i])
            ids.append(t)
            i += len(self.vocab[t])
        return ids

    def decode(self, ids) -> str:
        return b"".join(self.vocab[i] for i in ids if i not in self.special_token_ids).decode("utf-8", "replace")


FAKE_BLOCK = 16  # positions per block of the fakes' pools: small, so that tests run out of blocks


class FakeCache(BlockTable):
    """A ``BlockTable`` (its blocks counted in a pool, as the real ``KVCache``'s) that keeps the
    tokens fed to it; ``capacity_hint`` is the capacity it was created with."""

    def __init__(self, capacity: int, max_length: int, pool: BlockPool | None = None):
        super().__init__(pool or BlockPool(0, FAKE_BLOCK, growable=True), max_length)
        self.capacity_hint = capacity
        self.prompt_length = 0
        self.tokens: list[int] = []

    def append(self, ids) -> None:
        assert self.length + len(ids) <= self.max_length, "KV cache overflow: past the context length"
        self.reserve(len(ids))
        self.commit(len(ids))
        self.tokens.extend(int(i) for i in ids)

    def trim(self, length: int) -> None:
        super().trim(length)
        del self.tokens[length:]

    def copy(self) -> "FakeCache | None":
        """As ``KVCache.copy``: the same positions, independent from now on (blocks of its own);
        None when the pool has no room for them."""
        out = FakeCache(self.capacity_hint, self.max_length, self.pool)
        if not out.fits(len(self.tokens)):
            return None
        out.append(self.tokens)
        out.prompt_length = self.prompt_length
        return out


def fake_config(vocab: int, context: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context)


class FakeModelBase:
    """Cache bookkeeping and hooks shared by the fakes: ``delay`` seconds per call, and
    ``fail_when(cache) -> bool`` to make a call raise (to fail one sequence)."""

    def __init__(self, vocab: int, context: int, delay: float = 0.0, fail_when=None):
        self.config = fake_config(vocab, context)
        self.delay = delay
        self.fail_when = fail_when
        self.caches: list[weakref.ref] = []
        self.calls = 0
        self.passes: list[list[tuple[int, int]]] = []   # per forward_batch call, (rows, logit rows) per sequence
        self._lock = threading.Lock()

    def new_pool(self, positions: int) -> BlockPool:
        return BlockPool(positions // FAKE_BLOCK, FAKE_BLOCK)

    def new_cache(self, capacity: int = 0, pool: BlockPool | None = None) -> FakeCache:
        cache = FakeCache(capacity, self.config.max_position_embeddings, pool)
        with self._lock:
            self.caches.append(weakref.ref(cache))
        return cache

    def live_caches(self) -> int:
        return sum(r() is not None for r in self.caches)

    prefill_chunk = 256
    kv_dtype = np.float32
    batch_invariant = False  # ``TargetModel``'s: no prefix caching unless a test turns it on

    def forward_batch(self, token_rows, caches: list[FakeCache], *, taps=(), logit_rows=None) -> ForwardOutput:
        """Sequence by sequence: appends each row group to its cache and gives the logits of its
        last row when ``logit_rows`` asks for it (0 or 1 rows per sequence); like the real one,
        leaves the caches as they were if one sequence raises."""
        assert not taps, "the fakes have no layers to tap"
        n_logits = [1] * len(caches) if logit_rows is None else logit_rows
        self.passes.append([(len(ids), n) for ids, n in zip(token_rows, n_logits)])
        lengths = [c.length for c in caches]
        try:
            out = []
            for ids, cache, n in zip(token_rows, caches, n_logits):
                assert ids.dtype == np.int64 and ids.ndim == 1 and n in (0, 1)
                cache.append(ids)
                if n:
                    cache.prompt_length = cache.prompt_length or cache.length
                    out.append(self._call(cache))
        except Exception:
            for cache, n in zip(caches, lengths):
                cache.trim(n)
            raise
        logits = np.stack(out) if out else np.zeros((0, self.config.vocab_size), np.float32)  # [sum n_b, V]
        return ForwardOutput(logits, None)

    def _call(self, cache: FakeCache) -> np.ndarray:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail_when is not None and self.fail_when(cache):
            raise RuntimeError("injected model failure")
        logits = self.logits(cache)
        assert logits.shape == (self.config.vocab_size,) and logits.dtype == np.float32
        return logits


class HashModel(FakeModelBase):
    """Logits = fixed pseudo-random function of (last token, position); ``banned`` ids get -inf."""

    def __init__(self, vocab: int = 300, context: int = 2048, banned=(EOS, EOT), **kw):
        super().__init__(vocab, context, **kw)
        self.banned = list(banned)

    def logits(self, cache: FakeCache) -> np.ndarray:
        rng = np.random.default_rng([cache.tokens[-1], cache.length])
        out = (3.0 * rng.standard_normal(self.config.vocab_size)).astype(np.float32)
        out[self.banned] = -np.inf
        return out


class ScriptModel(FakeModelBase):
    """After any prompt, emits ``script`` token by token (greedy), then ``EOS`` forever."""

    def __init__(self, script: list[int], vocab: int = 300, context: int = 2048, **kw):
        super().__init__(vocab, context, **kw)
        self.script = list(script)

    def logits(self, cache: FakeCache) -> np.ndarray:
        i = cache.length - cache.prompt_length
        out = np.zeros(self.config.vocab_size, dtype=np.float32)
        out[self.script[i] if i < len(self.script) else EOS] = 10.0
        return out


class KernelFault(RuntimeError):
    """The error ``FaultyModel`` injects."""


class FaultyModel:
    """``model`` (its attributes, through ``__getattr__``) whose ``forward_batch`` fails as a kernel
    that faults late would: when ``fail_when(ids, cache)`` holds for a sequence of the pass (its rows
    ``[T]`` int64 and its cache before the pass), the whole pass runs, writing every row's keys and
    values, then each cache is trimmed back to its length before the pass (the new positions hold
    what was written, past the length) and ``KernelFault`` is raised. ``faults`` counts them."""

    def __init__(self, model, fail_when):
        self._model = model
        self.fail_when = fail_when
        self.faults = 0

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def forward_batch(self, token_rows, caches, **kw) -> ForwardOutput:
        if not any(self.fail_when(np.asarray(ids), cache) for ids, cache in zip(token_rows, caches)):
            return self._model.forward_batch(token_rows, caches, **kw)
        lengths = [cache.length for cache in caches]
        self._model.forward_batch(token_rows, caches, **kw)
        for cache, length in zip(caches, lengths):
            cache.trim(length)
        self.faults += 1
        raise KernelFault("injected kernel fault")


class FaultAt:
    """``FaultyModel``'s ``fail_when``: the passes of the sequence whose prompt is ``prompt`` (``[P]``
    ints) from the one that starts at position ``at`` on (0: its first prefill chunk; ``P + k``: the
    decoding step that feeds its generated token ``k``). A sequence is known by its cache, whose
    first pass is a chunk of its prompt at its place."""

    def __init__(self, prompt, at: int):
        self.prompt, self.at = np.asarray(prompt, dtype=np.int64), at
        self.bad = weakref.WeakKeyDictionary()  # cache -> whether its first pass was a chunk of ``prompt``

    def __call__(self, ids: np.ndarray, cache) -> bool:
        start = cache.length
        if cache not in self.bad:
            self.bad[cache] = np.array_equal(ids, self.prompt[start : start + len(ids)])
        return self.bad[cache] and start >= self.at
