"""``xclbins/flm_xclbins/manifest.json``: the kernels the npu backend calls, and the builds that provide them.

The manifest is the contract between this runtime and a kernel build (see ``xclbins/README.md``):

- ``roles``: what the backend calls (``decode_layer``, ``verify_layer``, optional
  ``prefill_layer``, ``lm_head``), each with its argument order, C types, dtypes and shapes;
- ``layouts``: how weights are packed into one buffer per layer (and one for the LM head), with
  shapes written over the symbols ``E, H, Hkv, D, F, V`` and evaluated here;
- ``builds``: per model, the xclbin, kernel name and instruction file of each role.

``validate_build`` checks each xclbin of a build with the pure-Python reader
(``flm_runtime.backends.npu.xclbin``): the file reads, it has the kernel, the kernel's arguments are
the role's, in the role's order, with the role's C types, it has a compute-unit instance, and its
UUID / sha256 are the recorded ones when the build records them.

Environment:
    FLM_XCLBIN_PATH: the folder holding ``manifest.json`` and the xclbins. Default: ``xclbins/``
        of the source tree this package runs from (an editable install or a checkout).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import json
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

from flm_runtime.backends.npu.xclbin import XclbinError, read_xclbin
from flm_runtime.errors import FlmError
from flm_runtime.settings import Settings

MANIFEST_NAME = "manifest.json"
LAYER_ROLES = ("decode_layer", "verify_layer", "prefill_layer")
GEOMETRY_KEYS = ("E", "H", "Hkv", "D", "F", "V", "L", "max_positions", "rope_theta", "rms_norm_eps")


class ManifestError(FlmError, ValueError):
    """``manifest.json`` is missing, not JSON, or inconsistent."""


def xclbin_dir() -> Path:
    """The xclbin folder: ``$FLM_XCLBIN_PATH``, or the package ``flm_xclbins``
    (``xclbins/flm_xclbins/``, which a wheel carries too)."""
    override = Settings.from_env().xclbin_path
    if override:
        return Path(override).expanduser().resolve()
    return Path(str(importlib.resources.files("flm_xclbins")))


@dataclass(frozen=True)
class ArgSpec:
    """One kernel argument as the manifest states it (``kind``: opcode, instructions,
    instruction_words or data; data arguments carry a ``dtype`` + ``shape`` or a ``layout``)."""

    name: str
    ctype: str
    kind: str
    dtype: str | None = None
    shape: tuple = ()
    layout: str | None = None
    access: str | None = None


@dataclass(frozen=True)
class RoleSpec:
    name: str
    required: bool
    positions: int | str
    args: tuple[ArgSpec, ...]

    @property
    def data_args(self) -> tuple[ArgSpec, ...]:
        return tuple(a for a in self.args if a.kind == "data")


@dataclass(frozen=True)
class KernelFiles:
    """Where one role's kernel lives: paths are absolute (resolved against the xclbin folder)."""

    xclbin: Path
    kernel: str
    instructions: Path
    uuid: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class Build:
    model: str
    geometry: dict
    kernels: dict[str, KernelFiles]

    @property
    def max_rows(self) -> int:
        """R: rows of the activation buffers (the most positions any of its layer roles takes)."""
        rows = 8
        if "prefill_layer" in self.kernels:
            rows = max(rows, int(self.geometry["prefill_positions"]))
        return rows


@dataclass(frozen=True)
class Manifest:
    path: Path
    shipped: bool
    status: str
    opcode: int
    roles: dict[str, RoleSpec]
    layouts: dict[str, dict]
    builds: tuple[Build, ...]

    @property
    def folder(self) -> Path:
        return self.path.parent

    def build_for(self, tag: str) -> Build | None:
        """The build of model ``tag`` (a plain registry tag), or None."""
        return next((b for b in self.builds if b.model.lower() == tag.lower()), None)

    def layout_shapes(self, layout: str, geometry: dict) -> list[tuple[str, tuple[int, ...]]]:
        """``(tensor name, shape)`` of a weight layout, in packing order, for ``geometry``."""
        return [(name, tuple(eval_dim(d, geometry) for d in dims))
                for name, dims in self.layouts[layout]["tensors"]]


