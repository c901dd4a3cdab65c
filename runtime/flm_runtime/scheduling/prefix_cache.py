"""Prefix caching over the engine's paged KV pool: full blocks named by their tokens, reused by
any later request whose prompt starts with the same tokens.

LiteLLM is stateless: a chat client, an agent or a RAG app resends the whole conversation every
turn, and requests share system prompts and tool definitions. When a sequence's prompt is in its
cache, and again when it ends or is preempted, its full blocks are registered in the pool under
the digests of the tokens they end (``kv_cache.block_digests``: each digest chains the previous
block's, so it names the whole prefix). A new request looks its prompt's digests up in order and
takes the blocks found, up to the first miss, instead of computing them, as vLLM's automatic
prefix caching does; the cached positions are shared, never copied, by any number of requests.
At least the prompt's last token is always computed (its logits give the first token).

A position's keys and values depend only on the tokens up to it, and the quantized path computes
a row the same bits whatever rows run beside it and whatever blocks hold its context
(docs/design.md, "Batch invariance"), so a request served from cached blocks gets the logits it
gets cold, bit for bit. Unreferenced registered blocks stay in the pool until a sequence needs a
block and no free one is left: the least recently used go first (``BlockPool.allocate``).

Not thread-safe: the engine calls these with its lock held.
"""

from __future__ import annotations

import numpy as np

from flm_runtime.kv_cache import BlockPool, BlockTable, block_digests


def take(pool: BlockPool, prompt_ids: np.ndarray) -> tuple[list[int], int]:
    """The registered blocks holding the longest prefix of ``prompt_ids`` (``[T]`` int; never its
    last token), each with one reference more, and the positions they hold."""
    blocks = []
    for digest in block_digests(prompt_ids[:-1], pool.block_tokens):
        block = pool.lookup(digest)
        if block is None:
            break
        blocks.append(block)
    return blocks, len(blocks) * pool.block_tokens


def keep(table: BlockTable, tokens: np.ndarray) -> None:
    """Register the full blocks of ``table``, which holds ``tokens`` (``[table.length]`` int: the
    prompt and the generated tokens fed back), under their digests."""
    assert tokens.size == table.length, f"{tokens.size} tokens for a cache of {table.length} positions"
    for block, digest in zip(table.full_blocks(), block_digests(tokens, table.pool.block_tokens)):
        table.pool.register(block, digest)
