"""The training loop's checkpoints: a run stopped and resumed equals one run straight through, and
the best draft is forgotten when the held-out shards change (its AL would not be comparable)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flm_train", reason="flm_train (the training/ directory) is not installed")

from flm_train.pipeline import parse_args
from flm_train.train import train

TAPS_WIDTH = 5 * 576  # SmolLM2-135M: 5 tapped layers x hidden 576


def write_shard(path, seed: int, n: int = 6, prompt_len: int = 8, length: int = 40) -> None:
    rng = np.random.default_rng(seed)
    np.savez(path, tokens=rng.integers(0, 49152, n * length).astype(np.int32),
             offsets=np.arange(0, (n + 1) * length, length).astype(np.int64),
             prompt_lens=np.full(n, prompt_len, np.int32), prompt_ids=np.arange(n, dtype=np.int32),
             greedy=np.ones(n, bool), taps=rng.normal(0, 3, (n * length, TAPS_WIDTH)).astype(np.float16))


@pytest.fixture
def shards(tmp_path, smollm2_gguf):
    (tmp_path / "data").mkdir()
    paths = [tmp_path / "data" / f"shard_{k:04d}.npz" for k in range(3)]
    for k, p in enumerate(paths):
        write_shard(p, seed=k)
    return paths


def run(out, steps: int, train_paths, heldout_paths) -> dict:
    a = parse_args(["--out", str(out), "--steps", str(steps), "--layers", "1", "--draft-vocab", "256",
                    "--batch-seqs", "2", "--anchors", "4", "--eval-every", "2", "--eval-seqs", "2", "--threads", "1",
                    "--ckpt-minutes", "60"])
    train(a, train_paths, heldout_paths)
    return torch.load(out / "ckpt" / "last.pt", weights_only=False)


def test_stopping_and_resuming_equals_training_straight_through(tmp_path, shards):
    # Warmup is 100 steps, so the LR of steps 0-3 does not depend on --steps.
    straight = run(tmp_path / "a", 4, shards[:2], shards[2:])
    run(tmp_path / "b", 2, shards[:2], shards[2:])
    resumed = run(tmp_path / "b", 4, shards[:2], shards[2:])
    assert resumed["step"] == straight["step"] == 4
    for name, value in straight["model"].items():
        assert torch.equal(resumed["model"][name], value), name


def test_the_best_draft_is_forgotten_when_the_held_out_shards_change(tmp_path, shards):
    out = tmp_path / "run"
    first = run(out, 4, shards[:2], shards[2:])
    assert first["heldout"] == ["shard_0002.npz"]
    assert first["best"]["step"] == 2  # random tokens: AL 1.0 at every evaluation, the first one stays
    assert run(out, 6, shards[:2], shards[2:])["best"]["step"] == 2
    moved = run(out, 8, shards[1:], shards[:1])
    assert moved["heldout"] == ["shard_0000.npz"]
    assert moved["best"]["step"] == 8  # the only evaluation on the new held-out shard
