"""The draft shipped for ``smollm2-dflash:135m`` (exported by flm_train) loads in the serving runtime
and proposes tokens; its config says how it was trained. Needs neither torch nor flm_train."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flm_runtime import paths
from flm_runtime.models.dflash import DFlashDraft

DRAFT = paths.package_dir() / "drafts" / "smollm2-135m-dflash"


@pytest.fixture(scope="module")
def shipped():
    if not (DRAFT / "config.json").exists():
        pytest.skip(f"{DRAFT} not exported yet (python -m flm_train.pipeline)")
    return DRAFT


def test_config_records_its_training(shipped):
    config = json.loads((shipped / "config.json").read_text())
    assert config["architecture"] == "dflash-llama" and config["target"] == "smollm2:135m"
    assert config["target_layer_ids"] == [1, 8, 14, 20, 27] and config["block_size"] == 8
    assert {"data", "steps_trained", "exported", "command"} <= set(config["training"])
    assert (shipped / "model.safetensors").stat().st_size < 40_000_000  # float16, a few layers at most


def test_loads_against_the_target_and_proposes(shipped, smollm2_model, smollm2_gguf):
    from flm_runtime import registry

    draft = DFlashDraft.load(shipped, smollm2_model, target_sha256=registry.sha256_of(smollm2_gguf))
    cache = draft.new_cache()
    taps = np.zeros((3, 5 * 576), dtype=np.float32)
    draft.add_context(cache, taps, 0)
    ids = draft.draft_block(cache, anchor_id=42, start=3)
    assert ids.shape == (7,) and ((0 <= ids) & (ids < 49152)).all()
