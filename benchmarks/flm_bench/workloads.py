"""The requests of ``litellm-flm bench --workloads``: nine kinds of use, built at run time from
data that ships with the package, none of it ever trained on.

- ``chat``: one-turn chat requests of our own (``texts/chat_prompts.jsonl``, eight categories as
  MT-Bench's), or with a path the first turns of MT-Bench's ``question.jsonl`` (same format:
  ``{"turns": [...], ...}`` a line);
- ``multi-turn``: the conversations of ``texts/conversations.jsonl`` (ours), four user turns each,
  the later ones asking to revise the earlier answers; each turn resends the whole history (the
  tag's own answers), as a chat client does;
- ``code-edit``: a function of ``texts/edit_source.py`` (ours, in the manner of the standard
  library, 40-90 lines each) with one of two instructions (``EDITS``): rename a variable and add
  type hints, or add a docstring (its own removed first); the answer, the whole function, is
  mostly a copy of the source;
- ``search-replace``: the same edits on the whole file (~340 lines), the answer asked as
  search/replace blocks in Aider's edit format (``<<<<<<< SEARCH`` / ``=======`` /
  ``>>>>>>> REPLACE``);
- ``prediction``: the same requests with OpenAI's ``prediction`` (``{"type": "content",
  "content": <the file sent>}``), as editors send it;
- ``fim``: fill-in-the-middle while typing: a function of the file typed into it top to bottom,
  at each of ``FIM_PAUSES`` pauses a text completion (``prompt`` = the file up to the cursor,
  ``suffix`` = the ``FIM_SUFFIX_LINES`` lines after the function) of up to ``FIM_MAX_TOKENS`` tokens;
- ``rag``: a question or a summary over a passage of a bench document (``documents.py``);
- ``agent``: tools with JSON Schema parameters (``TOOLS``), ``tool_choice`` ``required`` or
  ``auto``; each tool call gets a result (``tool_result``, computed from the arguments) and the
  conversation goes on for up to ``AGENT_TOOL_ROUNDS`` rounds of results;
- ``extraction``: ``response_format`` ``json_schema`` (``EXTRACTION_SCHEMA``) filled from a
  shorter passage of a bench document.

Never trained on: the draft's training prompts (``flm_train``) read none of these files (its
standard-library passages come from Python's own modules; a test checks that none is ours).

A ``Task`` is the first request of a conversation (LiteLLM keyword arguments without the model
and the sampler); ``follow_up`` gives the next request from an answer, or None when the
conversation is over. Everything here is deterministic: the same arguments give the same
requests, and the same answers the same follow-ups. Task ``i`` of a workload differs from every
task before it as long as its data lasts (``build`` says how far), so that a run can give each
request a prompt the engine has not answered before.
"""

from __future__ import annotations

import ast
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flm_bench.documents import TEXTS_DIR, Document
from flm_runtime import InvalidRequestError

WORKLOADS = ("chat", "multi-turn", "code-edit", "search-replace", "prediction", "fim", "rag", "agent", "extraction")
# ``all`` of the DFlash comparison (the plain tag against its DFlash tag), and of the comparison
# with llama-server (the speculation issue's workloads).
DFLASH_WORKLOADS = ("chat", "multi-turn", "code-edit", "rag", "agent", "extraction")
PEER_WORKLOADS = ("chat", "code-edit", "search-replace", "prediction", "fim", "agent")
# Those sent as chat completions without ``prediction``: what the DFlash comparison takes.
CHAT_WORKLOADS = tuple(w for w in WORKLOADS if w not in ("prediction", "fim"))
CHAT_PROMPTS_FILE = TEXTS_DIR / "chat_prompts.jsonl"
CONVERSATIONS_FILE = TEXTS_DIR / "conversations.jsonl"

# The code workloads' file: functions of our own in the manner of the standard library, 40-90 lines
# each, every one with a docstring; the prompts call it EDIT_FILE_NAME.
EDIT_SOURCE_FILE = TEXTS_DIR / "edit_source.py"
EDIT_FILE_NAME = "textutils.py"
EDITS = ("rename-and-hints", "docstring")
# Per function of EDIT_SOURCE_FILE: the local variable its rename edit renames, and the new name.
RENAMES = {"parse_duration": ("stripped", "remaining"), "wrap_paragraphs": ("room", "line_room"),
           "read_ini_sections": ("stripped", "content"), "group_by_window": ("current", "run"),
           "format_table": ("cells", "text_cells"), "split_command": ("word", "chars"),
           "percentiles": ("data", "ordered")}
# Aider's search/replace edit format, described in our own words.
SEARCH_REPLACE_SYSTEM = (
    "You edit code. Answer with one or more search/replace blocks and nothing else. Each block is the file's "
    "name on a line of its own, then a line `<<<<<<< SEARCH`, then lines copied exactly from the file (enough "
    "of them to be found in one place only), then a line `=======`, then the lines that replace them, then a "
    "line `>>>>>>> REPLACE`. Put the blocks in the order their lines appear in the file.")
