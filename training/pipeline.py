"""The whole DFlash training pipeline, idempotent and resumable: one command.

    python -m flm_train.pipeline --target smollm2:135m --out /work/flm-train-data

Stages (each skipped when its output is complete; rerunning after a crash or a session's end
continues where it stopped):

1. ``prompts``: ``prompts.jsonl`` from ``flm_train.prompts`` (the ``--prompts`` mix of sources),
   checked against MT-Bench (8-grams) and against the prompts of the shards already generated.
2. ``generate``: shards ``data/shard_*.npz`` of the target's responses with their taps, written by
   ``--workers`` processes (one torch thread each; see docs/training.md for why).
3. ``taps``: checks on a sample that the taps recorded during generation equal a single causal
   forward over prompt+response (``taps_check.json``).
4. ``train``: ``flm_train.train`` (checkpoints in ``ckpt/``, resumes automatically).
5. ``export``: the draft directory (``config.json`` + ``model.safetensors``) where the registry
   expects the draft of ``<family>-dflash:<size>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("flm_train")

DEFAULT_MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def _mix(spec: str) -> str:
    """``--prompts``, checked and normalised (``parse_mix``); kept as text, as checkpoints record it."""
    from flm_train.prompts import parse_mix

    try:
        return ",".join(f"{source}:{n}" for source, n in parse_mix(spec))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    """A float in [0, 1] (``--distill``)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"{x} is outside [0, 1]")
    return x


def n_prompts(a: argparse.Namespace) -> int:
    from flm_train.prompts import parse_mix

    return sum(n for _, n in parse_mix(a.prompts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flm_train.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2:135m", help="registry tag of the target")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("FLM_TRAIN_DIR", "/work/flm-train-data")))
    p.add_argument("--mt-bench", type=Path, default=DEFAULT_MT_BENCH, help="MT-Bench questions (overlap check)")
    p.add_argument("--prompts", type=_mix, default="templates:640", metavar="SOURCE:N,...",
                   help="prompt sources in order (flm_train.prompts.SOURCES), e.g. templates:2048,composed:1536; "
                        "growing the last count or appending a source extends the same list")
    p.add_argument("--shard-size", type=int, default=64, help="prompts per shard")
    p.add_argument("--max-new", type=int, default=256, help="response tokens at most (MT-Bench AL is measured at 256)")
    p.add_argument("--slots", type=int, default=48, help="sequences decoded together per worker")
    p.add_argument("--workers", type=int, default=2, help="generation processes (one torch thread each)")
    p.add_argument("--greedy-fraction", type=float, default=0.75)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-shards", type=int, default=1, help="last shards kept out of training")
    p.add_argument("--export-dir", type=Path, default=None, help="default: the registry's draft dir")
    p.add_argument("--stages", default="prompts,generate,taps,train,export")
    add_train_args(p)
    return p.parse_args(argv)


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("train")
    g.add_argument("--layers", type=int, default=1, help="draft layers (1-3)")
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence per step")
    g.add_argument("--batch-seqs", type=int, default=4, help="sequences per step")
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--schedule-from", type=int, default=0,
                   help="step at which the LR schedule (warmup, cosine to --steps) starts: a resumed run restarts it")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--norm-lr-mult", type=float, default=10.0,
                   help="LR multiplier of the final norm (it alone sets the logit scale; starts at 0.1x)")
    g.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(k-1)/gamma) at offset k")
    g.add_argument("--threads", type=int, default=2, help="torch threads")
    g.add_argument("--ckpt-minutes", type=float, default=4.0)
    g.add_argument("--eval-every", type=int, default=200)
    g.add_argument("--eval-seqs", type=int, default=32, help="held-out greedy sequences for simulated AL")
    g.add_argument("--mask-token-id", type=int, default=16, help="<empty_output> in SmolLM2")
    g.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the draft can propose: the most frequent in the training responses (0: all)")
    g.add_argument("--init-draft", type=Path, default=None, metavar="DIR",
                   help="start from this exported draft (config.json + model.safetensors) instead of random "
                        "weights, when there is no checkpoint yet; its vocabulary is kept")
    g.add_argument("--distill", type=_fraction, default=0.0,
                   help="weight of the loss on the target's top-k distribution (the rest: its emitted token); "
                        "needs shards with top-k")


# --- stages ---------------------------------------------------------------------------------

