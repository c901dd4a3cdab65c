"""Fixtures of the benchmark-command tests: a random DFlash draft for smollm2:135m (the trained
draft does not exist in the test suite) and a runner of ``litellm-flm`` command lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flm_runtime import api, cli

# The draft-file writer lives beside the model tests (tests/models).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dflash_files import draft_config_dict, random_draft_weights, write_draft_dir  # noqa: E402

DFLASH_TAG = "smollm2-dflash:135m"


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory, smollm2_model) -> Path:
    """A 1-layer random draft directory of smollm2:135m's geometry (it proposes near-random tokens:
    speculation is slower than plain decoding with it, but exact)."""
    cfg = draft_config_dict(smollm2_model.config, layers=1, mask_token_id=0, target_tag="smollm2:135m")
    return write_draft_dir(tmp_path_factory.mktemp("draft"), cfg, random_draft_weights(cfg, seed=5, scale=0.05))


@pytest.fixture
def run_cli(capsys):
    """``run_cli(*argv) -> (exit status, stdout, stderr)`` of ``litellm-flm argv``."""

    def run(*argv: str) -> tuple[int, str, str]:
        status = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def forget_dflash_engine():
    """Drop the process-wide engine of the DFlash tag after a test that served it with a test draft
    (later tests must not find the random draft behind the real tag)."""
    yield DFLASH_TAG
    api.default_runtime.forget(DFLASH_TAG)
