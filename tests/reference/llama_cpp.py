"""Record llama.cpp's reference values for a GGUF: token ids, perplexity over the test passage,
the output text of every token, and a chat with tools rendered by the GGUF's chat template.

llama.cpp shares nothing with ``flm_runtime`` but the GGUF file: its tokenizer (``llm_tokenizer_spm``,
``llm_tokenizer_bpe``) and its forward passes are its own. Each subcommand writes one JSON fixture,
with the command, the date and the llama.cpp commit in it:

- ``tokens``: ``llama-tokenize`` ids of ``TEXTS`` and of the perplexity passage as
  ``llama-perplexity`` reads it (``-f`` drops the file's one trailing newline), BOS included where
  the model's ``add_bos_token`` asks for it;
- ``perplexity``: ``llama-perplexity``'s final estimate over ``tests/data/wizard_of_oz_ch1.txt``
  with a context of ``N_CTX`` tokens;
- ``pieces``: the text each token id stands for in llama.cpp's output (``llama_token_to_piece``
  without ``special``, what ``llama-server`` sends): the ids that render as nothing, as ranges,
  and the SHA-256 of all the pieces (``pieces_digest``); ``token_pieces.c`` (here) prints them,
  built with ``cc`` against the llama.cpp build;
- ``chat-template``: ``CONVERSATION`` (messages and tools) as ``llama-server --jinja`` renders it
  with the GGUF's own chat template (its ``/apply-template`` endpoint).

What ``llama-perplexity`` computes (``tools/perplexity/perplexity.cpp``, ``perplexity()``): the text
is tokenized (BOS first when the model adds one); it is cut into ``len(ids) // n_ctx`` chunks of
``n_ctx`` tokens (the tail left over is not scored), each evaluated alone from an empty KV cache,
its first token replaced by BOS when the model adds one; in each chunk only the second half is
scored: the logits at positions ``n_ctx/2 .. n_ctx-2`` predict tokens ``n_ctx/2 + 1 .. n_ctx-1``
(``n_ctx/2 - 1`` tokens a chunk). The figure is exp(sum of those negative log-likelihoods / their
count), over all chunks together. ``-b`` equal to ``-c`` makes each chunk one batch of one sequence
(the figure does not depend on it). ``-fa off -ctk f32 -ctv f32``: llama.cpp's defaults (its
flash-attention kernel on the CPU, a float16 KV cache) round K, V and the scores to float16, which
moves the figure by about 1% over this short passage (SmolLM2: 21.9446 by default, 21.9129 without
flash attention, 21.8490 with a float32 cache too; ours 21.69, and over the first chunk alone
18.0914 against llama.cpp's 18.0931). The weights stay as stored; llama.cpp still quantizes the
activations to 8 bits for the quantized matrix products, ours (float32 reference path) does not.
``tests/models/perplexity.py`` computes ours the same way.

Run (not part of CI; needs a llama.cpp build with the llama-tokenize, llama-perplexity and
llama-server targets, its shared libraries beside them):
    python tests/reference/llama_cpp.py tokens LLAMA_CPP_DIR GGUF tests/data/OUT.json
    python tests/reference/llama_cpp.py perplexity LLAMA_CPP_DIR GGUF tests/data/OUT.json
    python tests/reference/llama_cpp.py pieces LLAMA_CPP_DIR GGUF tests/data/OUT.json
    python tests/reference/llama_cpp.py chat-template LLAMA_CPP_DIR GGUF tests/data/OUT.json
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "wizard_of_oz_ch1.txt"
N_CTX = 128  # tokens: the passage has ~330, and llama-perplexity needs at least 2 * n_ctx
THREADS = 2

# Plain prose, unicode from several scripts, digits, runs of spaces, newlines and tabs, a character
# no piece covers (U+F0000, private use: byte fallback), HTML tags (user-defined tokens in Gemma 3).
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — 你好，世界！ こんにちは。 Привет, мир! Ελληνικά 😀🎉👍🏽",
    "In 1900, 3.14159 and 1234567890 apples cost $42.50 (or 7%).",
    "a  b   c    d     e      f  ",
    "  two spaces before, one after ",
    "line one\nline two\n\n\nafter three newlines\r\n\tand a tab\n",
    "private use \ue000 and \U000f0000 fall back to bytes",
    "<b>bold</b> and <td>cell</td>",
]

# A chat with tools: the system turn, parallel calls (arguments as OpenAI's JSON strings), two
# results in one user turn, the answer, and a new question; non-ASCII text throughout.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city, «HH:MM»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "18 degrees"},
        {"role": "assistant", "content": "Paris: 21 °C; Zürich: 18 °C."},
        {"role": "user", "content": "And what time is it in Zürich?"},
    ],
    "tools": [WEATHER, TIME],
}


def header(llama_dir: Path, gguf: Path, argv: list[str]) -> dict:
    commit = subprocess.run(["git", "-C", str(llama_dir), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    return {
        "llama.cpp": commit,
        "date": datetime.date.today().isoformat(),
        "model": gguf.name,
        "model_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
        "recorded_by": " ".join(["python", "tests/reference/llama_cpp.py", *argv]),
    }


def tokenize(bin_dir: Path, gguf: Path, text: str) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "--stdin", "--ids", "--no-escape",
                          "--log-disable"], input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def record_tokens(bin_dir: Path, gguf: Path) -> dict:
    return {
        "command": f"llama-tokenize -m {gguf.name} --stdin --ids --no-escape --log-disable < TEXT",
        "cases": [{"text": t, "ids": tokenize(bin_dir, gguf, t)} for t in TEXTS],
        "passage": {"file": PASSAGE.name, "trailing_newline_dropped": True,
                    "ids": tokenize(bin_dir, gguf, PASSAGE.read_text(encoding="utf-8").removesuffix("\n"))},
    }


def record_perplexity(bin_dir: Path, gguf: Path) -> dict:
    args = ["-f", str(PASSAGE), "-c", str(N_CTX), "-b", str(N_CTX), "-fa", "off", "-ctk", "f32", "-ctv", "f32",
            "-t", str(THREADS)]
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), *args], capture_output=True,
                         text=True, check=True)
    log = run.stdout + run.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", log)
    assert final and chunks, log[-2000:]
    n_chunks = int(chunks.group(1))
    return {
        "command": " ".join(["llama-perplexity", "-m", gguf.name, "-f", f"tests/data/{PASSAGE.name}", *args[2:]]),
        "n_ctx": N_CTX, "n_batch": int(chunks.group(3)), "n_seq": int(chunks.group(4)), "chunks": n_chunks,
        "scored_tokens": n_chunks * (N_CTX - N_CTX // 2 - 1),
        "perplexity": float(final.group(1)), "plus_minus": float(final.group(2)),
    }


def record_pieces(bin_dir: Path, gguf: Path) -> dict:
    llama_dir = bin_dir.parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "token_pieces"
        subprocess.run(["cc", "-O1", str(Path(__file__).with_name("token_pieces.c")), f"-I{llama_dir / 'include'}",
                        f"-I{llama_dir / 'ggml' / 'include'}", f"-L{bin_dir}", "-lllama", "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(gguf)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))).stdout
    pieces = [bytes.fromhex(line.split(" ")[2]) for line in out.splitlines()]
    return {
        "command": f"token_pieces {gguf.name} (tests/reference/token_pieces.c: llama_token_to_piece, special false)",
        "vocab_size": len(pieces),
        "textless": id_ranges([i for i, piece in enumerate(pieces) if not piece]),
        "pieces_sha256": pieces_digest(pieces),
    }


def id_ranges(ids: list[int]) -> list[list[int]]:
    """Sorted ids as ``[first, last]`` runs of consecutive ids."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def pieces_digest(pieces: list[bytes]) -> str:
    """SHA-256 of every piece in id order, each after its length (4 bytes, little-endian)."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(len(piece).to_bytes(4, "little") + piece)
    return h.hexdigest()


def record_chat_template(bin_dir: Path, gguf: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "--jinja", "--port", str(port),
                               "-t", str(THREADS), "-c", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)))
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/apply-template", json.dumps(CONVERSATION).encode(),
                                         {"Content-Type": "application/json"})
        for _ in range(120):
            try:
                with urllib.request.urlopen(request) as r:
                    prompt = json.load(r)["prompt"]
                break
            except OSError:  # still loading
                time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not answer within 60 s")
    finally:
        server.terminate()
        server.wait()
    return {"command": f"llama-server -m {gguf.name} --jinja; POST /apply-template CONVERSATION",
            "conversation": CONVERSATION, "prompt": prompt}


def compact_json(obj: dict) -> str:
    """JSON text with each list of numbers on one line."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    return re.sub(r"\[[-\d.,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def main(argv: list[str]) -> None:
    what, llama_dir, gguf, out = argv[0], Path(argv[1]), Path(argv[2]), Path(argv[3])
    record = {"tokens": record_tokens, "perplexity": record_perplexity, "pieces": record_pieces,
              "chat-template": record_chat_template}[what]
    fixture = {**header(llama_dir, gguf, argv), **record(llama_dir / "build" / "bin", gguf)}
    out.write_text(compact_json(fixture), encoding="utf-8")
    print(compact_json({k: v for k, v in fixture.items() if k not in ("cases", "passage", "textless", "conversation")}))


if __name__ == "__main__":
    main(sys.argv[1:])
