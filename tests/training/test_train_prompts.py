"""Training prompts: distinct, deterministic, prefix-stable, no overlap with MT-Bench, and the
pipeline's guard that the prompts behind existing shards never change."""

from __future__ import annotations

import json

import pytest

from flm_train.pipeline import parse_args, stage_prompts
from flm_train.prompts import load_mt_bench, make_prompts, overlap_report, parse_mix

CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.mark.parametrize("source", ["templates", "composed", "open"])
def test_each_source_is_distinct_deterministic_and_prefix_stable(source):
    ps = make_prompts([(source, 640)])
    assert len({p["prompt"] for p in ps}) == 640
    assert make_prompts([(source, 640)]) == ps
    assert make_prompts([(source, 100)]) == ps[:100]
    assert {p["category"] for p in ps} == CATEGORIES
    assert {p["source"] for p in ps} == {source}


def test_a_mix_extends_its_first_source_and_grows_at_the_end():
    mix = make_prompts([("templates", 96), ("composed", 64)])
    assert mix[:96] == make_prompts([("templates", 96)])
    assert [p["prompt"] for p in mix[96:]] == [p["prompt"] for p in make_prompts([("composed", 64)])]
    assert [p["id"] for p in mix] == list(range(160))
    assert make_prompts([("templates", 96), ("composed", 100)])[:160] == mix


def test_composed_prompts_are_longer_and_paste_material_in():
    ps = make_prompts([("composed", 640)])
    templates = make_prompts([("templates", 640)])
    mean = lambda xs: sum(len(p["prompt"]) for p in xs) / len(xs)  # noqa: E731
    assert mean(ps) > 1.5 * mean(templates)
    pasted = [p for p in ps if "\n\n" in p["prompt"]]  # code, a docstring, a table, notes...
    assert {p["category"] for p in pasted} >= {"coding", "extraction"}


def test_open_prompts_cover_every_topic_of_their_bank():
    from flm_train.composed_prompts import HUMANITIES, SCIENCE, SUBJECTS
    from flm_train.open_prompts import TOPICS

    def topics_asked(prompts, bank):
        return {t for p in prompts for t in bank if t in p["prompt"]}

    assert len(TOPICS) == len(set(TOPICS)) == 421
    assert topics_asked(make_prompts([("open", 3072)]), TOPICS) == set(TOPICS)
    assert len(topics_asked(make_prompts([("composed", 3072)]), SUBJECTS + SCIENCE + HUMANITIES)) == 104


@pytest.mark.parametrize("spec, message", [("templates", "positive integer"), ("templates:0", "positive integer"),
                                           ("chat:10", "unknown prompt source 'chat'"), (" , ", "empty")])
def test_a_bad_mix_is_refused_with_its_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(spec)
    with pytest.raises(SystemExit):  # argparse: a usage error, not a traceback
        parse_args(["--prompts", spec])


def test_no_prompt_overlaps_mt_bench(mt_bench_path):
    bench = load_mt_bench(mt_bench_path)
    assert len(bench) == 160
    # the sixth run's list; the pipeline checks each run's whole list
    prompts = make_prompts([("templates", 2048), ("composed", 9216), ("open", 3072)])
    assert overlap_report([p["prompt"] for p in prompts], bench) == []


def test_overlap_check_catches_a_paraphrase_sharing_8_words(mt_bench_path):
    bench = load_mt_bench(mt_bench_path)
    near = "Please compose an engaging travel blog post about a recent trip to Hawaii for me."
    assert overlap_report([near], bench)
    assert overlap_report([bench[0].upper()], bench)


def test_the_prompts_stage_refuses_to_change_prompts_whose_shard_exists(tmp_path):
    def args(spec: str):
        return parse_args(["--out", str(tmp_path), "--prompts", spec, "--shard-size", "4",
                           "--mt-bench", str(tmp_path / "absent.jsonl")])

    first = stage_prompts(args("templates:8"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard_0000.npz").touch()  # prompts 0-3 have their shard; 4-7 do not
    assert stage_prompts(args("templates:8,composed:4"))[:8] == first  # extending is fine
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == 12
    assert stage_prompts(args("templates:4,composed:4"))[:4] == first[:4]  # 4-7 had no shard yet
    with pytest.raises(SystemExit, match="prompt 0 differs"):
        stage_prompts(args("composed:8"))
    recorded = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [p["source"] for p in recorded] == ["templates"] * 4 + ["composed"] * 4  # left as it was
