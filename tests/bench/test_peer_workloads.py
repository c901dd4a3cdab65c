"""``litellm-flm bench --workloads --llama-server PATH`` / ``--spec-off`` (``flm_bench.peer_workloads``):
the conversation loop and the report's arithmetic on made-up replies, then the command end to end
on the embedded model (``--spec-off``: our tag twice, tiny requests) and, where llama-server is
built on this machine, the requests as llama-server gets them. No figure is checked, only shapes,
exact counts and equalities."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from flm_bench import peer_workloads as pw
from flm_bench import workloads
from flm_bench.llama_server import SPEC_CONFIGS, LlamaServer
from flm_bench.workloads import Task

LLAMA_SERVER = Path(os.environ.get("FLM_TEST_LLAMA_SERVER", "/work/llama-build/llama_cpp_python-0.3.36/vendor/"
                                                             "llama.cpp/build/bin/llama-server"))


def reply(tokens=10, seconds=1.0, text="x", ids=None, error=None, calls=()):
    return pw.Reply(text, calls, 5, tokens, seconds, ids, None, error)


def test_converse_rotates_the_engines_and_follows_each_engines_own_answers():
    """Each engine goes on with its own answers: one engine's call gets a tool round, the other's
    plain answer ends its conversation; the order rotates with k + the turn."""
    task = workloads.agent(1, 8)[0]
    sent = []

    def engine(name, calls):
        def send(request, sampler):
            sent.append((name, len(request["messages"]), sampler["temperature"], sampler.get("seed")))
            return reply(text=None if calls else "done", calls=calls)
        return send

    engines = {"a": engine("a", (("get_weather", '{"city": "Oslo"}'),)), "b": engine("b", ())}
    results = pw.converse(task, "sampled", engines, seed=40, k=0)
    # Turn 1 starts at engine (0 + 1) % 2 = b; turns 2 and 3 are a's alone (tool rounds, then the rounds are spent).
    assert sent == [("b", 2, 0.7, 40), ("a", 2, 0.7, 40), ("a", 4, 0.7, 41), ("a", 6, 0.7, 42)]
    assert [(r.engine, r.turn) for r in results] == [("b", 1), ("a", 1), ("a", 2), ("a", 3)]
    assert pw.sampler_of("greedy", 3) == {"temperature": 0.0}


def test_a_refused_request_ends_that_engines_conversation():
    task = workloads.fim(1, 8)[0]
    results = pw.converse(task, "greedy", {"ours": lambda r, s: reply(error="not supported: x"),
                                           "theirs": lambda r, s: reply()}, seed=0, k=1)
    assert [(r.engine, r.turn) for r in results] == [("ours", 1), ("theirs", 1)] + [
        ("theirs", t) for t in range(2, 7)]


def _results():
    """Two fim pauses and one code edit on flm, FLM_SPECULATION=0 and two llama-server configs."""
    fim, edit = Task("fim", "f typed", {"prompt": "p"}), Task("code-edit", "f docstring", {"messages": []})
    plain, simple = f"{pw.LLAMA} plain", f"{pw.LLAMA} ngram-simple"
    seconds = {pw.FLM: (0.2, 0.4), pw.FLM_OFF: (0.3, 0.3), plain: (0.5, 0.7), simple: (0.6, 0.4)}
    out = [pw.Result(fim, turn, "greedy", e, reply(seconds=s[turn - 1], text=f"{e}{turn}" if e == pw.FLM_OFF else "t"))
           for e, s in seconds.items() for turn in (1, 2)]
    rates = {pw.FLM: (100, 2.0), pw.FLM_OFF: (100, 4.0), plain: (100, 5.0), simple: (120, 4.0)}
    out += [pw.Result(edit, 1, "greedy", e, reply(tokens, s, ids=(1, 2))) for e, (tokens, s) in rates.items()]
    return out


def test_cells_best_llama_server_ratios_and_identical_answers():
    by = pw.cells(_results())
    llamas = [f"{pw.LLAMA} plain", f"{pw.LLAMA} ngram-simple"]
    # fim: medians 0.3 (flm), 0.6 (plain), 0.5 (ngram-simple); p90 interpolated between the two.
    assert by[("fim", "greedy", pw.FLM)].label(True) == "0.300 / 0.380"
    assert pw.best_llama(by, "fim", "greedy", llamas) == f"{pw.LLAMA} ngram-simple"
    assert pw.ratio(by, "fim", "greedy", pw.FLM, f"{pw.LLAMA} ngram-simple") == pytest.approx(0.5 / 0.3)
    # code edits: tokens/s 50 (flm), 25 (off), 20 (plain), 30 (ngram-simple).
    assert pw.best_llama(by, "code-edit", "greedy", llamas) == f"{pw.LLAMA} ngram-simple"
    assert pw.ratio(by, "code-edit", "greedy", pw.FLM, pw.FLM_OFF) == 2.0
    assert pw.identical(_results(), "code-edit") == "1 of 1" and pw.identical(_results(), "fim") == "0 of 2"
    assert pw.identical(_results(), "chat") == "—"
    refused = pw.Cell([reply(error="not supported: prediction")])
    assert refused.label(False) == "not supported" and refused.refused == "not supported: prediction"


def test_reply_round_trips_through_the_workers_json():
    import dataclasses
    import json

    r = pw.Reply("a", (("f", "{}"),), 3, 4, 0.5, (1, 2), (3, 1))
    assert pw.Reply.from_json(json.loads(json.dumps(dataclasses.asdict(r)))) == r


def test_fim_prompt_is_the_text_of_encode_fims_tokens():
    assert pw.fim_prompt(("<P>", "<S>", "<M>"), "def f(", "\n") == "<P>def f(<S>\n<M>"


def test_parse_configs():
    assert pw.parse_configs("plain, ngram-mod") == ["plain", "ngram-mod"]
    with pytest.raises(pw.InvalidRequestError, match="ngram-cache"):
        pw.parse_configs("ngram-cache")


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_spec_off_runs_our_tag_twice_with_identical_greedy_answers(run_cli, tmp_path):
    """Our tag in this process and with FLM_SPECULATION=0 in a worker, the order rotating from
    request to request: greedy answers identical. Chat alone: the ``prediction`` requests are
    tested where they are built (``test_workloads.py``) and served (``test_flm_prediction.py``);
    a whole file's prefill on both engines took minutes here."""
    status, out, _ = run_cli("bench", "--workloads", "chat", "--spec-off", "--requests", 2,
                             "--max-tokens", 3, "--modes", "greedy", "--out", tmp_path, "--quiet")
    assert status == 0
    rows = read_csv(tmp_path / "peer_workloads.csv")
    assert [r["engine"] for r in rows] in ([*order, *order[::-1]] for order in ([pw.FLM, pw.FLM_OFF],
                                                                             [pw.FLM_OFF, pw.FLM]))
    assert [r["completion_tokens"] for r in rows] == ["3"] * 4 and not any(r["error"] for r in rows)
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] != rows[2]["prompt_tokens"] == rows[3]["prompt_tokens"]
    md = (tmp_path / "peer_workloads.md").read_text()
    assert "| chat | greedy | 2 |" in md and "| 2 of 2 |" in md
    assert "litellm-flm bench --workloads chat --tag smollm2:135m --threads" in md and "--spec-off" in md
    assert (tmp_path / "peer_workloads.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"no llama-server at {LLAMA_SERVER} (FLM_TEST_LLAMA_SERVER)")
def test_llama_server_gets_the_same_fim_prompt_tokens_and_ignores_prediction():
    """Through LiteLLM: llama-server's prompt tokens for the FIM prompt's text equal our provider's
    for prompt + suffix (qwen2.5-coder:0.5b, the smallest tag with FIM tokens), and a chat with
    ``prediction`` is answered."""
    from flm_runtime import pull

    tag = "qwen2.5-coder:0.5b"
    tokens = pw.fim_tokens_of(tag)
    assert tokens == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    request = {"prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 2}
    ours = pw.flm_send(tag, request, {"temperature": 0.0})
    with LlamaServer(LLAMA_SERVER, pull.locate(tag), 2, 1, 4096, SPEC_CONFIGS["ngram-simple"]) as server:
        theirs = pw.llama_send(server, tokens, request, {"temperature": 0.0})
        chat = pw.llama_send(server, None, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                            "prediction": {"type": "content", "content": "Hello"}},
                             {"temperature": 0.0})
    assert ours.prompt_tokens == theirs.prompt_tokens == 21 and ours.text == theirs.text == "a +"  # greedy, confident
    assert chat.completion_tokens == 2 and chat.error is None
