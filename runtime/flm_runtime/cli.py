"""The ``litellm-flm`` command: ``pull``, ``list``, ``run``, ``validate``; ``bench``, ``agreement``,
``calibrate`` and ``soak`` come from ``flm_bench``.

Each subcommand is one function ``cmd_<name>(args) -> int`` (the exit status) registered with
``@command(name, help, configure)``, where ``configure(parser)`` adds its arguments. Errors the
runtime raises on purpose (``FlmError``) print one line and exit 1; ``--debug`` shows tracebacks.
A reader of stdout that goes away (``| head -1``) ends the command quietly (``EXIT_BROKEN_PIPE``).

Other packages add subcommands through the entry-point group ``litellm_flm.commands`` (name: the
subcommand; object: a ``Command``), so that the runtime never imports them: the benchmark
commands are ``flm_bench``'s (``soak`` drives LiteLLM). A plugin is imported only when its
subcommand runs: importing LiteLLM takes seconds that ``litellm-flm list`` should not pay.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import gc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import entrypoints

from flm_runtime import registry
from flm_runtime.errors import FlmError, InvalidRequestError, ModelFormatError

if TYPE_CHECKING:  # the engine's modules load only when a command needs them
    from flm_runtime.loading.gguf import GGUFFile
    from flm_runtime.request import RequestStats

PROG = "litellm-flm"
COMMAND_GROUP = "litellm_flm.commands"
# The status of a command whose stdout's reader went away (``litellm-flm list | head -1``): 128 +
# SIGPIPE (13), what a shell reports for ``cat`` or ``git log`` ended the same way, so that a
# caller (``set -o pipefail``) can tell that not all the output was read.
EXIT_BROKEN_PIPE = 141


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    configure: Callable[[argparse.ArgumentParser], None] | None = None


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None] | None = None):
    """Register the decorated ``cmd_<name>(args) -> int`` as subcommand ``name``."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        assert name not in COMMANDS, name
        COMMANDS[name] = Command(name, help, run, configure)
        return run

    return register


# --- pull ---------------------------------------------------------------------------------------

def _pull_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("tag", help="model tag, e.g. smollm2:135m")
    p.add_argument("--force", action="store_true", help="download again even if installed")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


@command("pull", "download a model into the model cache", _pull_args)
def cmd_pull(args: argparse.Namespace) -> int:
    from flm_runtime.pull import pull

    path = pull(args.tag, progress=not args.quiet, force=args.force)
    print(f"{registry.resolve(args.tag).tag}: {path}")
    return 0


# --- list ---------------------------------------------------------------------------------------

def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")


def _size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _size(entry: registry.ModelEntry) -> int | None:
    size = entry.total_size()
    return size if size is not None else entry.size_on_disk()


def _family(entry: registry.ModelEntry, header: GGUFFile | None) -> str:
    """The model family (``families``) of an installed entry's files: its GGUF header's
    (``header``, the entry's GGUF parsed) architecture or its config.json's ``model_type``;
    ``unsupported`` when no family runs them.

    Raises:
        ModelFormatError, OSError, ValueError: the files cannot be read (not a GGUF file, a
            config.json that is not JSON): ``list_rows`` shows the tag as broken.
    """
    from flm_runtime import families

    path = entry.location()
    if header is not None:
        lookup, key = families.for_gguf, header.metadata
    else:
        lookup, key = families.for_model_type, json.loads((path / "config.json").read_text()).get("model_type")
    try:
        return lookup(key, str(path)).name
    except ModelFormatError:  # readable, but of a family we do not run
        return "unsupported"


def _held(entry: registry.ModelEntry, header: GGUFFile | None) -> str | None:
    """How the cpu backend holds an installed GGUF's matrices (``header``: the GGUF parsed), for
    the entry's weight kind (``loading.gguf.held_as``), per GGUF type of its matrices, the most
    common first: ``Q4_K 4-bit, Q6_K 6-bit``, a type whose own blocks the kernels do not read
    marked ``(quantized again)`` (a part of a fused matrix of other widths aside:
    ``quant.as_format``); ``float32`` for the ``f32`` kind; None for other formats.

    Raises:
        InvalidRequestError: the entry's weight kind is not one (``list_rows`` shows the tag as
            broken).
    """
    from flm_runtime.loading.gguf import held_as
    from flm_runtime.loading.weights import weight_kind

    if header is None:
        return None
    kind = weight_kind(entry.weights)
    if kind == "f32":
        return "float32"
    counts = collections.Counter(t.tensor_type for t in header.tensors if len(t.shape) == 2)
    parts = []
    for qtype, _ in counts.most_common():
        bits, read = held_as(qtype, kind)
        parts.append(f"{qtype.name} {bits}-bit" + ("" if read else " (quantized again)"))
    return ", ".join(parts)