def stage_prompts(a: argparse.Namespace) -> list[dict]:
    """The ``--prompts`` list, written to ``prompts.jsonl``.

    Raises:
        SystemExit: a prompt overlaps MT-Bench, or the list differs from the one recorded in
            ``prompts.jsonl`` on a prompt whose shard already exists (a changed mix, or a Python
            whose standard library changes the ``composed`` source; the shards would no longer
            match their prompts).
    """
    from flm_train.prompts import load_mt_bench, make_prompts, overlap_report, parse_mix

    prompts = make_prompts(parse_mix(a.prompts), seed=a.seed)
    path = a.out / "prompts.jsonl"
    if path.exists():
        done = [int(p.stem.split("_")[1]) for p in (a.out / "data").glob("shard_[0-9][0-9][0-9][0-9].npz")]
        covered = (max(done) + 1) * a.shard_size if done else 0
        recorded = [json.loads(line)["prompt"] for line in path.read_text().splitlines()][:covered]
        for p, old in zip(prompts, recorded):
            if p["prompt"] != old:
                raise SystemExit(f"prompt {p['id']} differs from {path} ({old!r} there, {p['prompt']!r} now), "
                                 "and its shard exists: use the mix that made them, or another --out")
    if a.mt_bench.exists():
        hits = overlap_report([p["prompt"] for p in prompts], load_mt_bench(a.mt_bench))
        if hits:
            raise SystemExit(f"{len(hits)} prompts overlap MT-Bench, e.g. {hits[0]!r}")
        log.info("prompts: no 8-gram overlap with %s", a.mt_bench)
    else:
        log.warning("prompts: %s absent, MT-Bench overlap NOT checked", a.mt_bench)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    tmp.rename(path)
    return prompts


def _load_target(tag: str):
    from flm_runtime.loading import load_model_files
    from flm_runtime.pull import locate
    from flm_train.target import TorchLlama

    bundle = load_model_files(locate(tag))
    return bundle, TorchLlama(bundle.config, bundle.weights)


def _generate_worker(a: argparse.Namespace, prompts: list[dict], worker: int) -> None:
    import torch
    from flm_train.generate import run_generation
    from flm_train.target import default_tap_layers

    torch.set_num_threads(1)
    bundle, model = _load_target(a.target)
    n = (len(prompts) + a.shard_size - 1) // a.shard_size
    mine = {k: prompts[k * a.shard_size:(k + 1) * a.shard_size] for k in range(n) if k % a.workers == worker}
    run_generation(model, bundle.tokenizer, mine, a.out / "data", tap_layers=default_tap_layers(bundle.config.num_hidden_layers),
                   max_new=a.max_new, slots=a.slots, greedy_fraction=a.greedy_fraction, seed=a.seed)


def shard_paths(a: argparse.Namespace) -> list[Path]:
    n = (n_prompts(a) + a.shard_size - 1) // a.shard_size
    return [a.out / "data" / f"shard_{k:04d}.npz" for k in range(n)]


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def stage_generate(a: argparse.Namespace, prompts: list[dict]) -> None:
    """Generate the missing shards in ``--workers`` processes.

    The workers end with this stage, however it ends: a worker left running after a ``kill`` of
    the pipeline would write the same shards as a resumed run. SIGTERM is turned into
    ``SystemExit`` for the stage's duration so that its unwinding stops them (a shard is written
    whole or not at all, ``flm_train.generate``); SIGKILL cannot be caught.
    """
    if all(p.exists() for p in shard_paths(a)):
        return
    t0 = time.time()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_generate_worker, args=(a, prompts, w)) for w in range(a.workers)]
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        signal.signal(signal.SIGTERM, previous)
    missing = [p for p in shard_paths(a) if not p.exists()]
    if missing:
        raise SystemExit(f"generation left {len(missing)} shards missing (see the log); rerun to resume")
    log.info("generate: done in %.0f s", time.time() - t0)


def stage_taps(a: argparse.Namespace) -> None:
    """Compare stored taps with one causal forward per sequence on a few sequences of shard 0."""
    import torch
    from flm_train.target import default_tap_layers

    out = a.out / "taps_check.json"
    if out.exists():
        return
    bundle, model = _load_target(a.target)
    layers = default_tap_layers(bundle.config.num_hidden_layers)
    shard = np.load(shard_paths(a)[0])
    worst, t0, n_tok = 0.0, time.time(), 0
    n_seq = min(4, len(shard["prompt_lens"]))
    for i in range(n_seq):
        s, e = shard["offsets"][i], shard["offsets"][i + 1]
        ids = torch.from_numpy(shard["tokens"][s:e - 1].astype(np.int64))  # the last token is never fed
        ref = model.taps_only(ids, layers).reshape(e - s - 1, -1).numpy()  # [T, n*E]
        got = shard["taps"][s:e - 1].astype(np.float32)
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
        n_tok += e - s - 1
    rec = {"sequences": n_seq, "max_abs_diff_over_max_abs": worst, "forward_tokens_per_s": n_tok / (time.time() - t0)}
    log.info("taps check: %s", rec)
    if worst > 5e-3:  # float16 storage alone gives ~5e-4
        raise SystemExit(f"stored taps differ from a causal forward: {rec}")
    out.write_text(json.dumps(rec, indent=1))


def stage_train(a: argparse.Namespace) -> None:
    from flm_train.train import train

    shards = shard_paths(a)
    n_held = a.heldout_shards
    train(a, shards[:-n_held] if n_held else shards, shards[-n_held:] if n_held else [])


def stage_export(a: argparse.Namespace) -> Path:
    from flm_train.export import export_from_checkpoint

    return export_from_checkpoint(a)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(a.out / "pipeline.log")])
    stages = a.stages.split(",")
    prompts = stage_prompts(a)
    if "generate" in stages:
        stage_generate(a, prompts)
    if "taps" in stages:
        stage_taps(a)
    if "train" in stages:
        stage_train(a)
    if "export" in stages:
        log.info("export: %s", stage_export(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
