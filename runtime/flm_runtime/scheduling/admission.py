"""Admission control: the KV memory budget of an engine, in blocks of its paged KV pool.

An engine's KV cache is one pool of fixed-size blocks (``flm_runtime.kv_cache``) of ``kv_budget``
bytes. A queued request is admitted when the blocks of its prompt fit in what the pool has
available, less one block for each running sequence (what it may take at its next step); a
sequence then takes blocks as it grows. When a step finds the pool empty, the engine preempts the
youngest sequence (its blocks freed, its context recomputed when it is admitted again: vLLM's
recompute preemption), so a request of unknown length (``max_tokens`` unset) holds only what it
uses. A request whose longest possible sequence would not fit in the whole pool even alone is
refused at submit (``KVBudgetError``).

Bytes per position count the K and V of every target layer in the target cache's dtype (float16
for a quantized cpu model, float32 otherwise) and, with speculative decoding, the float32 K and V
of every draft layer (``kv_bytes_per_token``): the pool's blocks are sized by the target's bytes,
the draft's caches grow beside them, and the budget counts both. The npu backend keeps its cache
in bfloat16 and is counted as float32, so there the budget is conservative by a factor of 2.

``FLM_KV_BUDGET`` and ``FLM_MAX_QUEUE`` (``flm_runtime.settings``, ``Settings.engine_limits``) set
an engine's ``kv_budget`` and ``max_queue`` when ``flm_runtime.api`` creates it. The default budget
is ``DEFAULT_KV_BUDGET_CONTEXTS`` full contexts of the model (``4 * 8192 * 23,040`` bytes = 755 MB
for smollm2:135m with quantized weights); one request more than ``max_queue`` waiting gets
``EngineOverloadedError`` at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from flm_runtime.errors import ContextLengthError, InvalidRequestError, KVBudgetError

# Full-context sequences the default budget holds at once (short requests pack many more).
DEFAULT_KV_BUDGET_CONTEXTS = 4
FLOAT32_BYTES = 4


def kv_bytes_per_token(config, draft_config=None, target_itemsize: int = FLOAT32_BYTES) -> int:
    """Bytes of KV cache one position takes: K and V of every layer (and draft layer).

    Args:
        config: the target's ``ModelConfig`` (``num_hidden_layers``, ``num_key_value_heads``,
            ``head_dim``).
        draft_config: the DFlash draft's ``DFlashConfig`` (same fields), or None.
        target_itemsize: bytes of one element of the target's cache (2: float16).

    Returns:
        ``2 * L * Hkv * D * target_itemsize`` bytes, plus ``2 * L * Hkv * D * 4`` for the
        draft's (float32) layers.
    """
    draft = 0 if draft_config is None else (2 * draft_config.num_hidden_layers * draft_config.num_key_value_heads
                                            * draft_config.head_dim * FLOAT32_BYTES)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * target_itemsize + draft


def default_kv_budget(context_length: int, bytes_per_token: int) -> int:
    """``DEFAULT_KV_BUDGET_CONTEXTS`` full contexts, bytes."""
    return DEFAULT_KV_BUDGET_CONTEXTS * context_length * bytes_per_token


class KVBudget:
    """The KV memory budget of one engine, and the positions its pool holds.

    Args:
        engine: the engine's name (in ``KVBudgetError``).
        context_length: the model's context, tokens.
        bytes_per_token: ``kv_bytes_per_token`` of the target (and draft).
        headroom: positions a verify pass writes past the last kept token before rolling back
            (``block_size - 1`` with speculative decoding, else 0).
        budget: bytes of KV cache the engine's sequences hold together at most; None:
            ``default_kv_budget``.

    Raises:
        InvalidRequestError: ``budget`` not a positive integer (param ``kv_budget``).
    """

    def __init__(self, engine: str, context_length: int, bytes_per_token: int, headroom: int,
                 budget: int | None = None):
        self.engine = engine
        self.context_length = context_length
        self.bytes_per_token = bytes_per_token
        self.headroom = headroom
        self.budget = (default_kv_budget(context_length, bytes_per_token) if budget is None
                       else positive_int(budget, "kv_budget"))

    @property
    def positions(self) -> int:
        """Positions the budget holds: what the engine's pool is made for."""
        return self.budget // self.bytes_per_token

    def generated_tokens(self, n_prompt: int, max_tokens: int | None, block_tokens: int, n: int = 1) -> int:
        """Generated tokens each of a request's ``n`` choices may have: ``max_tokens``; when None,
        all the context leaves (or, if that is less, all the pool leaves to each of the ``n``
        sequences alone: only where the budget holds less than ``n`` contexts).

        Args:
            block_tokens: positions per block of the engine's pool (a sequence holds whole blocks).

        Raises:
            ContextLengthError: ``n_prompt + max_tokens > context``, or with ``max_tokens`` None a
                prompt that fills the whole context.
            KVBudgetError: the ``n`` sequences at their longest would not fit in the pool alone.
        """
        room = self.context_length - n_prompt
        pool_blocks = self.positions // block_tokens
        if max_tokens is None:
            if room < 1:
                raise ContextLengthError(prompt_tokens=n_prompt, max_tokens=None, context_length=self.context_length)
            kv_room = pool_blocks // n * block_tokens - n_prompt - self.headroom
            wanted = max(min(room, kv_room), 1)
        else:
            wanted = max_tokens
        if wanted > room:
            raise ContextLengthError(prompt_tokens=n_prompt, max_tokens=wanted, context_length=self.context_length)
        blocks = -(-min(self.context_length, n_prompt + wanted + self.headroom) // block_tokens)
        if n * blocks > pool_blocks:
            raise KVBudgetError(engine=self.engine, prompt_tokens=n_prompt, max_tokens=wanted,
                                need_bytes=n * blocks * block_tokens * self.bytes_per_token, budget_bytes=self.budget,
                                bytes_per_token=self.bytes_per_token, n=n)
        return wanted


def positive_int(value, name: str) -> int:
    """``value`` (an int, or a string of decimal digits) as an int >= 1.

    Raises:
        InvalidRequestError: anything else, naming ``name``.
    """
    number = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
    return number
