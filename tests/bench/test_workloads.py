"""The requests of ``litellm-flm bench --workloads`` (``flm_bench.workloads``): exact, deterministic,
and in the shapes LiteLLM and the provider take (tools and response formats checked against JSON
Schema and compiled by the provider's grammar; tool messages sent through LiteLLM)."""

from __future__ import annotations

import ast
import json
import textwrap

import jsonschema
import litellm
import pytest

import litellm_flm  # noqa: F401 - registers the flm/ provider with LiteLLM
from flm_bench import workloads
from flm_bench.documents import load_documents
from flm_bench.workloads import Answer, follow_up
from flm_runtime import InvalidRequestError, json_schema_grammar


@pytest.fixture(scope="module")
def docs():
    return load_documents()


def build(name, n, docs, **kw):
    return workloads.build(name, n, max_tokens=64, documents=docs, **kw)


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_each_workload_is_deterministic_and_sends_no_prompt_twice(name, docs):
    """A run of 3 tasks greedy and 3 more sampled asks six different things per workload."""
    tasks = build(name, 6, docs)
    assert tasks == build(name, 6, docs) and len(tasks) == 6
    assert all(t.workload == name and t.request["max_tokens"] == (48 if name == "fim" else 64) for t in tasks)
    assert len({json.dumps(t.request) for t in tasks}) == 6


def test_task_names_and_request_fields(docs):
    assert [t.name for t in build("chat", 2, docs)] == ["chat-1", "chat-2"]
    edits = [t.name for t in build("code-edit", 14, docs)]
    assert edits[5::4] == ["split_command docstring", "read_ini_sections docstring",
                           "percentiles docstring"] and len(set(edits)) == 14  # every function and edit
    assert [t.name for t in build("rag", 4, docs)] == [
        "doyle_scandal_in_bohemia.txt #1", "darwin_origin_of_species.txt #1", "smith_wealth_of_nations.txt #1",
        "doyle_scandal_in_bohemia.txt #2"]
    assert [sorted(t.request) for t in build("agent", 1, docs) + build("extraction", 1, docs)] == [
        ["max_tokens", "messages", "tool_choice", "tools"], ["max_tokens", "messages", "response_format"]]
    multi = build("multi-turn", 1, docs)[0]
    assert multi.max_requests == 4 and len(multi.user_turns) == 3
    assert multi.request["messages"] == [{"role": "user", "content": (
        "Write a short letter to a neighbour asking them to water your plants while you are away for a week.")}]


def test_chat_takes_mt_bench_first_turns(mt_bench_path, docs):
    first = json.loads(mt_bench_path.read_text().splitlines()[1])["turns"][0]
    assert build("chat", 2, docs, chat_prompts=mt_bench_path)[1].request["messages"] == [
        {"role": "user", "content": first}]


def test_parse_workloads():
    assert workloads.parse_workloads("all") == list(workloads.DFLASH_WORKLOADS)
    assert workloads.parse_workloads("all", workloads.PEER_WORKLOADS) == [
        "chat", "code-edit", "search-replace", "prediction", "fim", "agent"]
    assert workloads.parse_workloads("agent, chat") == ["chat", "agent"]
    with pytest.raises(InvalidRequestError, match="summaries"):
        workloads.parse_workloads("chat,summaries")
    with pytest.raises(InvalidRequestError, match="fim"):
        workloads.parse_workloads("fim", allowed=workloads.CHAT_WORKLOADS)


# --- code edits and fill-in-the-middle ----------------------------------------------------------

