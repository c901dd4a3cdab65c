"""``flm_runtime``'s public face: ``litellm_flm`` reaches the runtime only through the names of
``flm_runtime/__init__.py`` (``__all__``), every one of which resolves, and importing the provider
loads no kernel (the names load on first use)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import flm_runtime
import litellm_flm

PROVIDER = Path(litellm_flm.__file__).parent


def runtime_imports(package_dir: Path) -> list[tuple[str, str, list[str]]]:
    """Every import of ``flm_runtime`` in the package's sources, wherever it stands (module
    level, functions, ``TYPE_CHECKING``): ``(file:line, module, names)``; ``names`` is empty for
    ``import flm_runtime...``."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(package_dir.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [(where, a.name, []) for a in node.names if a.name.split(".")[0] == "flm_runtime"]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] == "flm_runtime":
                found.append((where, node.module, [a.name for a in node.names]))
    return found


def private_paths(imports: list[tuple[str, str, list[str]]]) -> list[str]:
    """The imports that name anything but ``flm_runtime``'s public names."""
    bad = []
    for where, module, names in imports:
        if module != "flm_runtime":
            bad.append(f"{where}: {module}")
        else:
            bad += [f"{where}: flm_runtime.{n}" for n in names if n not in flm_runtime.__all__]
    return bad


def test_the_provider_imports_only_public_names():
    imports = runtime_imports(PROVIDER)
    assert imports, "no import of flm_runtime found: the walk is broken"
    assert private_paths(imports) == []


def test_a_private_path_is_caught(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from flm_runtime import Engine, errors\n\n\ndef f():\n"
                              "    from flm_runtime.scheduling.engine import Engine\n    import flm_runtime.api\n")
    assert private_paths(runtime_imports(pkg)) == [
        "pkg/a.py:1: flm_runtime.errors", "pkg/a.py:5: flm_runtime.scheduling.engine", "pkg/a.py:6: flm_runtime.api"]


@pytest.mark.parametrize("name", flm_runtime.__all__)
def test_every_public_name_resolves(name):
    assert getattr(flm_runtime, name) is not None
    assert name in dir(flm_runtime)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        flm_runtime.nothing_here  # noqa: B018


def test_importing_the_provider_loads_no_kernel():
    script = ("import sys, litellm_flm\n"
              "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith(('numba.', 'flm_runtime.models',"
              " 'flm_runtime.kernels.', 'flm_runtime.layers', 'flm_runtime.speculation'))"
              " and m != 'flm_runtime.kernels.quant'))\n")  # quant: the loaders' block format, numpy only
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
