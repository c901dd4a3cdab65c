"""The training loop's data and checkpoints: shards' taps are memory-mapped, not read in, or
recomputed by the served target for shards generated without them (the same taps, the same run); a
run stopped and resumed equals one run straight through; the best draft is forgotten when the held-out
shards change (its AL would not be comparable); a checkpoint resumed with more ``--layers`` grows
by identity layers; ``--schedule-from`` restarts the LR schedule."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the [train] extra) is not installed; CI leaves it out, see README")

from flm_train.pipeline import parse_args
from flm_train.train import Shards, load_or_grow, lr_at, mmap_npz_array, train

TAPS_WIDTH = 5 * 576  # SmolLM2-135M: 5 tapped layers x hidden 576


def write_shard(path, seed: int, n: int = 6, prompt_len: int = 8, length: int = 40, top_k: int = 0) -> None:
    """A shard of random tokens and taps; with ``top_k``, random top-k rows (descending log-probabilities)."""
    rng = np.random.default_rng(seed)
    arrays = dict(tokens=rng.integers(0, 49152, n * length).astype(np.int32),
                  offsets=np.arange(0, (n + 1) * length, length).astype(np.int64),
                  prompt_lens=np.full(n, prompt_len, np.int32), prompt_ids=np.arange(n, dtype=np.int32),
                  greedy=np.ones(n, bool), taps=rng.normal(0, 3, (n * length, TAPS_WIDTH)).astype(np.float16))
    if top_k:
        logits = -np.sort(-rng.normal(0, 2, (n * length, top_k)), axis=1)
        arrays["top_ids"] = rng.integers(0, 49152, (n * length, top_k)).astype(np.int32)
        arrays["top_logprobs"] = (logits - np.log(np.exp(logits).sum(1, keepdims=True)) - 0.1).astype(np.float16)
    np.savez(path, **arrays)


@pytest.fixture
def shards(tmp_path, smollm2_gguf):
    (tmp_path / "data").mkdir()
    paths = [tmp_path / "data" / f"shard_{k:04d}.npz" for k in range(3)]
    for k, p in enumerate(paths):
        write_shard(p, seed=k)
    return paths


def test_shard_taps_are_memory_mapped_and_equal_to_the_stored_arrays(tmp_path):
    path = tmp_path / "shard.npz"
    write_shard(path, seed=0)
    data = Shards([path])
    stored = np.load(path)
    assert isinstance(data.taps[0], np.memmap)
    assert data.taps[0].dtype == np.float16 and np.array_equal(data.taps[0], stored["taps"])
    assert np.array_equal(mmap_npz_array(path, "offsets"), stored["offsets"])
    np.savez_compressed(tmp_path / "z.npz", taps=stored["taps"])
    with pytest.raises(ValueError, match="taps is compressed"):
        mmap_npz_array(tmp_path / "z.npz", "taps")
    with pytest.raises(KeyError):
        mmap_npz_array(path, "logits")


def run(out, steps: int, train_paths, heldout_paths, layers: int = 1) -> dict:
    a = parse_args(["--out", str(out), "--steps", str(steps), "--layers", str(layers), "--draft-vocab", "256",
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


def test_a_grown_draft_starts_exactly_where_the_smaller_one_was():
    from test_train_draft import V, tiny_draft

    small = tiny_draft(layers=1, seed=0)
    big = tiny_draft(layers=3, seed=0)  # the same target embedding (a buffer the state does not carry)
    assert load_or_grow(big, small.state_dict()) == 2
    taps, tokens = torch.randn(2, 20, small.fc.in_features), torch.randint(0, V, (2, 24))
    anchors = torch.tensor([[3, 11], [5, 19]])
    assert torch.allclose(big.hidden(taps, tokens, anchors), small.hidden(taps, tokens, anchors), atol=1e-5)
    with pytest.raises(ValueError, match="has 3 layers, more than --layers 1"):
        load_or_grow(small, big.state_dict())


def test_resuming_with_more_layers_grows_the_draft_and_forgets_the_best(tmp_path, shards):
    out = tmp_path / "run"
    run(out, 2, shards[:2], shards[2:])
    grown = run(out, 4, shards[:2], shards[2:], layers=2)
    assert grown["draft_config"]["num_hidden_layers"] == 2
    assert "layers.1.o_proj.weight" in grown["model"]
    assert grown["best"]["step"] == 4  # the 1-layer best (step 2) could not be exported as a 2-layer draft


def test_the_lr_schedule_restarts_at_schedule_from():
    a = parse_args(["--lr", "1e-3", "--warmup", "100", "--steps", "1000"])
    assert a.schedule_from == 0
    assert [lr_at(step, a) for step in (0, 99, 1000, 2000)] == pytest.approx([1e-5, 1e-3, 1e-4, 1e-4])
    assert lr_at(550, a) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + np.cos(np.pi * 450 / 900))))
    a = parse_args(["--lr", "1e-3", "--warmup", "100", "--steps", "1000", "--schedule-from", "500"])
    # warmup again from step 500, then the cosine over the 400 steps left
    assert [lr_at(step, a) for step in (500, 599, 800, 1000)] == pytest.approx([1e-5, 1e-3, 5.5e-4, 1e-4])


@pytest.fixture(scope="module")
def shards_with_and_without_taps(tmp_path_factory, smollm2_quantized, smollm2_tokenizer):
    """The same three shards of SmolLM2's (quantized) responses, generated with taps and without."""
    from flm_runtime.sampling.sampler import FALLBACK_SAMPLING
    from flm_train.generate import default_tap_layers, generate_shard

    tok = smollm2_tokenizer
    prompts = ["Name a large animal.", "Say hello in French.", "What is two plus two?", "Name a colour.",
               "Give me a word that rhymes with cat.", "What do bees make?"]
    items = [(i, tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])), i % 4 != 3)
             for i, p in enumerate(prompts)]
    out = {}
    for name, with_taps in (("full", True), ("lean", False)):
        data = tmp_path_factory.mktemp(name) / "data"
        data.mkdir()
        out[name] = [data / f"shard_{k:04d}.npz" for k in range(3)]
        for k, path in enumerate(out[name]):
            np.savez(path, **generate_shard(smollm2_quantized, items[2 * k: 2 * k + 2], tap_layers=default_tap_layers(30),
                                            max_new=12, slots=2, seed=0, sampling=FALLBACK_SAMPLING.resolve(),
                                            with_taps=with_taps))
    return out["full"], out["lean"]