def test_the_edited_file_is_ours_its_functions_40_to_90_lines_each_with_a_docstring_and_the_renamed_variable():
    text = workloads.edit_file()
    tree = ast.parse(text)
    spans = workloads.edit_functions()
    assert list(spans) == list(workloads.RENAMES) and 300 <= len(text.splitlines()) <= 400
    for node in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        assert 40 <= node.end_lineno - node.lineno + 1 <= 90 and ast.get_docstring(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        old, new = workloads.RENAMES[node.name]
        assert old in names and new not in names, node.name
        assert workloads.function_source(node.name) == ast.get_source_segment(text, node) + "\n"


def test_code_edit_and_search_replace_send_the_function_or_the_file_with_the_edit():
    code = workloads.code_edit(2, 64)
    assert [t.name for t in code] == ["parse_duration rename-and-hints", "wrap_paragraphs docstring"]
    assert f"```python\n{workloads.function_source('parse_duration')}```" in code[0].request["messages"][0]["content"]
    assert "rename the variable `stripped` to `remaining`" in code[0].request["messages"][0]["content"]
    stripped = workloads.without_docstring(workloads.function_source("wrap_paragraphs"))
    assert f"```python\n{stripped}```" in code[1].request["messages"][0]["content"]
    edits = workloads.search_replace(2, 64)
    predicted = workloads.search_replace(2, 64, predicted=True)
    system, user = edits[1].request["messages"]
    assert "<<<<<<< SEARCH" in system["content"] and ">>>>>>> REPLACE" in system["content"]
    file = workloads.edit_file().replace(workloads.function_source("wrap_paragraphs"), stripped)
    assert user["content"].startswith(f"textutils.py\n```python\n{file}```") and file != workloads.edit_file()
    assert [t.workload for t in predicted] == ["prediction"] * 2
    assert predicted[1].request == edits[1].request | {"prediction": {"type": "content", "content": file}}
    assert "prediction" not in edits[1].request


def test_without_docstring_exactly():
    src = 'def f(a, b=None):\n    """Doc\n    string."""\n    if b is not None:\n        return a == 1\n'
    assert workloads.without_docstring(src) == "def f(a, b=None):\n    if b is not None:\n        return a == 1\n"
    assert workloads.without_docstring("def g(x):\n    return x\n") == "def g(x):\n    return x\n"


def test_fim_types_a_function_into_the_file_pausing_mid_line():
    text = workloads.edit_file()
    first, last = workloads.edit_functions()["group_by_window"]
    lines = text.splitlines(keepends=True)
    after = "\n" + "".join(lines[last + 1:last + 41])
    pauses = workloads.fim_pauses("group_by_window", 6)
    assert len(pauses) == 6 and all(suffix == after for _, suffix in pauses)
    # Each prefix is the file up to a point inside the function, ending mid-line, further each time.
    assert all(text.startswith(prefix) for prefix, _ in pauses)
    ends = [len(prefix) for prefix, _ in pauses]
    assert ends == sorted(set(ends)) and len("".join(lines[:first + 1])) < ends[0] < len("".join(lines[:last + 1]))
    assert pauses[1][0].endswith('\n    if key is None:\n        def key')  # the line's text cut in half
    task = workloads.fim(8, 64)[7]
    assert (task.name, task.max_requests, task.request["max_tokens"]) == ("parse_duration typed", 6, 48)
    assert follow_up(task, task.request, Answer("anything"), 1) == task.next_requests[0]
    assert follow_up(task, task.next_requests[-1], Answer("x"), 6) is None
    with pytest.raises(ValueError, match="fewer than 99"):
        workloads.fim_pauses("percentiles", 99)


def test_code_edit_functions_are_not_in_the_drafts_training_passages():
    """Never trained on: flm_train pastes standard-library functions into its prompts, none of ours."""
    from flm_train.composed_prompts import stdlib_passages

    _, codes = stdlib_passages()
    ours = {textwrap.dedent(workloads.function_source(fn)).rstrip() for fn in workloads.edit_functions()}
    assert len(codes) > 100 and not ours & set(codes)


# --- agent ---------------------------------------------------------------------------------------

def test_tools_are_valid_json_schema_and_tool_results_are_exact():
    for tool in workloads.TOOLS:
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    assert json.loads(workloads.tool_result("get_weather", '{"city": "Lisbon"}')) == {
        "city": "Lisbon", "temperature": 11, "unit": "celsius", "conditions": "windy"}
    assert json.loads(workloads.tool_result("get_weather", '{"city": "lisbon", "unit": "fahrenheit"}'))[
        "temperature"] == 52  # 11 C, the same city whatever its case
    assert json.loads(workloads.tool_result(
        "convert_currency", '{"amount": 250, "from_currency": "eur", "to_currency": "USD"}'))["result"] == 270.0
    assert json.loads(workloads.tool_result("search_notes", '{"query": "packing", "limit": 2}')) == {
        "notes": [{"title": "Packing list", "text": "passport, charger, rain jacket, two books"}]}
    assert "error" in json.loads(workloads.tool_result("get_weather", "[1]"))
    assert "error" in json.loads(workloads.tool_result("send_email", "{}"))


def test_agent_follow_up_sends_the_calls_and_their_results_then_lets_the_model_answer(docs):
    task = build("agent", 1, docs)[0]
    assert task.request["tool_choice"] == "required" and build("agent", 2, docs)[1].request["tool_choice"] == "auto"
    calls = (("get_weather", '{"city": "Lisbon"}'), ("convert_currency",
                                                    '{"amount": 250, "from_currency": "EUR", "to_currency": "USD"}'))
    second = follow_up(task, task.request, Answer(None, calls), 1)
    assert second["messages"][:2] == task.request["messages"] and second["tool_choice"] == "required"
    assert second["messages"][2:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": calls[0][1]}},
            {"id": "call_1_1", "type": "function",
             "function": {"name": "convert_currency", "arguments": calls[1][1]}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": workloads.tool_result(*calls[0])},
        {"role": "tool", "tool_call_id": "call_1_1", "content": workloads.tool_result(*calls[1])}]
    third = follow_up(task, second, Answer(None, calls[:1]), 2)
    assert third["tool_choice"] == "auto" and len(third["messages"]) == 7  # the last round: the model may answer
    assert follow_up(task, third, Answer(None, calls[:1]), 3) is None  # the rounds are spent
    assert follow_up(task, task.request, Answer("It is sunny."), 1) is None  # no call: the answer is final


def test_litellm_takes_the_agent_and_extraction_requests(docs):
    """The provider accepts the tool history and the schema (2 tokens each: shapes, not answers)."""
    task = build("agent", 1, docs)[0]
    request = follow_up(task, task.request, Answer(None, (("get_weather", '{"city": "Oslo"}'),)), 1)
    r = litellm.completion(model="flm/smollm2:135m", **(request | {"max_tokens": 2}), temperature=0.0)
    assert r.usage.completion_tokens == 2 and r.usage.prompt_tokens > 300  # the tools and the tool turn are in it
    extraction = build("extraction", 1, docs)[0].request
    r = litellm.completion(model="flm/smollm2:135m", **(extraction | {"max_tokens": 2}), temperature=0.0)
    assert r.usage.completion_tokens == 2 and r.choices[0].message.content.startswith("{")


# --- multi-turn and extraction -------------------------------------------------------------------

def test_multi_turn_resends_the_history_with_the_answers(docs):
    task = build("multi-turn", 1, docs)[0]
    request = task.request
    for answered in (1, 2, 3):
        request = follow_up(task, request, Answer(f"answer {answered}"), answered)
    assert [m["role"] for m in request["messages"]] == ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in request["messages"][1::2]] == ["answer 1", "answer 2", "answer 3"]
    assert [m["content"] for m in request["messages"][2::2]] == list(task.user_turns)
    assert follow_up(task, request, Answer("answer 4"), 4) is None


def test_extraction_schema_is_valid_and_compiles(docs):
    jsonschema.Draft202012Validator.check_schema(workloads.EXTRACTION_SCHEMA)
    jsonschema.validate({"people": [{"name": "Holmes", "role": "detective"}], "places": ["London"],
                         "topic": "a royal scandal", "tone": "tense"}, workloads.EXTRACTION_SCHEMA)
    fmt = build("extraction", 1, docs)[0].request["response_format"]
    assert fmt == {"type": "json_schema",
                   "json_schema": {"name": "passage_facts", "schema": workloads.EXTRACTION_SCHEMA}}
    assert json_schema_grammar(fmt["json_schema"]["schema"], param="response_format")


def test_passages_are_whole_paragraphs_of_at_least_the_size(docs):
    cut = workloads.passages(docs[0], 2400)
    assert all(len(p) >= 2400 for p in cut[:-1]) and len(cut) > 10
    assert "\n\n".join(cut) == "\n\n".join(p.strip() for p in docs[0].text.split("\n\n") if p.strip())
