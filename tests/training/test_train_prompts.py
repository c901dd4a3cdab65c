"""Training prompts: distinct, deterministic, prefix-stable, and no overlap with MT-Bench."""

from __future__ import annotations

import pytest

pytest.importorskip("flm_train", reason="flm_train (the training/ directory) is not installed")

from flm_train.prompts import load_mt_bench, make_prompts, overlap_report


def test_prompts_are_distinct_deterministic_and_prefix_stable():
    ps = make_prompts(640)
    assert len({p["prompt"] for p in ps}) == 640
    assert make_prompts(640) == ps
    assert make_prompts(100) == ps[:100]
    assert {p["category"] for p in ps} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                          "stem", "humanities"}


def test_no_prompt_overlaps_mt_bench(mt_bench_path):
    bench = load_mt_bench(mt_bench_path)
    assert len(bench) == 160
    assert overlap_report([p["prompt"] for p in make_prompts(1280)], bench) == []


def test_overlap_check_catches_a_paraphrase_sharing_8_words(mt_bench_path):
    bench = load_mt_bench(mt_bench_path)
    near = "Please compose an engaging travel blog post about a recent trip to Hawaii for me."
    assert overlap_report([near], bench)
    assert overlap_report([bench[0].upper()], bench)