def list_rows() -> list[dict]:
    """One dict per known tag: tag, family (``_family``, of installed files; a DFlash tag's is its
    target's), format, size (bytes, recorded or else measured on disk; None when neither is known;
    a DFlash tag's includes its target's), installed, broken (why installed files cannot be read,
    else None: the tag is then not installed), held (``_held``, of installed files; None
    otherwise), path, origin."""
    from flm_runtime.loading.gguf import open_gguf

    entries = {e.tag: e for e in registry.list_entries()}
    rows = []
    for e in entries.values():
        base = entries.get(e.base) if e.base else e
        size = _size(e)
        if e.is_dflash and base is not None:
            base_size = _size(base)
            size = None if size is None or base_size is None else size + base_size
        try:
            installed = registry.is_installed(e)
        except FlmError:  # e.g. a DFlash entry whose base is unknown
            installed = False
        family = broken = held = None
        if base is not None and installed:
            try:
                header = open_gguf(base.location()) if base.format == "gguf" else None
                family, held = _family(base, header), _held(base, header)
            except (OSError, ValueError, FlmError) as why:
                installed, broken = False, " ".join(str(why).split())
        rows.append({
            "tag": e.tag,
            "family": family,
            "format": (f"{base.format}+dflash" if e.is_dflash else e.format) if base else "?",
            "size": size,
            "installed": installed,
            "broken": broken,
            "held": held,
            "path": str(e.location()),
            "origin": e.origin,
        })
    return rows


@command("list", "list known model tags and whether they are installed", _list_args)
def cmd_list(args: argparse.Namespace) -> int:
    rows = list_rows()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    table = [("TAG", "FAMILY", "FORMAT", "SIZE", "INSTALLED", "PATH", "WEIGHTS HELD AS")]
    table += [(r["tag"], r["family"] or "?", r["format"], _size_text(r["size"]),
               "broken" if r["broken"] else "yes" if r["installed"] else "no", r["path"], r["held"] or "-")
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:6], widths, strict=True)) + "  " + row[6])
    return 0


# --- run ----------------------------------------------------------------------------------------

