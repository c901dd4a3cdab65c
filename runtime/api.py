"""The runtime's plain Python API: model tag -> loaded model -> engine.

    from flm_runtime.api import get_engine
    from flm_runtime.engine.request import SamplingParams

    engine = get_engine("smollm2:135m")           # pulls the embedded default on first use
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    print(engine.submit(ids, SamplingParams(max_tokens=64)).result().text)

One engine per tag per process, created on first use and shared by every caller (the LiteLLM
handler, the CLI, tests). Loading holds a lock so concurrent first calls load once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from flm_runtime import registry
from flm_runtime.engine.engine import Engine
from flm_runtime.loading import Tokenizer, load_model_files
from flm_runtime.models.llama import LlamaModel

_lock = threading.Lock()
_engines: dict[str, Engine] = {}


@dataclass(frozen=True)
class LoadedModel:
    """A target model ready to run, with its tokenizer (chat template included)."""

    tag: str
    model: LlamaModel
    tokenizer: Tokenizer


def load_model(tag: str) -> LoadedModel:
    """Locate (pulling if needed) and load the model of ``tag`` on the cpu backend.

    Raises:
        UnknownModelError: no registry defines ``tag``.
        ModelFilesMissingError: its files are absent and cannot be pulled.
        ModelDownloadError: pulling failed.
        ModelFormatError: the files are unreadable or unsupported.
    """
    bundle = load_model_files(registry.locate(tag))
    return LoadedModel(tag, LlamaModel(bundle.config, bundle.weights), bundle.tokenizer)


def get_engine(tag: str) -> Engine:
    """The process-wide engine serving ``tag``, loading the model on first use.

    Raises:
        the errors of ``load_model``.
    """
    with _lock:
        engine = _engines.get(tag)
        if engine is None:
            loaded = load_model(tag)
            engine = Engine(loaded.model, loaded.tokenizer, name=tag)
            _engines[tag] = engine
        return engine