FIM_PAUSES = 6  # completions per typed function
FIM_SUFFIX_LINES = 40  # the suffix's lines: editor plugins send a window after the cursor, not the rest of the file
FIM_MAX_TOKENS = 48  # an editor's inline suggestion: a line or a few

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
        next_requests: the requests sent after each answer whatever it is, in order (``fim``: the
            pauses after the first).
    """

    workload: str
    name: str
    request: dict
    user_turns: tuple[str, ...] = ()
    tool_rounds: int = 0
    next_requests: tuple[dict, ...] = ()

    @property
    def max_requests(self) -> int:
        """Requests in the longest conversation this task can make."""
        return 1 + len(self.user_turns) + self.tool_rounds + len(self.next_requests)


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
    MT-Bench's), ``multi-turn`` 6, ``code-edit``, ``search-replace`` and ``prediction`` 14 (7
    functions x 2 edits), ``fim`` 7, ``agent`` 8, ``rag`` and ``extraction`` the passages of the
    documents (dozens).

    Args:
        documents: the passages of ``rag`` and ``extraction`` come from these, in turn.
        chat_prompts: ``chat``'s question file (MT-Bench's ``question.jsonl`` format); None: ours.
    Raises:
        InvalidRequestError: an unknown workload; ``chat_prompts`` has a line without ``turns``.
        FileNotFoundError: ``chat_prompts`` does not exist.
    """
    builders = {"chat": lambda: chat(n, max_tokens, chat_prompts), "multi-turn": lambda: multi_turn(n, max_tokens),
                "code-edit": lambda: code_edit(n, max_tokens),
                "search-replace": lambda: search_replace(n, max_tokens),
                "prediction": lambda: search_replace(n, max_tokens, predicted=True), "fim": lambda: fim(n, max_tokens),
                "rag": lambda: rag(n, max_tokens, documents),
                "agent": lambda: agent(n, max_tokens), "extraction": lambda: extraction(n, max_tokens, documents)}
    if workload not in builders:
        raise InvalidRequestError(f"unknown workload {workload!r}; the workloads are {', '.join(WORKLOADS)}",
                                  param="--workloads")
    return builders[workload]()


def parse_workloads(text: str, every: Sequence[str] = DFLASH_WORKLOADS,
                    allowed: Sequence[str] = WORKLOADS) -> list[str]:
    """``all`` (``every``) or comma-separated names of ``allowed`` -> the names, in ``WORKLOADS``'
    order.

    Raises:
        InvalidRequestError: a name not in ``allowed``, or none.
    """
    names = [w.strip() for w in text.split(",") if w.strip()]
    if names == ["all"]:
        names = list(every)
    unknown = [w for w in names if w not in allowed]
    if unknown or not names:
        raise InvalidRequestError(f"--workloads takes all or some of {', '.join(allowed)}, got {text!r}",
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
        choose (``tool_choice`` ``auto``) so that it can answer; ``fim``: the next pause's request,
        whatever the answer.
    """
    if task.next_requests:
        return task.next_requests[answered - 1] if answered <= len(task.next_requests) else None
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


# --- code edits and fill-in-the-middle ----------------------------------------------------------

def edit_file() -> str:
    """The text of ``EDIT_SOURCE_FILE``."""
    return EDIT_SOURCE_FILE.read_text(encoding="utf-8")


def edit_functions() -> dict[str, tuple[int, int]]:
    """Each top-level function of ``EDIT_SOURCE_FILE``: its name -> its first and last line
    (0-based, the last included), in the file's order."""
    tree = ast.parse(edit_file())
    return {n.name: (n.lineno - 1, n.end_lineno - 1) for n in tree.body if isinstance(n, ast.FunctionDef)}


def _function_node(source: str) -> ast.FunctionDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef), f"not a function: {source[:60]!r}"
    return node


def function_source(name: str) -> str:
    """The lines of function ``name`` of ``EDIT_SOURCE_FILE``, each ending with a newline."""
    first, last = edit_functions()[name]
    return "".join(edit_file().splitlines(keepends=True)[first:last + 1])


def without_docstring(source: str) -> str:
    """``source`` (one function) without the lines of its docstring; unchanged if it has none."""
    fn = _function_node(source)
    first = fn.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return source
    lines = source.splitlines(keepends=True)
    return "".join(lines[:first.lineno - 1] + lines[first.end_lineno:])