def load_manifest(path: str | os.PathLike | None = None) -> Manifest:
    """Read ``manifest.json`` (default: the one in ``xclbin_dir()``).

    Raises:
        ManifestError: missing, not JSON, or a role / layout / build that does not fit the schema.
    """
    path = Path(path) if path is not None else xclbin_dir() / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ManifestError(f"no kernel manifest at {path} (set FLM_XCLBIN_PATH to the folder "
                            f"holding manifest.json and the xclbins)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is not a readable JSON manifest: {e}") from e
    try:
        roles = _roles(raw["roles"])
        builds = tuple(_build(b, path.parent) for b in raw.get("builds", []))
        return Manifest(path=path, shipped=bool(raw.get("shipped", False)), status=raw.get("status", ""),
                        opcode=int(raw["abi"]["opcode"]), roles=roles, layouts=dict(raw["layouts"]),
                        builds=builds)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path} does not follow the manifest schema: {type(e).__name__}: {e}") from e


def _roles(raw: dict) -> dict[str, RoleSpec]:
    roles = {}
    for name, spec in raw.items():
        args = spec["args"]
        if isinstance(args, str):  # "same as decode_layer"
            args = raw[args.removeprefix("same as ").strip()]["args"]
        roles[name] = RoleSpec(
            name=name, required=bool(spec["required"]), positions=spec["positions"],
            args=tuple(ArgSpec(name=a["name"], ctype=a["ctype"], kind=a["kind"], dtype=a.get("dtype"),
                               shape=tuple(a.get("shape", ())), layout=a.get("layout"),
                               access=a.get("access")) for a in args))
    return roles


def _build(raw: dict, folder: Path) -> Build:
    kernels = {role: KernelFiles(xclbin=folder / k["xclbin"], kernel=k["kernel"],
                                 instructions=folder / k["instructions"], uuid=k.get("uuid"),
                                 sha256=k.get("sha256"))
               for role, k in raw["kernels"].items()}
    missing = [k for k in GEOMETRY_KEYS if k not in raw["geometry"]]
    if missing:
        raise ValueError(f"build for {raw['model']!r}: geometry lacks {missing}")
    return Build(model=raw["model"], geometry=dict(raw["geometry"]), kernels=kernels)


