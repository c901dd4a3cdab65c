"""A fake ``pyxrt`` module: the classes and call signatures of XRT's Python binding
(``src/python/pybind11/src/pyxrt.cpp``: device, xclbin, hw_context, kernel, run, runlist, bo,
xclBOSyncDirection, ert_cmd_state), with kernels executed by Python functions.

It models what the host code must get right: a BO has a host copy (``map``, ``write``, ``read``)
and a device copy, and only ``sync`` moves bytes between them, so a missing sync shows up as stale
data; kernels see device copies; a sub-buffer shares its parent's memory; a runlist takes runs of
its own hardware context only and is reusable; ``device(0)`` fails as XRT does without a device.
"""

from __future__ import annotations

import enum
import types

import numpy as np

from flm_runtime.backends.npu.xclbin import read_xclbin


class SyncDir(enum.IntEnum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1


class CmdState(enum.IntEnum):
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5


class InfoDevice(enum.IntEnum):
    name = 5


class BoFlags(enum.IntEnum):
    normal = 0
    cacheable = 1 << 24
    device_only = 1 << 25
    host_only = 1 << 29


def make_fake_pyxrt(kernels: dict, *, devices: int = 1, runlist: bool = True) -> types.ModuleType:
    """A module named ``pyxrt``. ``kernels``: kernel name -> ``fn(args)`` where ``args`` are the
    run's arguments in order (ints, and ``FakeDeviceView`` for buffers); ``devices``: how many
    ``device(i)`` opens; ``runlist``: whether the binding has ``runlist`` (recent XRT; older builds lack it)."""
    log: list[tuple] = []

    class uuid:
        def __init__(self, text: str):
            self.text = text

        def to_string(self) -> str:
            return self.text

    class device:
        def __init__(self, index: int = 0):
            if index >= devices:
                raise RuntimeError(f"No such device with index '{index}'")
            self.registered: dict[str, object] = {}
            log.append(("device", index))

        def register_xclbin(self, xb):
            self.registered[xb.uuid.text] = xb
            log.append(("register_xclbin", xb.path))
            return xb.uuid

        def get_info(self, key):
            return "RyzenAI-npu4 (fake)"

    class xclbin:
        def __init__(self, path: str):
            self.path = path
            self.parsed = read_xclbin(path)
            self.uuid = uuid(self.parsed.uuid)

        def get_uuid(self):
            return self.uuid

    class hw_context:
        def __init__(self, dev, uid):
            if uid.text not in dev.registered:
                raise RuntimeError(f"xclbin {uid.text} is not registered")
            self.device, self.xclbin = dev, dev.registered[uid.text]
            log.append(("hw_context", self.xclbin.path))

    class kernel:
        def __init__(self, ctx, name: str):
            if name not in ctx.xclbin.parsed.kernels:
                raise RuntimeError(f"No such kernel '{name}'")
            self.ctx, self.name = ctx, name
            log.append(("kernel", name))

        def group_id(self, index: int) -> int:
            return 1 if index == 1 else 100 + index  # distinct, so a wrong group is visible

        def __call__(self, *args):
            r = run(self)
            for i, a in enumerate(args):
                r.set_arg(i, a)
            r.start()
            return r

    class bo:
        flags = BoFlags
        normal, cacheable, device_only, host_only = (BoFlags.normal, BoFlags.cacheable,
                                                     BoFlags.device_only, BoFlags.host_only)

        def __init__(self, first, size: int, flags_or_offset, group: int | None = None):
            if isinstance(first, bo):  # sub-buffer: (parent, size, offset)
                self.host, self.dev = first.host, first.dev
                self.offset, self.flags, self.group = first.offset + flags_or_offset, first.flags, first.group
                assert self.offset + size <= first.offset + first.nbytes, "sub-buffer past its parent"
            else:
                assert isinstance(first, device) and group is not None
                self.host, self.dev = bytearray(size), bytearray(size)
                self.offset, self.flags, self.group = 0, BoFlags(flags_or_offset), group
            self.nbytes = size
            log.append(("bo", size, self.flags.name, self.group))

        def size(self) -> int:
            return self.nbytes

        def map(self):
            return memoryview(self.host)[self.offset : self.offset + self.nbytes]

        def write(self, data, seek: int) -> None:
            raw = memoryview(np.ascontiguousarray(data)).cast("B")
            self.map()[seek : seek + raw.nbytes] = raw

        def read(self, size: int, skip: int):
            return np.frombuffer(bytes(self.map()[skip : skip + size]), dtype=np.int8)

        def sync(self, direction, size: int | None = None, offset: int = 0) -> None:
            size = self.nbytes - offset if size is None else size
            a, b = self.offset + offset, self.offset + offset + size
            assert b <= self.offset + self.nbytes, "sync past the end of the buffer"
            if direction == SyncDir.XCL_BO_SYNC_BO_TO_DEVICE:
                self.dev[a:b] = self.host[a:b]
            else:
                self.host[a:b] = self.dev[a:b]
            log.append(("sync", SyncDir(direction).name, size))

        def device_view(self):
            return memoryview(self.dev)[self.offset : self.offset + self.nbytes]

    class run:
        def __init__(self, k):
            self.kernel, self.args, self.state = k, {}, CmdState.ERT_CMD_STATE_NEW

        def set_arg(self, index: int, value) -> None:
            self.args[index] = value

        def start(self) -> None:
            args = [self.args[i] for i in range(len(self.args))]
            kernels[self.kernel.name]([a.device_view() if isinstance(a, bo) else a for a in args])
            log.append(("run", self.kernel.name))
            self.state = CmdState.ERT_CMD_STATE_COMPLETED

        def wait(self, timeout_ms: int = 0):
            return self.state

    class runlist_:
        def __init__(self, ctx):
            self.ctx, self.runs = ctx, []

        def add(self, r) -> None:
            if r.kernel.ctx is not self.ctx:
                raise RuntimeError("run's kernel is not in the runlist's hw_context")
            self.runs.append(r)

        def execute(self) -> None:
            log.append(("runlist", len(self.runs)))
            for r in self.runs:
                r.start()

        def wait(self, timeout_ms: int = 0) -> None:
            pass

    module = types.ModuleType("pyxrt")
    module.__dict__.update(uuid=uuid, device=device, xclbin=xclbin, hw_context=hw_context, kernel=kernel,
                           bo=bo, run=run, xclBOSyncDirection=SyncDir, ert_cmd_state=CmdState,
                           xrt_info_device=InfoDevice, log=log)
    if runlist:
        module.runlist = runlist_
    return module
