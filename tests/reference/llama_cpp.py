"""Record llama.cpp's reference values for a GGUF: token ids, perplexity over the test passage,
the output text of every token, and a chat with tools rendered by the GGUF's chat template.

llama.cpp shares nothing with ``flm_runtime`` but the GGUF file: its tokenizer (``llm_tokenizer_spm``,
``llm_tokenizer_bpe``) and its forward passes are its own. Each subcommand writes one JSON fixture,
with the command, the date and the llama.cpp commit in it:

- ``tokens``: ``llama-tokenize`` ids of ``TEXTS`` and of the perplexity passage as
  ``llama-perplexity`` reads it (``-f`` drops the file's one trailing newline), BOS included where
  the model's ``add_bos_token`` asks for it;
- ``pre-tokenizers``: ``llama-tokenize`` ids of ``TEXTS`` under every ``tokenizer.ggml.pre`` name
  ``flm_runtime`` reads, each on a copy of one vocabulary (the GGUF's metadata alone, that name
  written in);
- ``perplexity``: ``llama-perplexity``'s final estimate over ``tests/data/wizard_of_oz_ch1.txt``
  with a context of ``N_CTX`` tokens;
- ``fim``: the fill-in-the-middle tokens and the end-of-generation (EOG) tokens llama.cpp finds in
  the vocabulary (its load log, ``print_info``), and the ids of ``FIM_TEXTS`` with and without
  ``--no-parse-special`` (a control token's text encoded as plain text, as ``/infill`` encodes a
  prefix and a suffix).
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
    python tests/reference/llama_cpp.py pre-tokenizers LLAMA_CPP_DIR GGUF tests/data/OUT.json
    python tests/reference/llama_cpp.py perplexity LLAMA_CPP_DIR GGUF tests/data/OUT.json
    python tests/reference/llama_cpp.py fim LLAMA_CPP_DIR GGUF tests/data/OUT.json
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
# no piece covers (U+F0000, private use: byte fallback), HTML tags (user-defined tokens in Gemma 3),
# code, numbers of every length, contractions in both cases, combining marks, emoji sequences, and
# the spellings of the shipped vocabularies' special tokens (each vocabulary has some of them).
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — 你好，世界！ こんにちは。 Привет, мир! Ελληνικά 😀🎉👍🏽",
    "In 1900, 3.14159 and 1234567890 apples cost $42.50 (or 7%).",
    "a  b   c    d     e      f  ",
    "  two spaces before, one after ",
    "line one\nline two\n\n\nafter three newlines\r\n\tand a tab\n",
    "private use \ue000 and \U000f0000 fall back to bytes",
    "<b>bold</b> and <td>cell</td>",
    "def mean(xs: list[float]) -> float:\n    \"\"\"Average.\"\"\"\n    if not xs:\n        raise ValueError('empty')\n"
    "    return sum(xs) / len(xs)  # O(n)\n\n\nclass A:\n\tdef f(self):\n\t\treturn {'k': [1, 2]}\n",
    "for (int i = 0; i < n; ++i) {\n\tbuf[i] = x->y ?: 0x1F & ~mask; // C\n}\n#include <stdio.h>\n",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 12345678901234567890 -0.5e-10 1_000_000 ٣٤ ½ x²",
    "I'm sure you're right: it's WE'LL and They'VE, don't, can't, I'D, she'S.",
    "e\u0301 a\u0308 n\u0303: combining marks; Ångström ﬁ ＡＢＣ１２３",
    "한국어 텍스트와 日本語のテキスト、中文文本。ภาษาไทย العربية עברית हिन्दी",
    "👨‍👩‍👧‍👦 family, 🇫🇷🇯🇵 flags, ❤️‍🔥, 1️⃣, 🏳️‍🌈",
    "mixed: Hello世界مرحبا123abc_DEF-ghi.jkl/mno\\pqr",
    "   \n\n  \n\t\t b   \n \r\n\r\n    ",
    "https://example.com/a/b?c=d&e=f#g C:\\Users\\me ~/.cache/x.gguf !!!??? ... --- ===> <=>",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call><start_of_turn>model\n<end_of_turn><bos></s><eos>",
]

# A prompt templated by hand in Qwen's FIM format, and code that spells control and user-defined tokens.
FIM_TEXTS = [
    "<|fim_prefix|>def fib(n):\n    if n < 2:\n        return n\n    return <|fim_suffix|>\n\n\nprint(fib(10))\n"
    "<|fim_middle|>",
    'END = "<|endoftext|>"  # a <tool_call> and a <|fim_middle|> spelled in code\n',
]
# llama.cpp's load log line of one FIM or EOG token (llama_vocab::impl::print_info).
_LOG_TOKEN = re.compile(r"print_info: (FIM PRE|FIM SUF|FIM MID|FIM PAD|FIM REP|FIM SEP|EOG) token +"
                        r"= +(\d+) '")
_FIM_NAMES = {"FIM PRE": "prefix", "FIM SUF": "suffix", "FIM MID": "middle", "FIM PAD": "pad", "FIM REP": "repo",
              "FIM SEP": "file_sep"}
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


def tokenize(bin_dir: Path, gguf: Path, text: str, *extra: str) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "--stdin", "--ids", "--no-escape",
                          "--log-disable", *extra], input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def record_tokens(bin_dir: Path, gguf: Path) -> dict:
    return {
        "command": f"llama-tokenize -m {gguf.name} --stdin --ids --no-escape --log-disable < TEXT",
        "cases": [{"text": t, "ids": tokenize(bin_dir, gguf, t)} for t in TEXTS],
        "passage": {"file": PASSAGE.name, "trailing_newline_dropped": True,
                    "ids": tokenize(bin_dir, gguf, PASSAGE.read_text(encoding="utf-8").removesuffix("\n"))},
    }


def vocab_only_copy(gguf: Path, out: Path, pre: str) -> None:
    """Write ``gguf``'s metadata, with ``tokenizer.ggml.pre`` set to ``pre``, and no tensors to ``out``
    (what ``llama-tokenize`` reads: it loads the vocabulary only)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(gguf)
    writer = GGUFWriter(out, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def record_pre_tokenizers(bin_dir: Path, gguf: Path) -> dict:
    """``llama-tokenize`` ids of ``TEXTS`` for each ``tokenizer.ggml.pre`` name we read, the vocabulary
    and merges ``gguf``'s (a large byte-level BPE vocabulary: how it is cut shows in the ids)."""
    from flm_runtime.loading.tokenizer import PRE_TOKENIZERS

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_TOKENIZERS:
            copy = Path(tmp) / f"{pre}.gguf"
            vocab_only_copy(gguf, copy, pre)
            cases[pre] = [tokenize(bin_dir, copy, t) for t in TEXTS]
    return {
        "command": f"llama-tokenize -m VOCAB --stdin --ids --no-escape --log-disable < TEXT, VOCAB = {gguf.name}'s "
                   "metadata with tokenizer.ggml.pre = NAME and no tensors",
        "texts": TEXTS,
        "ids": cases,
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


def record_fim(bin_dir: Path, gguf: Path) -> dict:
    run = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "-p", "x", "--log-verbosity", "4"],
                         capture_output=True, text=True, check=True)
    found = _LOG_TOKEN.findall(run.stdout + run.stderr)
    return {
        "command": f"llama-tokenize -m {gguf.name} --stdin --ids --no-escape --log-disable [--no-parse-special] < TEXT",
        "fim_tokens": {_FIM_NAMES[kind]: int(i) for kind, i in found if kind != "EOG"},
        "eog": sorted(int(i) for kind, i in found if kind == "EOG"),
        "cases": [{"text": t, "ids": tokenize(bin_dir, gguf, t),
                   "ids_no_parse_special": tokenize(bin_dir, gguf, t, "--no-parse-special")} for t in FIM_TEXTS],
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
    record = {"tokens": record_tokens, "pre-tokenizers": record_pre_tokenizers, "perplexity": record_perplexity,
              "fim": record_fim, "pieces": record_pieces, "chat-template": record_chat_template}[what]
    fixture = {**header(llama_dir, gguf, argv), **record(llama_dir / "build" / "bin", gguf)}
    out.write_text(compact_json(fixture), encoding="utf-8")
    print(compact_json({k: v for k, v in fixture.items()
                        if k not in ("cases", "passage", "texts", "ids", "textless", "conversation")}))


if __name__ == "__main__":
    main(sys.argv[1:])
