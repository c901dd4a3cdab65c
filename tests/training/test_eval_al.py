"""``python -m flm_train.eval_al`` (serving runtime only, no torch) on three questions of our own
in the MT-Bench file format: it selects the first of each category as asked, its output is the
target's greedy output (so its token counts are the baseline's), and its pooled AL lies within
its per-category ones."""

from __future__ import annotations

import json

import pytest
from flm_runtime import paths
from flm_runtime.request import SamplingParams

from flm_train import eval_al

DRAFT = paths.package_dir() / "drafts" / "smollm2-135m-dflash"
QUESTIONS = [  # ours, not MT-Bench: the format only
    {"question_id": 1, "category": "writing", "turns": ["Write two sentences about a quiet harbour at dawn."]},
    {"question_id": 2, "category": "writing", "turns": ["Describe a rainy afternoon in a small library."]},
    {"question_id": 3, "category": "math", "turns": ["What is 12 times 7? Explain briefly."]},
]
MAX_NEW = 24


def test_eval_al_pools_the_requests_and_matches_greedy_decoding(tmp_path, smollm2_engine, smollm2_tokenizer, capsys):
    if not (DRAFT / "config.json").exists():
        pytest.skip(f"{DRAFT} not exported yet")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp_path / "al.json"
    assert eval_al.main(["--draft", str(DRAFT), "--questions", str(questions), "--per-category", "1",
                         "--max-new", str(MAX_NEW), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("q")]
    assert [line.split(":")[0] for line in lines] == ["q1 writing", "q3 math"]  # first of each category

    tok = smollm2_tokenizer
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    baseline = [smollm2_engine.submit(tok.encode(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}])),
                                      greedy).result() for q in (QUESTIONS[0], QUESTIONS[2])]
    assert result["questions"] == 2 and result["max_new"] == MAX_NEW
    assert result["tokens"] == sum(done.stats.generated_tokens for done in baseline)  # end of turn included
    assert [int(line.split()[2]) for line in lines] == [done.stats.generated_tokens for done in baseline]
    assert set(result["per_category"]) == {"writing", "math"}
    assert all(1.0 <= al <= 8.0 for al in [result["acceptance_length"], *result["per_category"].values()])
    assert min(result["per_category"].values()) <= result["acceptance_length"] <= max(result["per_category"].values())
