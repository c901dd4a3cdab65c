"""llama-server (llama.cpp's HTTP server), the peer that ``benchmarks/served.py`` and
``litellm-flm bench --workloads --llama-server PATH`` measure us against: how it is built, started
on a GGUF, reached through LiteLLM, and which of its speculation settings are compared.

It is built from the sources of the ``llama-cpp-python`` sdist (its ``vendor/llama.cpp``), the
same llama.cpp that benchmarks/peers.py measures through the Python bindings, native without AMX
(whose tile instructions fault on our AVX-512 host although the CPU reports them).
``build_llama_server`` does it (about 15 minutes on 2 cores); by hand it is:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d DIR
    tar xzf DIR/llama_cpp_python-0.3.36.tar.gz -C DIR && cd DIR/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \\
        -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \\
        -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
    cmake --build build --target llama-server -j 2      # -> build/bin/llama-server

The binary finds its shared libraries next to it (``LlamaServer`` puts its folder on
``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
START_TIMEOUT_S = 300

# llama-server's draft-free speculation, by name: its command-line flags (``llama-server --help``
# of the build above, "speculative params"). In this llama.cpp ``--spec-draft-n-max`` bounds a
# draft model's proposals only: each n-gram type has its own lengths. ngram-simple and
# ngram-map-k keep their defaults (lookup 12 tokens, drafts of up to 48); ngram-mod's defaults (a
# 24-token match, drafts of 48-64) rarely fire on short answers, so it gets the settings the
# speculation issue measured it with.
SPEC_CONFIGS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-mod": ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16",
                  "--spec-ngram-mod-n-match", "6"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
}


def build_llama_server(directory: Path, jobs: int = 2) -> Path:
    """llama-server built from the ``LLAMA_CPP_PYTHON`` sdist's ``vendor/llama.cpp`` in
    ``directory`` (downloaded with pip, unpacked, configured native without AMX, the one target
    built); an existing binary there is returned as it is. Takes ~15 minutes on 2 cores.

    Raises:
        subprocess.CalledProcessError: a step failed (its output is on the terminal).
    """
    directory = directory.expanduser().resolve()
    name, version = LLAMA_CPP_PYTHON.split("==")
    source = directory / f"{name.replace('-', '_')}-{version}" / "vendor" / "llama.cpp"
    binary = source / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    if not source.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        LLAMA_CPP_PYTHON, "-d", str(directory)], check=True)
        sdist = directory / f"{name.replace('-', '_')}-{version}.tar.gz"
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(directory)], check=True)
    subprocess.run(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(jobs)], cwd=source, check=True)
    return binary


class LlamaServer:
    """llama-server on ``gguf`` at a free port of 127.0.0.1 with ``threads`` threads (``-t`` and
    ``-tb``), ``parallel`` slots sharing one unified KV buffer of ``ctx`` positions, prompt caching
    on, and ``extra`` flags (a ``SPEC_CONFIGS`` value); its log in a temporary file (removed at the
    end unless something failed). A context manager that starts it (waiting for ``/health``) and
    stops it.

    ``target``: the ``litellm.completion`` keyword arguments that reach it through LiteLLM's
    ``openai/`` provider, ``cache_prompt: true`` in every body (its default, sent anyway);
    ``text_target``: the same for ``litellm.text_completion`` (``text-completion-openai/``, which
    posts to ``/v1/completions``).

    Raises (on entering):
        RuntimeError: it exited or did not answer within ``START_TIMEOUT_S`` (the error holds the
            end of its log).
    """

    def __init__(self, binary: Path, gguf: Path, threads: int, parallel: int, ctx: int,
                 extra: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary = Path(binary)
        self.command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                        "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(parallel),
                        "--kv-unified", "--ctx-size", str(ctx), "--cache-prompt", "--no-webui", *extra]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        base = f"http://127.0.0.1:{self.port}/v1"
        common = {"api_base": base, "api_key": "none", "extra_body": {"cache_prompt": True}}
        self.target = {"model": "openai/llama-server", **common}
        self.text_target = {"model": "text-completion-openai/llama-server", **common}

    @property
    def flags(self) -> str:
        """The command's flags other than the binary, the model and where it listens."""
        return " ".join(self.command[3:7] + self.command[11:])

    def _env(self) -> dict[str, str]:
        libs = str(self.binary.parent)
        paths = os.pathsep.join(filter(None, [libs, os.environ.get("LD_LIBRARY_PATH")]))
        return dict(os.environ, LD_LIBRARY_PATH=paths)

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self._env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.proc.kill()
        self.proc.wait()
        log = Path(self.log.name).read_text()[-3000:]
        raise RuntimeError(f"llama-server did not start; its log: {self.log.name}\n{log}")

    def __exit__(self, kind, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        if kind is None:  # kept when something failed
            Path(self.log.name).unlink()

    def version(self) -> str:
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, env=self._env())
        return " ".join((out.stdout + out.stderr).split())
