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
kernels.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it (read through a string: the package's own modules never
# import this file, so the public face adds no edge to their import graph)
_SOURCES = {
    # the runtime object: engines per tag, loaded models, settings
    "Runtime": "flm_runtime.api",
    "default_runtime": "flm_runtime.api",
    "get_engine": "flm_runtime.api",
    "with_output_limit": "flm_runtime.api",
    "drain": "flm_runtime.api",
    "load_model": "flm_runtime.api",
    "load_draft": "flm_runtime.speculation.decoders",
    "LoadedModel": "flm_runtime.api",
    "Settings": "flm_runtime.settings",
    "requested_backend": "flm_runtime.settings",
    # engines and what flows through them
    "Engine": "flm_runtime.scheduling.engine",
    "StepTiming": "flm_runtime.scheduling.engine",
    "RequestHandle": "flm_runtime.scheduling.handle",
    "SpeculativeDecoder": "flm_runtime.speculation.speculative",
    "SamplingParams": "flm_runtime.request",
    "Completion": "flm_runtime.request",
    "StreamEvent": "flm_runtime.request",
    "TokenLogprob": "flm_runtime.request",
    "RequestStats": "flm_runtime.request",
    "SpecStats": "flm_runtime.request",
    "SamplingDefaults": "flm_runtime.sampling.sampler",
    "FALLBACK_SAMPLING": "flm_runtime.sampling.sampler",
    "choice_seed": "flm_runtime.sampling.sampler",
    # structured output and tools
    "compiler_for": "flm_runtime.sampling.grammar",
    "json_object_grammar": "flm_runtime.sampling.grammar",
    "json_schema_grammar": "flm_runtime.sampling.grammar",
    "lark_grammar": "flm_runtime.sampling.grammar",
    "ToolCall": "flm_runtime.text.tool_format",
    "ToolCallStream": "flm_runtime.text.tool_format",
    "chat_messages": "flm_runtime.text.tool_format",
    "check_tools": "flm_runtime.text.tool_format",
    "chosen_functions": "flm_runtime.text.tool_format",
    "marker_token_ids": "flm_runtime.text.tool_format",
    "parse_tool_calls": "flm_runtime.text.tool_format",
    "tool_grammar": "flm_runtime.text.tool_format",
    "ThinkingFormat": "flm_runtime.loading.chat_template",
    # models on disk
    "list_entries": "flm_runtime.registry",
    "ModelEntry": "flm_runtime.registry",
    # embeddings
    "embed": "flm_runtime.embedding",
    # errors
    "FlmError": "flm_runtime.errors",
    "InvalidRequestError": "flm_runtime.errors",
    "ContextLengthError": "flm_runtime.errors",
    "KVBudgetError": "flm_runtime.errors",
    "NoChatTemplateError": "flm_runtime.errors",
    "UnknownModelError": "flm_runtime.errors",
    "ModelFilesMissingError": "flm_runtime.errors",
    "ModelDownloadError": "flm_runtime.errors",
    "ModelFormatError": "flm_runtime.errors",
    "EngineOverloadedError": "flm_runtime.errors",
    "RequestTimeoutError": "flm_runtime.errors",
    "BackendUnavailableError": "flm_runtime.errors",
    "EngineDrainingError": "flm_runtime.errors",
    "DiskSpaceError": "flm_runtime.errors",
    "EngineFaultError": "flm_runtime.errors",
    "RequestCancelledError": "flm_runtime.scheduling.handle",
}

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
