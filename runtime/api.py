"""The runtime's plain Python API: model tag -> loaded model -> engine.

    from flm_runtime.api import get_engine
    from flm_runtime.engine.request import SamplingParams

    engine = get_engine("smollm2:135m")           # pulls the embedded default on first use
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    print(engine.submit(ids, SamplingParams(max_tokens=64)).result().text)

One engine per tag per process, created on first use and shared by every caller (the LiteLLM
handler, the CLI, tests). Loading holds a lock so concurrent first calls load once.

A DFlash tag (``X-dflash:size``) gets its own engine that decodes speculatively with the draft of
``registry.locate_draft(tag)``, over the *same* ``LlamaModel`` object as the base tag's engine: a
target is loaded once per process whichever of the two tags comes first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from flm_runtime import registry
from flm_runtime.engine.engine import Engine
from flm_runtime.engine.speculative import SpeculativeDecoder
from flm_runtime.loading import Tokenizer, load_model_files
from flm_runtime.models.dflash import DFlashDraft
from flm_runtime.models.llama import LlamaModel

_lock = threading.Lock()
_engines: dict[str, Engine] = {}


@dataclass(frozen=True)
class LoadedModel:
    """A target model ready to run, with its tokenizer (chat template included)."""

    tag: str
    model: LlamaModel
    tokenizer: Tokenizer


_targets: dict[str, LoadedModel] = {}  # canonical plain tag -> its loaded model, shared by engines


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


def load_draft(tag: str, target: LlamaModel) -> DFlashDraft:
    """Load the DFlash draft of ``tag`` for ``target`` (the base tag's loaded model).

    The draft's ``target_sha256`` is compared with the base entry's recorded sha256 (which
    ``registry.locate`` has verified on the file) when the base is one file with a recorded hash;
    otherwise only the geometry is checked (an HF directory has no single recorded hash).

    Raises:
        ModelFilesMissingError: the draft's files are absent.
        ModelFormatError: unreadable draft files, or a draft that does not fit ``target``.
    """
    entry = registry.resolve(tag)
    assert entry.base is not None, f"{tag} is not a DFlash tag"
    base = registry.resolve(entry.base)
    sha = base.files[0].sha256 if len(base.files) == 1 else None
    return DFlashDraft.load(registry.locate_draft(tag), target, target_sha256=sha)


def get_engine(tag: str) -> Engine:
    """The process-wide engine serving ``tag``, loading the model on first use.

    Raises:
        the errors of ``load_model`` (and of ``load_draft`` for a DFlash tag).
    """
    with _lock:
        engine = _engines.get(tag)
        if engine is None:
            entry = registry.resolve(tag)
            if entry.is_dflash:
                assert entry.base is not None
                registry.locate(tag)  # the draft's and the base's files, pulling the base if need be
                loaded = _target(entry.base)
                speculative = SpeculativeDecoder(loaded.model, load_draft(tag, loaded.model))
            else:
                loaded, speculative = _target(entry.tag), None
            sampling = registry.resolve(entry.base or entry.tag).sampling  # a draft keeps its target's
            engine = Engine(loaded.model, loaded.tokenizer, name=tag, speculative=speculative,
                            default_sampling=sampling)
            _engines[tag] = engine
        return engine


def _target(tag: str) -> LoadedModel:
    """The loaded model of plain ``tag`` (canonical), loaded once per process (lock held)."""
    loaded = _targets.get(tag)
    if loaded is None:
        loaded = _targets[tag] = load_model(tag)
    return loaded
