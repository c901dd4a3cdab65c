"""The requests of ``litellm-flm bench --workloads``: six kinds of use, built at run time from
data that ships with the package or is on every machine, none of it ever trained on.

- ``chat``: one-turn chat requests of our own (``texts/chat_prompts.jsonl``, eight categories as
  MT-Bench's), or with a path the first turns of MT-Bench's ``question.jsonl`` (same format:
  ``{"turns": [...], ...}`` a line);
- ``multi-turn``: the conversations of ``texts/conversations.jsonl`` (ours), four user turns each,
  the later ones asking to revise the earlier answers; each turn resends the whole history (the
  tag's own answers), as a chat client does;
- ``code-edit``: a function of Python's standard library, its source as ``inspect.getsource``
  gives it on this machine (``CODE_FUNCTIONS``), with one of four instructions (``EDITS``):
  rename it, add type hints, add a docstring (its own docstring removed first), or fix a bug
  injected into it (``inject_bug``: the first comparison of its body inverted); the answer is
  mostly a copy of the source;
- ``rag``: a question or a summary over a passage of a bench document (``documents.py``);
- ``agent``: tools with JSON Schema parameters (``TOOLS``), ``tool_choice`` ``required`` or
  ``auto``; each tool call gets a result (``tool_result``, computed from the arguments) and the
  conversation goes on for up to ``AGENT_TOOL_ROUNDS`` rounds of results;
- ``extraction``: ``response_format`` ``json_schema`` (``EXTRACTION_SCHEMA``) filled from a
  shorter passage of a bench document.

Never trained on: the draft's training prompts (``flm_train``) read none of these files, and its
standard-library passages come from other modules than ``CODE_FUNCTIONS``' (a test checks it).

A ``Task`` is the first request of a conversation (LiteLLM keyword arguments without the model
and the sampler); ``follow_up`` gives the next request from an answer, or None when the
conversation is over. Everything here is deterministic: the same arguments give the same
requests, and the same answers the same follow-ups. Task ``i`` of a workload differs from every
task before it as long as its data lasts (``build`` says how far), so that a run can give each
request a prompt the engine has not answered before.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flm_bench.documents import TEXTS_DIR, Document
from flm_runtime import InvalidRequestError

WORKLOADS = ("chat", "multi-turn", "code-edit", "rag", "agent", "extraction")
CHAT_PROMPTS_FILE = TEXTS_DIR / "chat_prompts.jsonl"
CONVERSATIONS_FILE = TEXTS_DIR / "conversations.jsonl"

# Module-level functions in pure Python that Python 3.10 to 3.13 ship as source files (frozen
# modules such as posixpath have none), each with a comparison in its body, from modules that
# flm_train's standard-library passages do not read.
CODE_FUNCTIONS = (
    "linecache.getline", "getopt.short_has_arg", "getopt.long_has_args", "base64.b64encode",
    "inspect.cleandoc", "wsgiref.util.shift_path_info", "urllib.request.parse_http_list",
    "urllib.request.parse_keqv_list",
)
EDITS = ("rename", "type-hints", "docstring", "fix-bug")
# Each comparison operator and the one that inverts it (ast class -> source text).
INVERSE_OPS = {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Lt: ("<", ">="), ast.GtE: (">=", "<"),
               ast.Gt: (">", "<="), ast.LtE: ("<=", ">"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
               ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}

RAG_SYSTEM = "Answer the user's request using only the document they give."
RAG_QUESTIONS = (
    "Summarize this passage in three sentences.",
    "Who are the people named in this passage, and what does each of them do?",
    "What is the main point of this passage? Quote the sentence that states it best.",
    "List the places, dates and numbers mentioned in this passage.",
)
RAG_PASSAGE_CHARS = 2400  # about 550 smollm2 tokens: a retrieved chunk or two
EXTRACTION_PASSAGE_CHARS = 1000

AGENT_SYSTEM = "You are an assistant with tools. Call a tool whenever you need information you do not have."
AGENT_TOOL_ROUNDS = 2  # requests that send tool results back, after the first
AGENT_REQUESTS = (
    "What is the weather in Lisbon right now, and how much is 250 euros in US dollars?",
    "I am travelling to Oslo tomorrow. Check the weather there and search my notes for the packing list.",
    "Find my notes about the budget meeting and convert 1200 US dollars to euros.",
    "Compare the weather in Madrid and in Helsinki, in Fahrenheit.",
    "How much is 90 British pounds in Norwegian kroner? Also, what did I write about groceries?",
    "Is it warmer in Cairo or in Dublin today? Answer with both temperatures.",
    "Search my notes for anything about the hotel, then tell me the weather in that city.",
    "Convert 5000 Japanese yen to euros and to US dollars.",
)
TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money at today's exchange rate.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "description": "ISO 4217 code, such as EUR"},
            "to_currency": {"type": "string", "description": "ISO 4217 code, such as USD"}},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "search_notes", "description": "Search the user's notes; returns the matching notes.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["query"]}}},
)
WEATHER = ("sunny", "cloudy", "light rain", "windy", "snow showers")
# Units of each currency per euro (a fixed table; other codes get a rate from their name).
RATES = {"EUR": 1.0, "USD": 1.08, "GBP": 0.85, "NOK": 11.6, "JPY": 162.0}
NOTES = (
    ("Packing list", "passport, charger, rain jacket, two books"),
    ("Budget meeting", "travel budget cut by 10%; next review on the 14th"),
    ("Oslo trip", "hotel near the central station, check-in after 15:00"),
    ("Groceries", "milk, bread, apples, coffee"),
)

EXTRACTION_SYSTEM = "Extract the requested facts from the user's text as JSON."
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
            "required": ["name", "role"], "additionalProperties": False}},
        "places": {"type": "array", "items": {"type": "string"}},
        "topic": {"type": "string"},
        "tone": {"type": "string", "enum": ["neutral", "tense", "cheerful", "sad", "argumentative"]},
    },
    "required": ["people", "places", "topic", "tone"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Task:
    """The first request of one conversation of a workload.

    Attributes:
        workload: a name of ``WORKLOADS``.
        name: which data it comes from (``chat-2``, ``base64.b64encode fix-bug``, ...).
        request: LiteLLM keyword arguments other than ``model`` and the sampler: ``messages``,
            ``max_tokens``, and where the workload has them ``tools``, ``tool_choice``,
            ``response_format``.
        user_turns: the user messages sent after each answer, in order (``multi-turn``).
        tool_rounds: requests at most that send tool results back after the first (``agent``).
    """

    workload: str
    name: str
    request: dict
    user_turns: tuple[str, ...] = ()
    tool_rounds: int = 0

    @property
    def max_requests(self) -> int:
        """Requests in the longest conversation this task can make."""
        return 1 + len(self.user_turns) + self.tool_rounds


@dataclass(frozen=True)
class Answer:
    """What ``follow_up`` needs of an answer: its text and its tool calls (name, arguments JSON)."""

    content: str | None
    tool_calls: tuple[tuple[str, str], ...] = field(default=())


def build(workload: str, n: int, *, max_tokens: int, documents: Sequence[Document],
          chat_prompts: str | Path | None = None) -> list[Task]:
    """The first ``n`` tasks of ``workload`` (a name of ``WORKLOADS``); its data is cycled when
    ``n`` is larger than it.

    Tasks differ from one another up to: ``chat`` the file's questions (12 of ours, 80 of
    MT-Bench's), ``multi-turn`` 6, ``code-edit`` 32 (8 functions x 4 edits), ``agent`` 8,
    ``rag`` and ``extraction`` the passages of the documents (dozens).

    Args:
        documents: the passages of ``rag`` and ``extraction`` come from these, in turn.
        chat_prompts: ``chat``'s question file (MT-Bench's ``question.jsonl`` format); None: ours.
    Raises:
        InvalidRequestError: an unknown workload; ``chat_prompts`` has a line without ``turns``.
        FileNotFoundError: ``chat_prompts`` does not exist.
    """
    builders = {"chat": lambda: chat(n, max_tokens, chat_prompts), "multi-turn": lambda: multi_turn(n, max_tokens),
                "code-edit": lambda: code_edit(n, max_tokens), "rag": lambda: rag(n, max_tokens, documents),
                "agent": lambda: agent(n, max_tokens), "extraction": lambda: extraction(n, max_tokens, documents)}
    if workload not in builders:
        raise InvalidRequestError(f"unknown workload {workload!r}; the workloads are {', '.join(WORKLOADS)}",
                                  param="--workloads")
    return builders[workload]()


def parse_workloads(text: str) -> list[str]:
    """``all`` or comma-separated names of ``WORKLOADS`` -> the names, in ``WORKLOADS``' order.

    Raises:
        InvalidRequestError: an unknown name, or none.
    """
    names = [w.strip() for w in text.split(",") if w.strip()]
    if names == ["all"]:
        return list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise InvalidRequestError(f"--workloads takes all or some of {', '.join(WORKLOADS)}, got {text!r}",
                                  param="--workloads")
    return [w for w in WORKLOADS if w in names]


def follow_up(task: Task, request: dict, answer: Answer, answered: int) -> dict | None:
    """The request after ``request`` got ``answer``, or None when the conversation is over.

    Args:
        request: the request just answered (``task.request`` or a follow-up of it).
        answered: requests of the conversation answered so far, this one included (1 after the
            first).
    Returns:
        ``multi-turn``: the history, the answer as an assistant message and the next user turn;
        ``agent`` (while the answer calls tools and ``task.tool_rounds`` allow): the history, the
        answer's calls as an assistant message (ids ``call_<round>_<k>``, the same on both tags)
        and one ``tool`` message per call with its ``tool_result``; the last round lets the model
        choose (``tool_choice`` ``auto``) so that it can answer.
    """
    messages = request["messages"]
    if answered <= len(task.user_turns):
        turn = [{"role": "assistant", "content": answer.content or ""},
                {"role": "user", "content": task.user_turns[answered - 1]}]
        return request | {"messages": messages + turn}
    if answered <= task.tool_rounds and answer.tool_calls:
        ids = [f"call_{answered}_{k}" for k in range(len(answer.tool_calls))]
        calls = [{"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                 for i, (name, arguments) in zip(ids, answer.tool_calls, strict=True)]
        results = [{"role": "tool", "tool_call_id": i, "content": tool_result(name, arguments)}
                   for i, (name, arguments) in zip(ids, answer.tool_calls, strict=True)]
        choice = "auto" if answered == task.tool_rounds else request["tool_choice"]
        return request | {"messages": [*messages, {"role": "assistant", "content": None, "tool_calls": calls},
                                       *results], "tool_choice": choice}
    return None


# --- chat and multi-turn -------------------------------------------------------------------------

def conversations(path: str | Path) -> list[list[str]]:
    """The user turns of each conversation of ``path`` (MT-Bench's ``question.jsonl`` format:
    ``{"turns": [...], ...}`` a line).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        InvalidRequestError: a line has no ``turns``.
    """
    path = Path(path).expanduser()
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            turns = json.loads(line).get("turns")
            if not turns:
                raise InvalidRequestError(f"{path}: line {i + 1} has no 'turns'", param="--prompts")
            out.append(list(turns))
    return out


def chat(n: int, max_tokens: int, path: str | Path | None = None) -> list[Task]:
    firsts = [turns[0] for turns in conversations(CHAT_PROMPTS_FILE if path is None else path)]
    return [Task("chat", f"chat-{i % len(firsts) + 1}",
                 {"messages": [{"role": "user", "content": firsts[i % len(firsts)]}], "max_tokens": max_tokens})
            for i in range(n)]


def multi_turn(n: int, max_tokens: int) -> list[Task]:
    convs = conversations(CONVERSATIONS_FILE)
    return [Task("multi-turn", f"conversation-{i % len(convs) + 1}",
                 {"messages": [{"role": "user", "content": convs[i % len(convs)][0]}], "max_tokens": max_tokens},
                 user_turns=tuple(convs[i % len(convs)][1:]))
            for i in range(n)]


# --- code edit -----------------------------------------------------------------------------------

def function_source(qualified: str) -> str:
    """``inspect.getsource`` of the function ``module.name``."""
    module, name = qualified.rsplit(".", 1)
    return inspect.getsource(getattr(importlib.import_module(module), name))


def _function_node(source: str) -> ast.FunctionDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef), f"not a function: {source[:60]!r}"
    return node


def _docstring_node(fn: ast.FunctionDef) -> ast.Expr | None:
    first = fn.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return first if is_doc and isinstance(first.value.value, str) else None


def without_docstring(source: str) -> str:
    """``source`` (one function) without the lines of its docstring; unchanged if it has none."""
    doc = _docstring_node(_function_node(source))
    if doc is None:
        return source
    lines = source.splitlines(keepends=True)
    return "".join(lines[:doc.lineno - 1] + lines[doc.end_lineno:])


def inject_bug(source: str) -> str:
    """``source`` (one function) with the first comparison after its docstring inverted
    (``INVERSE_OPS``: ``==`` becomes ``!=``, ``<`` becomes ``>=``, ``is`` becomes ``is not``, ...),
    in place: only the operator's text changes.

    Raises:
        ValueError: the body has no comparison.
    """
    fn = _function_node(source)
    body = fn.body[1:] if _docstring_node(fn) else fn.body
    compare = next((n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Compare)), None)
    if compare is None:
        raise ValueError(f"function {fn.name} has no comparison to invert")
    left, right = compare.left, compare.comparators[0]
    assert left.end_lineno == right.lineno, "an operator split over lines"
    lines = source.splitlines(keepends=True)
    line = lines[left.end_lineno - 1].encode()  # ast offsets count UTF-8 bytes
    old, new = INVERSE_OPS[type(compare.ops[0])]
    between = line[left.end_col_offset:right.col_offset].decode()
    assert between.split() == old.split(), f"{between!r} is not {old!r}"
    lines[left.end_lineno - 1] = (line[:left.end_col_offset].decode() + between.replace(old, new, 1)
                                  + line[right.col_offset:].decode())
    return "".join(lines)


def code_edit_prompt(qualified: str, edit: str) -> str:
    """The user message of editing function ``qualified`` (``module.name``) by ``edit`` (a name of
    ``EDITS``)."""
    module, name = qualified.rsplit(".", 1)
    source = function_source(qualified)
    instruction = {
        "rename": f"Rename the function `{name}` to `{module.rsplit('.', 1)[-1]}_{name}`; change nothing else.",
        "type-hints": "Add type hints to the parameters and the return value of this function; change nothing else.",
        "docstring": "Add a docstring to this function that says what it does, its arguments and what it returns.",
        "fix-bug": "This function has a bug: one comparison is wrong. Find it and fix it.",
    }[edit]
    if edit == "docstring":
        source = without_docstring(source)
    elif edit == "fix-bug":
        source = inject_bug(source)
    return (f"Here is a function from Python's `{module}` module:\n\n```python\n{source}```\n\n{instruction} "
            "Reply with the whole function in one code block.")


def code_edit(n: int, max_tokens: int) -> list[Task]:
    """Task ``i`` edits function ``i`` (cycled) by edit ``i + i // 8`` (cycled): every pair of a
    function and an edit once in 32 tasks."""
    tasks = []
    for i in range(n):
        fn, edit = CODE_FUNCTIONS[i % len(CODE_FUNCTIONS)], EDITS[(i + i // len(CODE_FUNCTIONS)) % len(EDITS)]
        messages = [{"role": "user", "content": code_edit_prompt(fn, edit)}]
        tasks.append(Task("code-edit", f"{fn} {edit}", {"messages": messages, "max_tokens": max_tokens}))
    return tasks


# --- rag and extraction --------------------------------------------------------------------------

def passages(document: Document, chars: int) -> list[str]:
    """``document`` cut into passages of whole paragraphs (blank-line separated), each the
    shortest run of paragraphs from where the previous one ended with at least ``chars``
    characters (the last one may be shorter)."""
    out, current = [], []
    for para in (p.strip() for p in document.text.split("\n\n")):
        if para:
            current.append(para)
            if sum(map(len, current)) >= chars:
                out.append("\n\n".join(current))
                current = []
    if current:
        out.append("\n\n".join(current))
    return out


def _passage(documents: Sequence[Document], i: int, chars: int) -> tuple[Document, int, str]:
    """Passage ``i // len(documents)`` of document ``i % len(documents)`` (cycled within it)."""
    doc = documents[i % len(documents)]
    cut = passages(doc, chars)
    k = (i // len(documents)) % len(cut)
    return doc, k, cut[k]


def rag(n: int, max_tokens: int, documents: Sequence[Document]) -> list[Task]:
    """Task ``i``: question ``i`` (cycled) over passage ``i // len(documents)`` of document
    ``i % len(documents)``."""
    tasks = []
    for i in range(n):
        doc, k, text = _passage(documents, i, RAG_PASSAGE_CHARS)
        question = RAG_QUESTIONS[i % len(RAG_QUESTIONS)]
        messages = [{"role": "system", "content": RAG_SYSTEM},
                    {"role": "user", "content": f"Document ({doc.title}):\n\n{text}\n\n{question}"}]
        tasks.append(Task("rag", f"{doc.name} #{k + 1}", {"messages": messages, "max_tokens": max_tokens}))
    return tasks


def extraction(n: int, max_tokens: int, documents: Sequence[Document]) -> list[Task]:
    """Task ``i``: ``EXTRACTION_SCHEMA`` filled from passage ``i // len(documents)`` of document
    ``i % len(documents)`` (``EXTRACTION_PASSAGE_CHARS`` passages)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "passage_facts", "schema": EXTRACTION_SCHEMA}}
    tasks = []
    for i in range(n):
        doc, k, text = _passage(documents, i, EXTRACTION_PASSAGE_CHARS)
        messages = [{"role": "system", "content": EXTRACTION_SYSTEM},
                    {"role": "user", "content": "Give the people (with their role), the places, the topic and the "
                                                f"tone of this text.\n\n{text}"}]
        tasks.append(Task("extraction", f"{doc.name} #{k + 1}",
                          {"messages": messages, "max_tokens": max_tokens, "response_format": fmt}))
    return tasks


# --- agent ---------------------------------------------------------------------------------------

def agent(n: int, max_tokens: int) -> list[Task]:
    """Task ``i``: request ``i`` (cycled) with every tool, ``tool_choice`` ``required`` for even
    ``i`` and ``auto`` for odd."""
    tasks = []
    for i in range(n):
        choice = "required" if i % 2 == 0 else "auto"
        messages = [{"role": "system", "content": AGENT_SYSTEM},
                    {"role": "user", "content": AGENT_REQUESTS[i % len(AGENT_REQUESTS)]}]
        tasks.append(Task("agent", f"agent-{i % len(AGENT_REQUESTS) + 1} {choice}",
                          {"messages": messages, "max_tokens": max_tokens, "tools": [dict(t) for t in TOOLS],
                           "tool_choice": choice}, tool_rounds=AGENT_TOOL_ROUNDS))
    return tasks


def _pick(key: str, n: int) -> int:
    """A number in [0, n) fixed by ``key`` (CRC-32: the same on every run and machine)."""
    return zlib.crc32(key.lower().encode()) % n


def tool_result(name: str, arguments: str) -> str:
    """The result of calling tool ``name`` (of ``TOOLS``) with ``arguments`` (JSON), as JSON:
    made up, but the same for the same arguments; ``{"error": ...}`` for arguments that are not
    a JSON object or a tool we do not have (as a real tool would answer)."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        return json.dumps({"error": f"arguments must be a JSON object, got {arguments!r}"})
    if name == "get_weather":
        city = str(args.get("city", ""))
        celsius = _pick(city, 36) - 6
        unit = args.get("unit", "celsius")
        temp = celsius if unit != "fahrenheit" else round(celsius * 9 / 5 + 32)
        return json.dumps({"city": city, "temperature": temp, "unit": unit,
                           "conditions": WEATHER[_pick(city + "/sky", len(WEATHER))]})
    if name == "convert_currency":
        src, dst = str(args.get("from_currency", "")).upper(), str(args.get("to_currency", "")).upper()
        rate = {c: RATES.get(c, 0.5 + _pick(c, 200) / 10) for c in (src, dst)}
        amount = args.get("amount", 0)
        value = amount * rate[dst] / rate[src] if isinstance(amount, (int, float)) else 0
        return json.dumps({"amount": amount, "from": src, "to": dst, "result": round(value, 2)})
    if name == "search_notes":
        words = str(args.get("query", "")).lower().split()
        found = [{"title": t, "text": x} for t, x in NOTES if any(w in (t + " " + x).lower() for w in words)]
        limit = args.get("limit", 3)
        return json.dumps({"notes": found[:limit if isinstance(limit, int) and limit > 0 else 3]})
    return json.dumps({"error": f"no tool named {name!r}"})