def edit_pair(i: int) -> tuple[str, str]:
    """Task ``i``'s function of ``EDIT_SOURCE_FILE`` and edit of ``EDITS`` (each cycled): function
    ``i % functions``, edit ``i % functions + i // functions``, so that every pair comes once in 2 x
    functions tasks."""
    names = list(edit_functions())
    return names[i % len(names)], EDITS[(i % len(names) + i // len(names)) % len(EDITS)]


def edit_instruction(name: str, edit: str) -> str:
    """What editing function ``name`` by ``edit`` (a name of ``EDITS``) asks."""
    if edit == "rename-and-hints":
        old, new = RENAMES[name]
        return (f"In `{name}`, rename the variable `{old}` to `{new}` everywhere it is used, and add type hints to "
                "the function's parameters and return value. Change nothing else.")
    return (f"Add a docstring to `{name}` that says what it does, what each argument means, what it returns and "
            "which errors it raises. Change nothing else.")


def edited_source(name: str, edit: str) -> str:
    """The file as an edit of function ``name`` sends it: without that function's docstring for a
    ``docstring`` edit, as it is otherwise."""
    text = edit_file()
    return text.replace(function_source(name), without_docstring(function_source(name)), 1) if edit == "docstring" \
        else text


def code_edit(n: int, max_tokens: int) -> list[Task]:
    """Task ``i``: one function of ``EDIT_SOURCE_FILE`` edited (``edit_pair``), the answer asked as
    the whole function."""
    tasks = []
    for i in range(n):
        name, edit = edit_pair(i)
        source = function_source(name)
        if edit == "docstring":
            source = without_docstring(source)
        prompt = (f"Here is a function from `{EDIT_FILE_NAME}`:\n\n```python\n{source}```\n\n"
                  f"{edit_instruction(name, edit)} Reply with the whole function in one code block.")
        tasks.append(Task("code-edit", f"{name} {edit}",
                          {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}))
    return tasks


def search_replace(n: int, max_tokens: int, *, predicted: bool = False) -> list[Task]:
    """Task ``i``: the edit of ``edit_pair(i)`` on the whole ``EDIT_SOURCE_FILE``
    (``edited_source``), the answer asked as search/replace blocks in Aider's format
    (``SEARCH_REPLACE_SYSTEM``). ``predicted``: the ``prediction`` workload, the same request with
    OpenAI's ``prediction`` set to the file sent."""
    tasks = []
    for i in range(n):
        name, edit = edit_pair(i)
        text = edited_source(name, edit)
        messages = [{"role": "system", "content": SEARCH_REPLACE_SYSTEM},
                    {"role": "user",
                     "content": f"{EDIT_FILE_NAME}\n```python\n{text}```\n\n{edit_instruction(name, edit)}"}]
        request = {"messages": messages, "max_tokens": max_tokens}
        if predicted:
            request["prediction"] = {"type": "content", "content": text}
        tasks.append(Task("prediction" if predicted else "search-replace", f"{name} {edit}", request))
    return tasks


def fim_pauses(name: str, pauses: int) -> list[tuple[str, str]]:
    """The (prefix, suffix) of each pause while function ``name`` of ``EDIT_SOURCE_FILE`` is typed
    into the file top to bottom: ``pauses`` lines of its code (after the signature and the
    docstring), spread evenly (blank lines skipped), the cursor in the middle of each line's text;
    the prefix is the file up to the cursor, the suffix a newline and the ``FIM_SUFFIX_LINES``
    lines of the file after the function (what is not typed yet of the function is not there).

    Raises:
        ValueError: the function has fewer than ``pauses`` non-blank lines of code.
    """
    first, last = edit_functions()[name]
    lines = edit_file().splitlines(keepends=True)
    source = function_source(name)
    code = first + source.count("\n") - without_docstring(source).count("\n") + 1  # after the docstring
    body = [k for k in range(code, last + 1) if lines[k].strip()]
    if len(body) < pauses:
        raise ValueError(f"{name} has {len(body)} lines to pause in, fewer than {pauses}")
    before, after = "".join(lines[:first]), "".join(lines[last + 1:last + 1 + FIM_SUFFIX_LINES])
    out = []
    for j in range(pauses):
        k = body[j * len(body) // pauses]
        text = lines[k].rstrip("\n")
        indent = len(text) - len(text.lstrip())
        cursor = indent + (len(text) - indent) // 2
        out.append((before + "".join(lines[first:k]) + text[:cursor], "\n" + after))
    return out


def fim(n: int, max_tokens: int) -> list[Task]:
    """Task ``i``: function ``i`` of ``EDIT_SOURCE_FILE`` (cycled) typed into the file, a text
    completion (``prompt`` = the prefix, ``suffix``) of ``min(max_tokens, FIM_MAX_TOKENS)``
    tokens at each of ``FIM_PAUSES`` pauses (``fim_pauses``), one request after the other
    whatever the answers."""
    names = list(edit_functions())
    tokens = min(max_tokens, FIM_MAX_TOKENS)
    tasks = []
    for i in range(n):
        name = names[i % len(names)]
        requests = [{"prompt": prefix, "suffix": suffix, "max_tokens": tokens}
                    for prefix, suffix in fim_pauses(name, FIM_PAUSES)]
        tasks.append(Task("fim", f"{name} typed", requests[0], next_requests=tuple(requests[1:])))
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

