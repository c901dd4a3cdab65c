"""flm_runtime: a local LLM runtime (numpy cpu backend, pyxrt npu backend) with DFlash speculative
decoding. Usable without LiteLLM; ``litellm_flm`` is a thin layer on top.

The names below are the runtime's public face: what the LiteLLM provider, the benchmarks and the
training pipeline build on. Everything else is the runtime's own and may move::

    from flm_runtime import SamplingParams, get_engine

    engine = get_engine("smollm2:135m")           # pulls the embedded default on first use
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    print(engine.submit(ids, SamplingParams(max_tokens=64)).result().text)

Each name is imported on first use (PEP 562), so ``import flm_runtime`` loads none of the
subpackages, and a caller that only needs the error types or ``SamplingParams`` never loads the
kernels; the ``TYPE_CHECKING`` imports below name each one's module, for readers, type checkers and
the import graph alike.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the public names: each imported on first use (``__getattr__``, which reads this block)
    # the runtime object: engines per tag, loaded models, settings
    from flm_runtime.api import LoadedModel, Runtime, default_runtime, drain, get_engine, load_model, with_output_limit
    from flm_runtime.settings import Settings, requested_backend
    from flm_runtime.speculation.decoders import load_draft
    # engines and what flows through them
    from flm_runtime.request import Completion, RequestStats, SamplingParams, SpecStats, StreamEvent, TokenLogprob
    from flm_runtime.sampling.sampler import FALLBACK_SAMPLING, SamplingDefaults, choice_seed
    from flm_runtime.scheduling.engine import Engine, StepTiming
    from flm_runtime.scheduling.handle import RequestHandle
    from flm_runtime.speculation.speculative import SpeculativeDecoder
    # structured output and tools
    from flm_runtime.loading.chat_template import ThinkingFormat
    from flm_runtime.sampling.grammar import compiler_for, json_object_grammar, json_schema_grammar, lark_grammar
    from flm_runtime.text.tool_format import (ToolCall, ToolCallStream, chat_messages, check_tools, chosen_functions,
                                              marker_token_ids, parse_tool_calls, tool_grammar)
    # models on disk
    from flm_runtime.registry import ModelEntry, list_entries
    # embeddings
    from flm_runtime.embedding import embed
    # errors
    from flm_runtime.errors import (BackendUnavailableError, ContextLengthError, DiskSpaceError, EngineDrainingError,
                                    EngineFaultError, EngineOverloadedError, FlmError, InvalidRequestError,
                                    KVBudgetError, ModelDownloadError, ModelFilesMissingError, ModelFormatError,
                                    NoChatTemplateError, RequestTimeoutError, UnknownModelError)
    from flm_runtime.scheduling.handle import RequestCancelledError


def _sources() -> dict[str, str]:
    """name -> the module that defines it, read from the ``TYPE_CHECKING`` block above: one table
    for readers, tools and ``__getattr__`` (the package's own modules never import this file, so
    the public face adds no edge that runs back into them)."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    return {alias.name: node.module for node in block.body for alias in node.names}


_SOURCES = _sources()
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
