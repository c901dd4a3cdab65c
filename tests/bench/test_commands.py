"""Each command end to end on tiny settings (few tokens, short contexts, a random draft): it runs,
exits 0 and writes its files with the right columns. Figures are not checked here (a random draft
is slower than plain decoding); only their shape and a few invariants (exact generated counts,
AL of at least 1, the verify path agreeing with decoding).

The soak and ``bench --workloads`` go through LiteLLM with the random draft behind the DFlash tag
(``--draft``).
"""

from __future__ import annotations

import csv
import sys

import pytest

from flm_bench import agreement, quick, speed
from flm_bench import soak, workload_bench, workloads
from flm_bench.documents import Prompt
from flm_bench.engines import Context, Run
from flm_runtime import api
from flm_runtime.request import PROPOSERS, ProposerCounts, SpecStats


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_writes_the_speed_table_csv_and_plot(run_cli, random_draft, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot must be skipped with a message
    status, out, err = run_cli("bench", "--draft", random_draft, "--contexts", "short,48", "--max-tokens", 3,
                               "--prompts-per-context", 1, "--out", tmp_path, "--quiet")
    assert status == 0
    columns, rows = read_csv(tmp_path / "speed.csv")
    assert tuple(columns) == speed.COLUMNS
    assert [(r["mode"], r["prompt_tokens"] == "48" or r["prompt"] == "short-1") for r in rows] == [
        ("greedy", True), ("sampled", True)] * 2
    assert all(r["baseline_tokens"] == r["dflash_tokens"] == "3" for r in rows)
    assert all(float(r["acceptance_length"]) >= 1.0 and int(r["verify_steps"]) >= 1 for r in rows)
    md = (tmp_path / "speed.md").read_text()
    assert "| Prompt context | smollm2:135m (TPS, Greedy) | Greedy | Sampled |" in md and "AL " in md
    assert "litellm-flm bench --tag smollm2:135m --draft" in md and "| machine |" in md
    assert '"Sampled" is the model\'s default sampler (temperature 0.2' in md
    assert not (tmp_path / "speed.png").exists() and "no plot" in err


def test_bench_no_ngram_runs_the_draft_alone(run_cli, random_draft, tmp_path):
    """``--no-ngram``: no step verifies n-gram proposals, and the report says so and how it was run."""
    status, *_ = run_cli("bench", "--draft", random_draft, "--no-ngram", "--contexts", "48", "--max-tokens", 3,
                         "--prompts-per-context", 1, "--modes", "greedy", "--out", tmp_path, "--quiet", "--no-plot")
    assert status == 0
    _, rows = read_csv(tmp_path / "speed.csv")
    assert [(r["ngram_steps"], r["ngram_acceptance_length"], r["grammar_steps"], r["forced_tokens"])
            for r in rows] == [("0", "", "0", "0")]  # no AL over no step
    md = (tmp_path / "speed.md").read_text()
    assert "--no-ngram" in md and "without prompt lookup" in md and "ngram 0, suffix 0, grammar 0, 0 forced tokens, 0 kept." in md


def test_bench_sampled_mode_takes_the_given_sampler(run_cli, random_draft, tmp_path):
    """``--temperature/--top-k/--top-p`` set the sampled mode's sampler (the reference benchmark's 1.0/64/0.95
    here); the report and its command say so; a value out of range fails before any request."""
    status, *_ = run_cli("bench", "--draft", random_draft, "--contexts", "48", "--max-tokens", 3,
                         "--prompts-per-context", 1, "--modes", "sampled", "--temperature", "1.0", "--top-k", 64,
                         "--top-p", "0.95", "--out", tmp_path, "--quiet", "--no-plot")
    assert status == 0
    md = (tmp_path / "speed.md").read_text()
    assert '"Sampled" is the given sampler (temperature 1.0, top_k 64, top_p 0.95, min_p 0.0)' in md
    assert "--modes sampled --temperature 1.0 --top-k 64 --top-p 0.95" in md
    status, _, err = run_cli("bench", "--draft", random_draft, "--contexts", "48", "--top-p", "1.5",
                             "--out", tmp_path / "bad", "--quiet", "--no-plot")
    assert status != 0 and "top_p" in err and not (tmp_path / "bad").exists()


def test_a_speed_cell_without_verify_steps_says_so_rather_than_an_al_of_zero():
    assert speed.Cell(100.0, 98.0, None).label() == "0.98x (no verify step)"
    assert speed.Cell(100.0, 124.0, 3.854).label() == "1.24x (AL 3.85)"


def test_a_speed_row_and_note_show_every_proposers_steps_and_al_and_the_forced_tokens():
    spec = SpecStats(proposers={"draft": ProposerCounts(steps=2, drafted=14, accepted=2, emitted=4, forced=3,
                                                        forced_accepted=1),
                                "ngram": ProposerCounts(steps=6, drafted=42, accepted=19, emitted=25),
                                "grammar": ProposerCounts(steps=3, drafted=9, accepted=8, emitted=11, forced=9,
                                                          forced_accepted=8)})
    ctx = Context("48", 48)
    run = Run(48, 41, 0.1, 0.5, spec.steps, spec.acceptance_length, 0, spec.figures())
    pair = speed.Pair(ctx, Prompt("p", (1,)), "greedy", None, Run(48, 41, 0.1, 0.8), run)
    assert tuple(pair.row()) == speed.COLUMNS
    assert {k: pair.row()[k] for k in speed.COLUMNS[12:]} == {
        "acceptance_length": "3.6364", "verify_steps": 11, "forced_tokens": 12, "forced_accepted_tokens": 9,
        "draft_acceptance_length": "2.0000", "prediction_steps": 0, "prediction_drafted_tokens": 0,
        "prediction_accepted_tokens": 0, "prediction_acceptance_length": "", "ngram_steps": 6, "ngram_drafted_tokens": 42,
        "ngram_accepted_tokens": 19, "ngram_acceptance_length": "4.1667", "suffix_steps": 0,
        "suffix_drafted_tokens": 0, "suffix_accepted_tokens": 0, "suffix_acceptance_length": "",
        "grammar_steps": 3, "grammar_drafted_tokens": 9, "grammar_accepted_tokens": 8,
        "grammar_acceptance_length": "3.6667"}
    assert speed._proposer_share(ctx, [pair, pair]) == (
        "48: 22 steps, prediction 0, ngram 12 (AL 4.17), suffix 0, grammar 6 (AL 3.67), 24 forced tokens, 18 kept")


def test_bench_plot_with_matplotlib(run_cli, random_draft, tmp_path):
    status, *_ = run_cli("bench", "--draft", random_draft, "--contexts", "short", "--max-tokens", 2,
                         "--prompts-per-context", 1, "--modes", "greedy", "--out", tmp_path, "--quiet")
    assert status == 0 and (tmp_path / "speed.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_quick_writes_mean_and_std_per_context(run_cli, random_draft, tmp_path):
    status, out, _ = run_cli("bench", "--quick", "--draft", random_draft, "--contexts", "64,9k", "--max-tokens", 3,
                             "--iterations", 2, "--out", tmp_path, "--quiet")
    assert status == 0
    columns, rows = read_csv(tmp_path / "quick.csv")
    assert tuple(columns) == quick.COLUMNS
    assert sorted((r["tag"], r["iteration"]) for r in rows) == [
        ("smollm2-dflash:135m", "1"), ("smollm2-dflash:135m", "2"), ("smollm2:135m", "1"), ("smollm2:135m", "2")]
    assert all(r["context"] == "64" and r["prompt_tokens"] == "64" for r in rows)
    md = (tmp_path / "quick.md").read_text()
    assert "| Model | HW | 64 |" in md and " ± " in md and "DFlash / baseline" in md and "TTFT (s)" in md
    assert "9k (9216 tokens) is over the model's context of 8192: skipped" in md


def test_bench_quick_baseline_only_needs_no_draft(run_cli, tmp_path):
    status, *_ = run_cli("bench", "--quick", "--baseline-only", "--contexts", "56", "--max-tokens", 2,
                         "--iterations", 1, "--out", tmp_path, "--quiet")
    assert status == 0
    _, rows = read_csv(tmp_path / "quick.csv")
    assert [r["tag"] for r in rows] == ["smollm2:135m"] and rows[0]["acceptance_length"] == ""


def test_bench_workloads_through_litellm_one_task_each(run_cli, random_draft, tmp_path, forget_dflash_engine,
                                                       monkeypatch):
    """One task per workload, greedy, 3 tokens a request: every turn of a conversation is a row;
    an agent's call cannot finish in 3 tokens, so its conversation ends after the first request.
    The DFlash step is exact: every greedy answer is identical on both tags."""
    # Passages of one paragraph or so: the command handles a RAG or extraction prompt alike at any
    # length, and their full passages (about 960 prompt tokens) were half the prefill on two engines.
    monkeypatch.setattr(workloads, "RAG_PASSAGE_CHARS", 300)
    monkeypatch.setattr(workloads, "EXTRACTION_PASSAGE_CHARS", 300)
    status, out, _ = run_cli("bench", "--workloads", "--draft", random_draft, "--requests", 1, "--max-tokens", 3,
                             "--modes", "greedy", "--out", tmp_path, "--quiet")
    assert status == 0
    columns, rows = read_csv(tmp_path / "workloads.csv")
    assert tuple(columns) == workload_bench.COLUMNS
    assert [(r["workload"], r["turn"]) for r in rows] == [
        ("chat", "1"), *(("multi-turn", str(t)) for t in range(1, 5)), ("code-edit", "1"), ("rag", "1"), ("agent", "1"),
        ("extraction", "1")]
    assert {r["mode"] for r in rows} == {"greedy"} and rows[5]["task"] == "parse_duration rename-and-hints"
    assert all(r["plain_tokens"] == r["dflash_tokens"] == "3" and r["identical"] == "yes" for r in rows)
    # Every token after the first: a verify step's or a plain step's.
    assert all(sum(int(r[f"{k}_pushed"]) for k in PROPOSERS) + int(r["plain_steps"]) == 2
               for r in rows)
    md = (tmp_path / "workloads.md").read_text()
    assert "| Workload | Mode | Requests | smollm2:135m tokens/s | smollm2-dflash:135m tokens/s | Ratio |" in md
    assert "| multi-turn | greedy | 4 |" in md and md.count("| 1 of 1 |") == 5 and "| 4 of 4 |" in md
    assert "litellm-flm bench --workloads all --tag smollm2:135m --draft" in md and "--requests 1" in md
    assert (tmp_path / "workloads.png").read_bytes()[:4] == b"\x89PNG"


CURVE = "1.1,1.2,1.3,1.4,1.5,1.6,1.7"  # a verify cost per pass of 2 .. 8 rows: the tag's block of 8


def test_bench_workloads_sampled_mode(run_cli, tmp_path):
    status, *_ = run_cli("bench", "--workloads", "chat", "--modes", "sampled", "--requests", 1, "--max-tokens", 3,
                         "--seed", 7, "--ceiling-curve", CURVE, "--ceiling-min-run", 2, "--out", tmp_path, "--quiet",
                         "--no-plot")
    assert status == 0
    _, rows = read_csv(tmp_path / "workloads.csv")
    assert [(r["workload"], r["task"], r["mode"], r["identical"]) for r in rows] == [("chat", "chat-1", "sampled", "")]
    # The copy ceiling's decode positions: the DFlash answer's tokens after the first.
    assert rows[0]["copy_positions"] == str(int(rows[0]["dflash_tokens"]) - 1) and float(rows[0]["copy_cost"]) >= 1.0
    md = (tmp_path / "workloads.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| chat | sampled | 1 |"))
    assert row.endswith("| — |") and "seeds from 7" in md  # no greedy equality in sampled mode
    assert f"Priced on the verify costs given ({CURVE} decode steps" in md and "runs of at least 2 tokens" in md
    # The command line reproduces the run: its workloads and options.
    assert (f"litellm-flm bench --workloads chat --tag smollm2:135m --requests 1 --max-tokens 3 --modes sampled "
            f"--ceiling-curve {CURVE} --ceiling-min-run 2 --seed 7 --out {tmp_path}") in md
    assert not (tmp_path / "workloads.png").exists()


def test_bench_workloads_ceiling_curve_must_price_every_length_the_tag_verifies(run_cli, tmp_path):
    for curve in (CURVE + ",1.8", CURVE.rsplit(",", 1)[0]):
        status, _, err = run_cli("bench", "--workloads", "chat", "--ceiling-curve", curve, "--out", tmp_path / "x",
                                 "--quiet")
        n = curve.count(",") + 1
        assert status == 1 and f"--ceiling-curve has {n} costs; smollm2-dflash:135m verifies up to 7 tokens" in err
        assert not (tmp_path / "x").exists()


def test_bench_workloads_takes_no_option_of_the_other_tables(run_cli, tmp_path):
    status, _, err = run_cli("bench", "--workloads", "chat", "--quick", "--out", tmp_path / "x", "--quiet")
    assert status == 1 and "--quick" in err and not (tmp_path / "x").exists()
    status, _, err = run_cli("bench", "--workloads", "chat,poems", "--out", tmp_path / "x", "--quiet")
    assert status == 1 and "poems" in err


def test_agreement_writes_the_accuracy_table(run_cli, tmp_path):
    status, out, _ = run_cli("agreement", "--contexts", "24", "--positions", 8, "--out", tmp_path, "--quiet")
    assert status == 0
    columns, rows = read_csv(tmp_path / "agreement.csv")
    assert tuple(columns) == agreement.COLUMNS
    assert [r["document"] for r in rows][-1] == "all" and rows[-1]["positions"] == "24"
    # The verify pass and decoding differ by float rounding only: never beyond a near-tie.
    assert rows[-1]["beyond_near_tie"] == "0" and float(rows[-1]["mean_cosine"]) > 0.9999
    md = (tmp_path / "agreement.md").read_text()
    assert "| Context | Positions | Same top-1 token | Different by more than a near-tie |" in md
    assert "near-tie" in md and "litellm-flm agreement --tag smollm2:135m" in md


def test_soak_through_litellm_runs_every_kind_and_leaves_nothing(run_cli, random_draft, tmp_path,
                                                                 forget_dflash_engine):
    """One cycle of the schedule: every kind of request, its exact token count, verify passes from a
    random draft, the closed stream counted as cancelled by the engine (else the run fails)."""
    status, out, _ = run_cli("soak", "--draft", random_draft, "--min-requests", 8, "--min-tokens", 1,
                             "--long-tokens", 12, "--short-tokens", 3, "--document-tokens", 64, "--cancel-after", 2,
                             "--stall-s", 300, "--out", tmp_path, "--quiet")  # first compiles: no stall here
    assert status == 0, out
    columns, rows = read_csv(tmp_path / "soak.csv")
    assert tuple(columns) == soak.COLUMNS
    assert [(r["kind"], r["mode"], r["stream"], r["completion_tokens"], r["finish_reason"]) for r in rows] == [
        ("long", "greedy", "True", "12", "length"), ("short", "sampled", "False", "3", "length"),
        ("document", "greedy", "True", "3", "length"), ("structured", "sampled", "True", "3", "length"),
        ("long", "sampled", "True", "12", "length"), ("cancelled", "sampled", "True", "0", "cancelled"),
        ("structured", "greedy", "False", "3", "length"), ("short", "greedy", "True", "3", "length")]
    assert int(rows[2]["prompt_tokens"]) > 64  # the excerpt, the instruction and the template
    # A random draft's passes: every token after the first of a finished request comes from one.
    assert all(r["error"] == "" and r["stalls"] == "0" and float(r["rss_mb"]) > 0 for r in rows), rows
    assert all(int(r["verify_passes"]) >= 1 for r in rows if r["kind"] != "cancelled")
    md = (tmp_path / "soak.md").read_text()
    assert "39 tokens over 8 requests through LiteLLM from 1 client(s)" in md and "1 streams closed after 2 chunks" in md
    assert "Result: PASS" in md and "- left in the engine" not in md


def test_the_coding_schedule_from_two_clients_sends_every_kind_and_leaves_nothing(run_cli, qwen_coder_gguf, tmp_path,
                                                                                   monkeypatch):
    """A coding assistant's requests on qwen2.5-coder:0.5b (fill-in-the-middle needs its FIM tokens),
    two clients at once: edits, every pause of a typed function, tool rounds with their results
    fed back, structured output, a closed stream; each request its own row, none failed."""
    runtime = api.Runtime()  # a runtime of its own, on the default weights (as tests/litellm/test_flm_fim.py)
    monkeypatch.setattr(api, "default_runtime", runtime)
    monkeypatch.setenv("FLM_WEIGHTS", "auto")
    try:
        status, out, _ = run_cli("soak", "--model", "flm/qwen2.5-coder:0.5b", "--schedule", "coding",
                                 "--concurrency", 2, "--min-requests", 16, "--min-tokens", 1, "--long-tokens", 8,
                                 "--short-tokens", 6, "--cancel-after", 2, "--stall-s", 300, "--out", tmp_path,
                                 "--quiet")
    finally:
        runtime.close()
    assert status == 0, out
    _, rows = read_csv(tmp_path / "soak.csv")
    assert [int(r["index"]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 16
    assert {r["kind"] for r in rows} == {"edit", "fim", "agent", "structured", "cancelled"}
    assert all(r["error"] == "" for r in rows), rows
    fim = [r for r in rows if r["kind"] == "fim"]
    assert len(fim) >= soak.workloads.FIM_PAUSES and all(0 < int(r["completion_tokens"]) <= 6 for r in fim)
    assert "the coding schedule" in (tmp_path / "soak.md").read_text()


def test_soak_fails_when_the_minimum_is_not_reached(run_cli, tmp_path):
    status, out, _ = run_cli("soak", "--model", "flm/smollm2:135m", "--min-requests", 1, "--min-tokens", 10**6,
                             "--max-requests", 1, "--short-tokens", 2, "--long-tokens", 2, "--out", tmp_path, "--quiet")
    assert status == 1 and "FAIL" in out
    _, rows = read_csv(tmp_path / "soak.csv")
    assert rows[0]["verify_passes"] == "0"  # a plain tag has no verify pass


def test_soak_draft_models_file_keeps_the_users_entries(tmp_path, monkeypatch, random_draft):
    from flm_runtime import registry

    user = tmp_path / "models.yaml"
    user.write_text(f"mine:1b: {{path: {tmp_path / 'mine.gguf'}, sha256: {'a' * 64}, size: 10}}\n")
    monkeypatch.setenv("FLM_MODELS_FILE", str(user))
    registry.reload()
    with soak.draft_models_file("smollm2-dflash:135m", random_draft):
        assert registry.resolve("smollm2-dflash:135m").draft_dir == random_draft.resolve()
        mine = registry.resolve("mine:1b")
        assert mine.files[0].sha256 == "a" * 64 and mine.path == tmp_path / "mine.gguf"
    assert registry.resolve("smollm2-dflash:135m").draft_dir != random_draft.resolve()
    with pytest.raises(ValueError, match="not one"):
        with soak.draft_models_file("smollm2:135m", random_draft):
            pass