def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("tag", help="model tag, e.g. smollm2:135m")
    p.add_argument("prompt", help="the user message (for a base model: the text to continue)")
    p.add_argument("--system", help="a system message (default: the chat template's own; not for a base model)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens at most (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's sampler)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)


@command("run", "chat once with a model (a base model continues the prompt): stream the reply, "
                 "then the request's stats", _run_args)
def cmd_run(args: argparse.Namespace) -> int:
    from flm_runtime.api import get_engine

    with _collector_paused():
        engine = get_engine(args.tag)
    if engine.tokenizer.chat_template is None:  # a base model: the prompt is text to continue
        if args.system:
            raise InvalidRequestError(f"{args.tag} is a base model without a chat template: it has no "
                                      "system message; put the text to continue in the prompt", param="system")
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
             "top_p": args.top_p, "seed": args.seed}
    params = engine.sampling_params(**{k: v for k, v in given.items() if v is not None})
    handle = engine.submit(prompt_ids, params)
    for event in handle:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    print()  # the reply ends its line, on stdout too when it is piped
    print(stats_line(args.tag, handle.result().stats), file=sys.stderr)
    return 0


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (its state restored after): a model's load makes ~10^5
    long-lived objects (numba's types and code, the vocabulary) and no cycles to free, which the
    collector would otherwise pass over again and again while they are made."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def stats_line(tag: str, stats: RequestStats) -> str:
    """``run``'s summary of a ``RequestStats``: tokens, TTFT, decode tokens/s and, for a DFlash
    tag, its verify steps and AL (bonus token included), then each proposer's steps and AL (those
    with a step, in ``PROPOSERS``' order) and the tokens a grammar forced, verified and kept."""
    from flm_runtime.request import PROPOSERS  # loaded already: ``stats`` is one of its classes
    line = (f"[{tag}: {stats.prompt_tokens} prompt tokens, {stats.completion_tokens} completion tokens, "
            f"TTFT {stats.ttft_s:.2f} s, decode {stats.decode_tokens_per_s:.1f} tokens/s")
    if stats.spec is not None:
        s = stats.spec
        if s.steps:
            by = ", ".join(f"{name} {c.steps} (AL {c.acceptance_length:.2f})"
                           for name in PROPOSERS if (c := s.counts(name)).steps)
            line += (f", {s.steps} verify steps, AL {s.acceptance_length:.2f}: {by}; "
                     f"{s.forced} forced tokens, {s.forced_accepted} kept")
        else:
            line += ", no verify step"
    return line + "]"


# --- validate -----------------------------------------------------------------------------------

def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("tag", nargs="?", default="smollm2:135m",
                   help="the model whose backend choice to explain (default smollm2:135m)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


@command("validate", "check the NPU, its driver and firmware, pyxrt, the xclbins, and which backend "
                     "FLM_BACKEND=auto would choose", _validate_args)
def cmd_validate(args: argparse.Namespace) -> int:
    from flm_runtime.backends.npu.validate import format_report, validate_report

    entry = registry.resolve(args.tag)
    report = validate_report(entry.tag, entry.base)  # a DFlash tag runs on its base's kernels
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# --- plugins and entry point -------------------------------------------------------------------

def plugin_commands(chosen: str | None) -> dict[str, Command]:
    """The subcommands of the group ``litellm_flm.commands``: ``chosen`` loaded (its ``Command``),
    the others as stand-ins that only list it in ``--help``, with their help read from their
    source (``_help_in_source``). One named like a built-in command is skipped, as is the whole
    group when an ``entry_points.txt`` on the path is malformed (logged).
    """
    try:
        eps = entrypoints.get_group_all(COMMAND_GROUP)
    except Exception as e:  # noqa: BLE001 - a malformed entry_points.txt anywhere on sys.path
        logging.getLogger(__name__).warning("cannot read entry points %s: %s", COMMAND_GROUP, e)
        return {}
    found = {}
    for ep in eps:
        if ep.name in COMMANDS:
            continue
        if ep.name == chosen:
            cmd = ep.load()
            assert isinstance(cmd, Command) and cmd.name == ep.name, f"entry point {ep} is not Command {ep.name!r}"
        else:
            help = (_help_in_source(ep.module_name, ep.object_name)
                    or f"(from {ep.module_name}; `{PROG} {ep.name} --help` for more)")
            cmd = Command(ep.name, help, _not_chosen)
        found[ep.name] = cmd
    return found


def _help_in_source(module: str, name: str) -> str | None:
    """The help of the ``Command`` that module ``module`` assigns to ``name``, read from its
    source without importing it (a benchmark command's module imports LiteLLM: seconds): the
    second argument of ``name = Command(...)`` when it is a string literal; None when the source
    cannot be found or says it another way."""
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else "")
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
                and isinstance(node.value, ast.Call) and len(node.value.args) > 1
                and isinstance(text := node.value.args[1], ast.Constant) and isinstance(text.value, str)):
            return text.value
    return None


def _not_chosen(args: argparse.Namespace) -> int:
    raise AssertionError(f"plugin subcommand {args.command!r} was not loaded")


def build_parser(commands: Mapping[str, Command] | None = None) -> argparse.ArgumentParser:
    """The parser of ``commands`` (default: the built-in ones)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Run LLMs locally for LiteLLM (flm/<tag>).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="debug logging; show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in (COMMANDS if commands is None else commands).values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.configure is not None:
            cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("litellm-flm")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Without ``argv`` (the console script, whose process ends when this returns), every object
    left is frozen out of the garbage collector (``gc.freeze``) on return, so that the
    interpreter's last collections do not walk a loaded model's objects at exit.
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        if argv is None:
            gc.freeze()


def _main(argv: list[str]) -> int:
    """``main``'s command line, run."""
    chosen = next((a for a in argv if not a.startswith("-")), None)  # global options take no value
    args = build_parser({**COMMANDS, **plugin_commands(chosen)}).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format=f"{PROG}: %(levelname)s: %(message)s")
    try:
        status = args._run(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except (FlmError, OSError) as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _stdout_closed() -> int:
    """Quietly end a command whose stdout's reader went away: what is left unwritten goes to
    devnull (else the interpreter's last flush raises again, with a traceback), no message;
    ``EXIT_BROKEN_PIPE``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