# ---- shape expressions ---------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def eval_dim(dim: int | str, symbols: dict) -> int:
    """A dimension of the manifest: an int, or an arithmetic expression over symbols such as
    ``"(H + 2*Hkv)*D"`` (+, -, *, // and parentheses only).

    Raises:
        ManifestError: an unknown symbol or operator.
    """
    if isinstance(dim, int):
        return dim

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in symbols:
            return int(symbols[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ManifestError(f"cannot evaluate {ast.unparse(node)!r} in dimension {dim!r} "
                            f"(symbols: {sorted(symbols)})")

    return ev(ast.parse(dim, mode="eval"))


def geometry_of(config) -> dict:
    """The manifest's geometry symbols of a ``ModelConfig``."""
    return {"E": config.hidden_size, "H": config.num_attention_heads, "Hkv": config.num_key_value_heads,
            "D": config.head_dim, "F": config.intermediate_size, "V": config.vocab_size,
            "L": config.num_hidden_layers, "max_positions": config.max_position_embeddings,
            "rope_theta": float(config.rope_theta), "rms_norm_eps": float(config.rms_norm_eps)}


def geometry_mismatch(build: Build, config) -> list[str]:
    """``"E: build 576, model 960"``-style lines for each geometry value the model does not share."""
    model = geometry_of(config)
    return [f"{k}: build {build.geometry[k]}, model {model[k]}"
            for k in GEOMETRY_KEYS if float(build.geometry[k]) != float(model[k])]


# ---- validation ----------------------------------------------------------------------------

@dataclass
class KernelCheck:
    """The outcome for one role of a build: ``problems`` empty means it validates."""

    role: str
    files: KernelFiles | None
    uuid: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class BuildCheck:
    model: str
    build: Build | None
    kernels: list[KernelCheck]
    problems: list[str] = field(default_factory=list)  # build-level (no build, required role absent)

    @property
    def ok(self) -> bool:
        return self.build is not None and not self.problems and all(k.ok for k in self.kernels)

    def summary(self) -> str:
        """One line: why this build does not validate (empty when it does)."""
        lines = list(self.problems) + [f"{k.role}: {p}" for k in self.kernels for p in k.problems]
        return "; ".join(lines)


def validate_build(manifest: Manifest, tag: str) -> BuildCheck:
    """Validate every xclbin of the build for ``tag`` (pure Python: no XRT, no device)."""
    build = manifest.build_for(tag)
    if build is None:
        shipped = "" if manifest.shipped else "; no xclbin is shipped"
        return BuildCheck(tag, None, [], [f"{manifest.path} has no kernel build for {tag}{shipped}"])
    check = BuildCheck(tag, build, [])
    for role, spec in manifest.roles.items():
        if role not in build.kernels:
            if spec.required:
                check.problems.append(f"the build for {tag} lacks the required role {role}")
            continue
        check.kernels.append(validate_kernel(build.kernels[role], spec))
    unknown = sorted(set(build.kernels) - set(manifest.roles))
    if unknown:
        check.problems.append(f"the build for {tag} names unknown roles {unknown}")
    return check


def validate_kernel(files: KernelFiles, spec: RoleSpec) -> KernelCheck:
    """Check one role's xclbin and instruction file against the role's argument list."""
    check = KernelCheck(spec.name, files)
    name = files.xclbin.name
    try:
        xclbin = read_xclbin(files.xclbin)
    except (XclbinError, OSError) as e:
        check.problems.append(f"{e}")
        return check
    check.uuid = xclbin.uuid
    if files.uuid and files.uuid.lower() != xclbin.uuid:
        check.problems.append(f"{name} has UUID {xclbin.uuid}, the manifest records {files.uuid}")
    if files.sha256 and _sha256(files.xclbin) != files.sha256.lower():
        check.problems.append(f"{name} does not have the sha256 the manifest records")
    kernel = xclbin.kernels.get(files.kernel)
    if kernel is None:
        have = ", ".join(sorted(xclbin.kernels)) or "none"
        check.problems.append(f"kernel {files.kernel!r} is missing from {name} (its kernels: {have})")
        return check
    check.problems += _arg_problems(kernel, spec, name)
    if not xclbin.instances_of(files.kernel):
        check.problems.append(f"kernel {files.kernel!r} in {name} has no compute-unit instance in IP_LAYOUT")
    if not files.instructions.is_file():
        check.problems.append(f"instruction file {files.instructions} is missing")
    elif files.instructions.stat().st_size % 4 or files.instructions.stat().st_size == 0:
        check.problems.append(f"instruction file {files.instructions.name} is not a non-empty whole "
                              f"number of 32-bit words ({files.instructions.stat().st_size} bytes)")
    return check


def _arg_problems(kernel, spec: RoleSpec, where: str) -> list[str]:
    want = [a.name for a in spec.args]
    have = list(kernel.arg_names)
    order = f"expected order: {', '.join(want)}; {where} has: {', '.join(have) or 'none'}"
    if have != want:
        if sorted(have) == sorted(want):
            first = next(i for i, (h, w) in enumerate(zip(have, want)) if h != w)
            return [f"kernel {kernel.name!r} has the right arguments in the wrong order: argument "
                    f"{first} is {have[first]!r}, the manifest expects {want[first]!r} ({order})"]
        missing = [w for w in want if w not in have]
        extra = [h for h in have if h not in want]
        return [f"kernel {kernel.name!r} arguments do not match the role {spec.name}: missing "
                f"{missing}, unexpected {extra} ({order})"]
    problems = []
    for i, (arg, expect) in enumerate(zip(kernel.args, spec.args)):
        if arg.index is not None and arg.index != i:
            problems.append(f"kernel {kernel.name!r} argument {arg.name!r} has index {arg.index}, expected {i}")
        if _ctype(arg.type) != _ctype(expect.ctype):
            problems.append(f"kernel {kernel.name!r} argument {i} {arg.name!r} has type {arg.type!r}, "
                            f"the manifest expects {expect.ctype!r}")
    return problems


def _ctype(text: str) -> str:
    return "".join(text.split())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
