"""The distillation loss and the warm start (flm_train.train): a one-hot top-k makes the loss on
the target's distribution equal the loss on its tokens (so the offsets line up); shards without
top-k are refused for ``--distill``; ``--init-draft`` starts from an exported draft exactly, refuses
one of another shape, and the next export records the draft it started from and that one's
training."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch", reason="torch (the [train] extra) is not installed; CI leaves it out, see README")

from flm_train.export import export_from_checkpoint, read_draft, write_draft
from flm_train.pipeline import parse_args
from flm_train.train import draft_loss, train
from test_train_draft import V, tiny_draft
from test_train_resume import write_shard


def block_batch(top: str | None):
    """A batch in ``Shards.batch``'s layout for the tiny draft; ``top``: None, ``"one-hot"`` (all the
    mass on the next token) or ``"shuffled"`` (on another token)."""
    g = torch.Generator().manual_seed(0)
    b, t, k = 2, 30, 4
    draft = tiny_draft(layers=1, seed=0)
    taps = torch.randn(b, t, draft.fc.in_features, generator=g)
    tokens = torch.randint(0, V, (b, t), generator=g)
    lengths = torch.tensor([t, 25])
    anchors, valid = torch.tensor([[3, 20, 26], [5, 19, 22]]), torch.tensor([[True, True, True], [True, True, False]])
    soft = None
    if top is not None:
        nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # the token after each position
        first = nxt if top == "one-hot" else (nxt + 1) % V
        ids = torch.cat([first[:, :, None], torch.randint(0, V, (b, t, k - 1), generator=g)], 2)  # [B, T, k]
        logp = torch.full((b, t, k), -math.inf)
        logp[:, :, 0] = 0.0
        soft = ids, logp
    return draft, (taps, tokens, lengths, anchors, valid, soft)


def test_a_one_hot_distribution_on_the_next_token_gives_the_token_loss():
    draft, batch = block_batch("one-hot")
    hard, _ = draft_loss(draft, batch, gamma=4.0)
    for distill in (0.5, 1.0):
        soft, _ = draft_loss(draft, batch, gamma=4.0, distill=distill)
        torch.testing.assert_close(soft, hard)
    draft, batch = block_batch("shuffled")  # the mass one token off: another loss
    assert abs(draft_loss(draft, batch, gamma=4.0, distill=1.0)[0].item() - draft_loss(draft, batch, gamma=4.0)[0].item()) > 0.1


def test_distill_needs_shards_with_the_targets_top_k():
    draft, batch = block_batch(None)
    with pytest.raises(ValueError, match="--distill needs shards with the target's top-k"):
        draft_loss(draft, batch, gamma=4.0, distill=0.5)


def args(out, steps: int, *extra: str):
    return parse_args(["--out", str(out), "--steps", str(steps), "--layers", "1", "--draft-vocab", "256",
                       "--batch-seqs", "2", "--anchors", "4", "--eval-every", "2", "--eval-seqs", "2",
                       "--threads", "1", "--ckpt-minutes", "60", *extra])


def test_a_warm_start_begins_at_the_exported_draft_and_distils(tmp_path, smollm2_gguf):
    from flm_runtime.models.dflash import DFlashConfig
    from flm_train.draft import DFlashDraft

    (tmp_path / "data").mkdir()
    paths = [tmp_path / "data" / f"shard_{k:04d}.npz" for k in range(3)]
    for k, p in enumerate(paths):
        write_shard(p, seed=k, top_k=16)
    train(args(tmp_path / "first", 2), paths[:2], paths[2:])
    ck = torch.load(tmp_path / "first" / "ckpt" / "last.pt", weights_only=False)
    config = DFlashConfig.from_dict(ck["draft_config"])
    dummy = torch.zeros(49152, config.hidden_size)
    first = DFlashDraft(config, dummy, dummy, ck["model"]["draft_vocab"])
    first.load_state_dict(ck["model"])
    exported = write_draft(tmp_path / "export", config, first.export_state(), target="smollm2:135m",
                           target_sha256=None, training={"note": "the first run"})

    # --lr 0: one step moves nothing, so the checkpoint holds the warm start itself.
    train(args(tmp_path / "warm", 1, "--init-draft", str(exported), "--lr", "0", "--distill", "0.5"),
          paths[:2], paths[2:])
    warm = torch.load(tmp_path / "warm" / "ckpt" / "last.pt", weights_only=False)
    again = DFlashDraft(config, dummy, dummy, warm["model"]["draft_vocab"])
    again.load_state_dict(warm["model"])
    _, file_state, file_training = read_draft(exported)
    for name, value in again.export_state().items():
        torch.testing.assert_close(value, file_state[name], rtol=1e-3, atol=1e-5)  # through float16 and back
    assert not torch.equal(warm["model"]["tap_scale"], torch.ones_like(warm["model"]["tap_scale"]))
    start, after = warm["history"]  # evaluated before the first step, and after it
    assert start["step"] == 0 and start["sim_al"] == after["sim_al"]
    a = args(tmp_path / "warm", 1, "--export-dir", str(tmp_path / "warm-export"))
    training = json.loads((export_from_checkpoint(a) / "config.json").read_text())["training"]
    assert file_training == {"note": "the first run"}
    assert training["warm_start"] == {"draft": str(exported), "training": file_training}  # the lineage is kept

    with pytest.raises(SystemExit, match="differs from the one asked"):
        train(args(tmp_path / "deeper", 1, "--init-draft", str(exported), "--layers", "2"), paths[:2], paths[2:])


@pytest.mark.parametrize("value, message", [("1.5", "1.5 is outside [0, 1]"), ("half", "'half' is not a number")])
def test_a_bad_distill_weight_is_refused_with_its_reason(value, message, capsys):
    with pytest.raises(SystemExit):  # argparse: a usage error, not a traceback
        parse_args(["--distill", value])
    assert message in capsys.readouterr().err
