"""The npu backend: the model step on an AMD XDNA2 NPU through ``pyxrt`` and ``xclbins/``.

NOT RUN ON HARDWARE. Every ``pyxrt`` call here follows XRT's Python binding as published
(``src/python/pybind11/src/pyxrt.cpp`` and ``pyxrt.pyi`` in github.com/Xilinx/XRT) and the
host-side pattern of AMD's mlir-aie NPU examples, but no line of it has run against a device or a
real xclbin: none exists on our machines, and no kernel build exists yet. The tests drive it with
a fake ``pyxrt`` whose kernels are the numpy reference (``npu.reference``).

How a step runs (``NpuModel.forward_batch``, sequence by sequence, T new positions each):

1. the host gathers the embedding rows into activation buffer 0 (float32 ``[R, E]``) and writes
   the step buffer (int32 ``[start, T, S, first_row]``); both are synced to the device;
2. one run per layer of the layer role (``decode_layer`` for T = 1, ``verify_layer`` for T <= 8,
   ``prefill_layer`` or chunks of 8 above), layer i reading activation buffer i and writing i + 1,
   with its own weights buffer and its slice of the sequence's KV buffer; then one ``lm_head`` run.
   Consecutive runs whose kernels share a hardware context execute as one ``pyxrt.runlist``
   (atomically, in order; XRT reuses a runlist across executions); a context change, or a
   ``pyxrt`` without ``runlist``, falls back to start + wait per run;
3. the host syncs back and reads the logits rows (and the activation buffers of the tapped
   layers, the DFlash draft's context features).

Buffers (``pyxrt.bo``): the instruction words of each kernel ``cacheable`` on ``group_id(1)``;
data buffers ``host_only`` on ``group_id(3 + i)`` of the kernel that uses them (i = the data
argument's index). Buffers shared by several kernels (the activations) take the group of their
first use: on an NPU every host_only group is host memory, an assumption no device has checked.
Weights are packed to bfloat16 once per layer; the KV buffer of a sequence is one parent BO with a
sub-buffer per layer (``pyxrt.bo(parent, size, offset)``), reallocated and copied when it grows.

Errors: ``pyxrt`` missing, no device, a kernel that fails to load or a run that fails raise
``BackendUnavailableError`` saying what was being done (LiteLLM: ``ServiceUnavailableError``).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flm_runtime.backends import Backend
from flm_runtime.backends.npu.layout import layout_entries, pack, step_array
from flm_runtime.backends.npu.manifest import Build, KernelFiles, Manifest, RoleSpec, geometry_mismatch
from flm_runtime.errors import BackendUnavailableError
from flm_runtime.kernels import cpu
from flm_runtime.kv_cache import BLOCK_TOKENS, BlockPool, BlockTable
from flm_runtime.outputs import ForwardOutput

VERIFY_POSITIONS = 8
XRT_PYTHON_DIRS = ("/opt/xilinx/xrt/python",)  # where XRT installs pyxrt (not on PyPI)


# ---- pyxrt and the device ------------------------------------------------------------------

def import_pyxrt():
    """The ``pyxrt`` module; tries ``$XILINX_XRT/python`` and ``/opt/xilinx/xrt/python`` too.

    Raises:
        BackendUnavailableError: not importable, saying where it normally lives.
    """
    try:
        return importlib.import_module("pyxrt")
    except ImportError as first:
        error: ImportError = first
    dirs = [os.path.join(os.environ["XILINX_XRT"], "python")] if os.environ.get("XILINX_XRT") else []
    for folder in dirs + list(XRT_PYTHON_DIRS):
        if os.path.isdir(folder) and folder not in sys.path:
            sys.path.append(folder)
            try:
                return importlib.import_module("pyxrt")
            except ImportError as e:
                error = e
    raise BackendUnavailableError(
        f"pyxrt is not importable ({error}): it is not on PyPI but ships with XRT as "
        f"/opt/xilinx/xrt/python; install XRT and the amdxdna driver (github.com/amd/xdna-driver), "
        f"then `source /opt/xilinx/xrt/setup.sh`") from error


_device_lock = threading.Lock()
_device: tuple[object, object] | None = None  # (pyxrt module, pyxrt.device(0)): one per process


def open_device(pyxrt):
    """The process's one ``pyxrt.device(0)``, opened on first use.

    Raises:
        BackendUnavailableError: ``pyxrt.device(0)`` failed (XRT says "No such device with index
            '0'" without an NPU); the message adds what sysfs shows.
    """
    global _device
    with _device_lock:
        if _device is None or _device[0] is not pyxrt:
            try:
                _device = (pyxrt, pyxrt.device(0))
            except Exception as e:  # noqa: BLE001 - pyxrt raises RuntimeError; any failure means no device
                from flm_runtime.backends.npu.device import detect_npu

                raise BackendUnavailableError(f"no NPU device: pyxrt.device(0) failed: {e} "
                                              f"(sysfs: {detect_npu().summary()})") from e
        return _device[1]


def close_device() -> None:
    """Forget the process's device handle and loaded xclbins (tests; a later call reopens)."""
    global _device
    with _device_lock:
        _device = None
        _programs.clear()


@contextmanager
def xrt_errors(what: str) -> Iterator[None]:
    """Re-raise anything ``pyxrt`` raises inside the block as ``BackendUnavailableError``."""
    try:
        yield
    except BackendUnavailableError:
        raise
    except Exception as e:  # noqa: BLE001 - pyxrt's errors are RuntimeError / std::exception
        raise BackendUnavailableError(f"NPU: {what} failed: {type(e).__name__}: {e}") from e


# ---- xclbins and kernels -------------------------------------------------------------------

@dataclass
class _Program:
    """One registered xclbin: its ``pyxrt.xclbin``, ``hw_context`` and kernels by name."""

    xclbin: object
    context: object
    kernels: dict


_programs: dict[str, _Program] = {}  # xclbin path -> registered program (guarded by _device_lock)


def _program(pyxrt, device, path: Path) -> _Program:
    with _device_lock:
        program = _programs.get(str(path))
        if program is None:
            with xrt_errors(f"loading {path.name} (pyxrt.xclbin, register_xclbin, hw_context)"):
                xclbin = pyxrt.xclbin(str(path))
                device.register_xclbin(xclbin)
                context = pyxrt.hw_context(device, xclbin.get_uuid())
            program = _programs[str(path)] = _Program(xclbin, context, {})
        return program


class RoleKernel:
    """One manifest role bound to its kernel: the ``pyxrt.kernel``, its hardware context and its
    instruction buffer (``cacheable``, ``group_id(1)``)."""

    def __init__(self, pyxrt, device, spec: RoleSpec, files: KernelFiles, opcode: int):
        self.pyxrt, self.device, self.spec, self.opcode = pyxrt, device, spec, opcode
        program = _program(pyxrt, device, files.xclbin)
        self.context = program.context
        words = np.fromfile(files.instructions, dtype="<u4")  # [n_words] uint32
        self.n_words = int(words.size)
        with xrt_errors(f"creating kernel {files.kernel!r} of {files.xclbin.name} ({spec.name})"):
            kernel = program.kernels.get(files.kernel)
            if kernel is None:
                kernel = program.kernels[files.kernel] = pyxrt.kernel(self.context, files.kernel)
            self.kernel = kernel
            self.instr = pyxrt.bo(device, words.nbytes, pyxrt.bo.cacheable, kernel.group_id(1))
            self.instr.write(words, 0)
            self.instr.sync(pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)

    def group_of(self, arg: str) -> int:
        """Memory group of data argument ``arg``: ``group_id(3 + its index among data args)``."""
        names = [a.name for a in self.spec.data_args]
        return self.kernel.group_id(3 + names.index(arg))

    def new_run(self, data: dict[str, object]):
        """A ``pyxrt.run`` with every argument set (opcode, instructions, their count, then the
        data buffers in the role's order); not started."""
        run = self.pyxrt.run(self.kernel)
        run.set_arg(0, self.opcode)
        run.set_arg(1, self.instr)
        run.set_arg(2, self.n_words)
        for i, arg in enumerate(self.spec.data_args):
            run.set_arg(3 + i, data[arg.name])
        return run


class Buffer:
    """A ``host_only`` BO with a numpy view of its mapped memory."""

    def __init__(self, pyxrt, device, nbytes: int, group: int, dtype, shape: tuple[int, ...]):
        self.pyxrt = pyxrt
        with xrt_errors(f"allocating a {nbytes}-byte buffer"):
            self.bo = pyxrt.bo(device, nbytes, pyxrt.bo.host_only, group)
            self.array = np.frombuffer(self.bo.map(), dtype=dtype, count=int(np.prod(shape))).reshape(shape)
        self.nbytes = nbytes

    def to_device(self, nbytes: int | None = None) -> None:
        self.bo.sync(self.pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE, nbytes or self.nbytes, 0)

    def from_device(self, nbytes: int | None = None) -> None:
        self.bo.sync(self.pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE, nbytes or self.nbytes, 0)


class _Segment:
    """Runs of one hardware context executed in order: as a ``pyxrt.runlist`` when the binding
    has one (built on first use, reused after), else start + wait per run."""

    def __init__(self, pyxrt, context, runs: list):
        self.pyxrt, self.context, self.runs = pyxrt, context, runs
        self.runlist = None

    def execute(self) -> None:
        if len(self.runs) > 1 and hasattr(self.pyxrt, "runlist"):  # older pyxrt builds lack runlist
            if self.runlist is None:
                self.runlist = self.pyxrt.runlist(self.context)
                for run in self.runs:
                    self.runlist.add(run)
            self.runlist.execute()
            self.runlist.wait()  # raises if a run fails
            return
        completed = self.pyxrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        for run in self.runs:
            run.start()
            state = run.wait()
            if state != completed:
                raise RuntimeError(f"a run ended in state {state}")


# ---- the model -----------------------------------------------------------------------------

class NpuKVCache(BlockTable):
    """The KV cache of one sequence in one ``host_only`` BO: ``[L, 2, Hkv, S, D]`` bfloat16, a
    sub-buffer per layer; growing reallocates and copies the held positions. Its positions'
    blocks come from a ``BlockPool`` that only counts (the engine's, or one of its own), so the
    engine admits and preempts npu sequences as cpu ones; the storage is the BO's."""

    def __init__(self, model: NpuModel, capacity: int, pool: BlockPool | None = None):
        max_length = model.config.max_position_embeddings
        super().__init__(pool or BlockPool(0, growable=True), max_length)
        self.model = model
        self.plans: dict[tuple[str, bool], list[_Segment]] = {}
        self._allocate(min(max_length, _round_up(max(capacity, 1))))

    @property
    def buffer_capacity(self) -> int:
        """Positions the BO holds."""
        return self.view.shape[3]

    @property
    def nbytes(self) -> int:
        return self.parent.nbytes

    def _allocate(self, capacity: int) -> None:
        m = self.model
        c = m.config
        shape = (c.num_hidden_layers, 2, c.num_key_value_heads, capacity, c.head_dim)
        per_layer = 2 * int(np.prod(shape[1:]))  # bytes of one layer's [2, Hkv, S, D] bfloat16
        old = getattr(self, "parent", None)
        self.parent = Buffer(m.pyxrt, m.device, per_layer * shape[0], m.kv_group, np.uint16, shape)
        with xrt_errors("creating the per-layer KV sub-buffers"):
            self.layers = [m.pyxrt.bo(self.parent.bo, per_layer, i * per_layer) for i in range(shape[0])]
        self.view = self.parent.array  # [L, 2, Hkv, S, D] uint16
        if old is not None and self.length:
            old.from_device()
            self.view[:, :, :, : self.length] = old.array[:, :, :, : self.length]
            self.parent.to_device()
        self.plans.clear()  # runs bound the old sub-buffers

    def reserve(self, n_new: int) -> None:
        super().reserve(n_new)
        need = self.length + n_new
        if need > self.buffer_capacity:
            self._allocate(min(self.max_length, _round_up(max(need, 2 * self.buffer_capacity))))


class NpuModel:
    """A Llama-family target whose step runs on the NPU; the same step API as ``CausalLM``.

    Built from the loaded cpu model (its config, fused float32 weights, embedding and LM head,
    which the host and the DFlash draft keep using) and a validated manifest build.

    Args:
        cpu_model: the ``CausalLM`` of the same tag.
        manifest, build: the kernels to run (``validate_build`` passed on them).
        pyxrt: the module (tests pass a fake); default ``import_pyxrt()``.

    Raises:
        BackendUnavailableError: no pyxrt, no device, a build whose geometry is not the model's,
            or a kernel / buffer that fails to load.
    """

    backend = Backend.NPU
    kv_dtype = np.float32  # the cache is bfloat16; the KV budget counts it as float32 (conservative)
    batch_invariant = False  # not shown on hardware: no prefix caching

    def __init__(self, cpu_model, manifest: Manifest, build: Build, *, pyxrt=None):
        c = self.config = cpu_model.config
        # Host copies [V, E] float32 (the NPU kernels take float32, whatever the cpu model holds).
        self.embed, self.lm_head = cpu.as_float32(cpu_model.embed), cpu.as_float32(cpu_model.lm_head)
        self.norm = cpu_model.norm  # [E] float32
        mismatch = geometry_mismatch(build, c)
        if mismatch:
            raise BackendUnavailableError(f"the NPU kernel build for {build.model} does not fit this "
                                          f"model: {'; '.join(mismatch)}")
        self.geometry, self.rows = dict(build.geometry), build.max_rows
        self.prefill_chunk = self.rows
        self.pyxrt = pyxrt or import_pyxrt()
        self.device = open_device(self.pyxrt)
        self.kernels = {role: RoleKernel(self.pyxrt, self.device, manifest.roles[role], files, manifest.opcode)
                        for role, files in build.kernels.items()}
        self._lock = threading.Lock()  # one step at a time: the activation buffers are shared
        self._allocate(manifest, cpu_model)

    def _allocate(self, manifest: Manifest, cpu_model) -> None:
        c, r = self.config, self.rows
        layer, head = self.kernels["decode_layer"], self.kernels["lm_head"]
        e, v = c.hidden_size, c.vocab_size
        new = lambda nbytes, group, dtype, shape: Buffer(self.pyxrt, self.device, nbytes, group, dtype, shape)
        self.acts = [new(4 * r * e, layer.group_of("x_in"), np.float32, (r, e))
                     for _ in range(c.num_hidden_layers + 1)]  # [R, E] each; i = the input of layer i
        self.step = new(16, layer.group_of("step"), np.int32, (4,))
        self.logits = new(4 * r * v, head.group_of("logits"), np.float32, (r, v))
        self.kv_group = layer.group_of("kv")
        self.layer_weights = []
        for w in cpu_model.layers:
            self.layer_weights.append(self._weights(manifest, "layer_weights", layer.group_of("weights"), vars(w)))
        self.head_weights = self._weights(manifest, "lm_head_weights", head.group_of("weights"),
                                          {"norm": cpu_model.norm, "lm_head": cpu_model.lm_head})

    def _weights(self, manifest: Manifest, layout: str, group: int, tensors: dict) -> Buffer:
        _, total = layout_entries(manifest, layout, self.geometry)
        buf = Buffer(self.pyxrt, self.device, total, group, np.uint8, (total,))
        buf.array[:] = pack(manifest, layout, self.geometry, {k: cpu.as_float32(v) for k, v in tensors.items()})
        with xrt_errors(f"syncing {layout} to the device"):
            buf.to_device()
        return buf

    # ---- the step (TargetModel) ----

    def new_pool(self, positions: int) -> BlockPool:
        """The engine's pool: blocks that only count (each cache's storage is its own BO)."""
        return BlockPool(positions // BLOCK_TOKENS)

    def new_cache(self, capacity: int = 0, pool: BlockPool | None = None) -> NpuKVCache:
        """An empty KV cache for one sequence (``capacity``: a hint in tokens; it grows), its
        blocks counted in ``pool`` (one of its own without)."""
        return NpuKVCache(self, capacity, pool)

    def forward_batch(self, token_rows: list[np.ndarray], caches: list[NpuKVCache], *, taps: tuple[int, ...] = (),
                      logit_rows: list[int] | None = None) -> ForwardOutput:
        """``TargetModel.forward_batch``, sequence by sequence (the kernel build has no batched
        layer yet); if a sequence raises, every cache is rolled back to its length before the call
        and the error propagates."""
        rows = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_rows]
        n_logits = [r.size for r in rows] if logit_rows is None else [int(n) for n in logit_rows]
        lengths = [c.length for c in caches]
        try:
            outs = [self._sequence(r, c, n, taps) for r, c, n in zip(rows, caches, n_logits)]
        except Exception:
            for cache, n in zip(caches, lengths):
                cache.trim(n)
            raise
        logits = np.concatenate([o.logits for o in outs])  # [sum n_b, V]
        return ForwardOutput(logits, np.concatenate([o.taps for o in outs]) if taps else None)

    def _sequence(self, token_ids: np.ndarray, cache: NpuKVCache, n_logits: int,
                  taps: tuple[int, ...]) -> ForwardOutput:
        """``T`` positions of one sequence appended to ``cache`` in device steps of at most
        ``rows`` positions (see the module docstring): logits ``[n_logits, V]`` of its last rows,
        taps ``[T, n*E]`` or None."""
        assert token_ids.size > 0 and all(0 <= i < self.config.num_hidden_layers for i in taps)
        all_logits = n_logits > 1  # else the LM head runs on the last row only
        chunk = self.rows if "prefill_layer" in self.kernels else VERIFY_POSITIONS
        logits, tapped = [], []
        with self._lock:
            for s in range(0, token_ids.size, chunk):
                ids = token_ids[s : s + chunk]
                last = s + chunk >= token_ids.size
                out = self._step(ids, cache, all_logits=all_logits, need_logits=all_logits or last, taps=taps)
                logits += [out[0]] if out[0] is not None else []
                tapped += [out[1]] if taps else []
        result = np.concatenate(logits) if all_logits else logits[-1]  # [T, V] or [1, V]
        return ForwardOutput(result[len(result) - n_logits :], np.concatenate(tapped) if taps else None)

    # ---- one device step ----

    def _step(self, ids: np.ndarray, cache: NpuKVCache, *, all_logits: bool, need_logits: bool,
              taps: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Up to ``rows`` positions through every layer (and the LM head when ``need_logits``).

        Returns:
            logits ``[T, V]`` (``all_logits``) or ``[1, V]``, or None; taps ``[T, n*E]`` or None.
        """
        t, e = ids.size, self.config.hidden_size
        role = "decode_layer" if t == 1 else "verify_layer" if t <= VERIFY_POSITIONS else "prefill_layer"
        cache.reserve(t)
        start, first_row = cache.length, 0 if all_logits else t - 1
        self.acts[0].array[:t] = self.embed[ids]  # [T, E] float32
        self.step.array[:] = step_array(start, t, cache.buffer_capacity, first_row)
        plan = cache.plans.get((role, need_logits))
        if plan is None:
            plan = cache.plans[(role, need_logits)] = self._plan(role, need_logits, cache)
        with xrt_errors(f"running {role} x{self.config.num_hidden_layers}{' + lm_head' if need_logits else ''} "
                        f"at positions {start}..{start + t - 1}"):
            self.acts[0].to_device(4 * t * e)
            self.step.to_device()
            for segment in plan:
                segment.execute()
            logits = None
            if need_logits:
                self.logits.from_device(4 * (t - first_row) * self.config.vocab_size)
                logits = self.logits.array[: t - first_row].copy()  # [T or 1, V]
            tapped = None
            if taps:
                for i in taps:
                    self.acts[i + 1].from_device(4 * t * e)
                tapped = np.concatenate([self.acts[i + 1].array[:t] for i in taps], axis=-1)  # [T, n*E]
        cache.commit(t)
        return logits, tapped

    def _plan(self, role: str, with_head: bool, cache: NpuKVCache) -> list[_Segment]:
        """The runs of one step kind for ``cache``, grouped into segments by hardware context."""
        if role not in self.kernels:
            raise BackendUnavailableError(f"the NPU kernel build has no {role} kernel")
        layer = self.kernels[role]
        runs = [(layer.context, layer.new_run({"x_in": self.acts[i].bo, "x_out": self.acts[i + 1].bo,
                                                "weights": self.layer_weights[i].bo, "kv": cache.layers[i],
                                                "step": self.step.bo}))
                for i in range(self.config.num_hidden_layers)]
        if with_head:
            head = self.kernels["lm_head"]
            runs.append((head.context, head.new_run({"x_in": self.acts[-1].bo, "weights": self.head_weights.bo,
                                                     "logits": self.logits.bo, "step": self.step.bo})))
        segments: list[_Segment] = []
        for context, run in runs:
            if not segments or segments[-1].context is not context:
                segments.append(_Segment(self.pyxrt, context, []))
            segments[-1].runs.append(run)
        return segments


GROWTH_QUANTUM = 256  # positions; a cache's buffer grows in multiples of this to amortize reallocation


def _round_up(n: int) -> int:
    return -(-n // GROWTH_QUANTUM) * GROWTH_QUANTUM
