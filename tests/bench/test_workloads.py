"""The requests of ``litellm-flm bench --workloads`` (``flm_bench.workloads``): exact, deterministic,
and in the shapes LiteLLM and the provider take (tools and response formats checked against JSON
Schema and compiled by the provider's grammar; tool messages sent through LiteLLM)."""

from __future__ import annotations

import ast
import importlib
import inspect
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
    assert all(t.workload == name and t.request["max_tokens"] == 64 for t in tasks)
    assert len({json.dumps(t.request["messages"]) for t in tasks}) == 6


def test_task_names_and_request_fields(docs):
    assert [t.name for t in build("chat", 2, docs)] == ["chat-1", "chat-2"]
    assert [t.name for t in build("code-edit", 10, docs)][::3] == [
        "linecache.getline rename", "base64.b64encode fix-bug", "urllib.request.parse_http_list docstring",
        "getopt.short_has_arg docstring"]
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
    assert workloads.parse_workloads("all") == list(workloads.WORKLOADS)
    assert workloads.parse_workloads("agent, chat") == ["chat", "agent"]
    with pytest.raises(InvalidRequestError, match="summaries"):
        workloads.parse_workloads("chat,summaries")


# --- code edit -----------------------------------------------------------------------------------

def _first_compare(tree: ast.Module) -> ast.Compare:
    """The first comparison after the docstring of the function ``tree`` holds."""
    fn = tree.body[0]
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    return next(n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Compare))


@pytest.mark.parametrize("fn", workloads.CODE_FUNCTIONS)
def test_code_edit_sends_the_real_source_and_injects_one_inverted_comparison(fn):
    module, name = fn.rsplit(".", 1)
    source = inspect.getsource(getattr(importlib.import_module(module), name))
    assert workloads.function_source(fn) == source
    assert f"```python\n{source}```" in workloads.code_edit_prompt(fn, "rename")
    buggy = workloads.inject_bug(source)
    assert f"```python\n{buggy}```" in workloads.code_edit_prompt(fn, "fix-bug")
    assert sum(a != b for a, b in zip(source.splitlines(), buggy.splitlines(), strict=True)) == 1
    # The first comparison's operator is inverted, and nothing else in the tree moved.
    op_class = {text: cls for cls, (text, _) in workloads.INVERSE_OPS.items()}
    orig, bug = ast.parse(source), ast.parse(buggy)
    before, after = _first_compare(orig), _first_compare(bug)
    assert type(after.ops[0]) is op_class[workloads.INVERSE_OPS[type(before.ops[0])][1]]
    after.ops[0] = type(before.ops[0])()
    assert ast.dump(bug) == ast.dump(orig)


def test_inject_bug_and_docstring_removal_exactly():
    src = 'def f(a, b=None):\n    """Doc\n    string."""\n    if b is not None:\n        return a == 1\n'
    assert workloads.inject_bug(src) == src.replace("b is not None", "b is None")
    assert workloads.without_docstring(src) == "def f(a, b=None):\n    if b is not None:\n        return a == 1\n"
    assert workloads.inject_bug("def g(x):\n    return 1 <= x <= 3\n") == "def g(x):\n    return 1 > x <= 3\n"
    with pytest.raises(ValueError, match="no comparison"):
        workloads.inject_bug("def h(x):\n    return x\n")


def test_docstring_edit_sends_the_source_without_its_docstring():
    prompt = workloads.code_edit_prompt("inspect.cleandoc", "docstring")
    source = workloads.function_source("inspect.cleandoc")
    stripped = workloads.without_docstring(source)
    assert ast.get_docstring(ast.parse(source).body[0]) and ast.get_docstring(ast.parse(stripped).body[0]) is None
    assert f"```python\n{stripped}```" in prompt and "Add a docstring" in prompt


def test_code_edit_functions_are_not_in_the_drafts_training_passages():
    """Never trained on: flm_train pastes standard-library functions into its prompts, none of ours."""
    from flm_train.composed_prompts import stdlib_passages

    _, codes = stdlib_passages()
    ours = {textwrap.dedent(workloads.function_source(fn)).rstrip() for fn in workloads.CODE_FUNCTIONS}
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