def test_shards_without_taps_have_them_recomputed_as_generation_stores_them(shards_with_and_without_taps,
                                                                            smollm2_quantized):
    from flm_train.generate import default_tap_layers

    full_paths, lean_paths = shards_with_and_without_taps
    with pytest.raises(ValueError, match="holds no taps"):
        Shards(lean_paths)
    full, lean = Shards(full_paths), Shards(lean_paths, (smollm2_quantized, default_tap_layers(30)))
    assert lean.seqs == full.seqs and all(t is None for t in lean.taps)
    anchors = [np.arange(s.prompt_len, s.length - 1) for s in full.seqs]
    want, got = full.batch(full.seqs, anchors), lean.batch(lean.seqs, anchors)
    assert all(torch.equal(a, b) for a, b in zip(want[:5] + want[5], got[:5] + got[5]))
    assert torch.equal(full.tap_rms(), lean.tap_rms(group=4))


def test_training_on_shards_without_taps_equals_training_on_the_stored_taps(tmp_path, shards_with_and_without_taps,
                                                                            monkeypatch):
    monkeypatch.setenv("FLM_WEIGHTS", "auto")  # the served weights, as the shards were generated with
    full_paths, lean_paths = shards_with_and_without_taps
    full = run(tmp_path / "full", 2, full_paths[:2], full_paths[2:])
    lean = run(tmp_path / "lean", 2, lean_paths[:2], lean_paths[2:])
    assert full["history"] == lean["history"]
    for name, value in full["model"].items():
        assert torch.equal(lean["model"][name], value), name
