"""Choosing a backend: ``FLM_BACKEND=auto|cpu|npu``, or the same value per deployment.

- ``cpu``: the numpy backend (``CausalLM``), always available.
- ``npu``: the npu backend, or ``BackendUnavailableError`` saying everything that is missing.
- ``auto`` (the default): ``npu`` only when pyxrt imports, ``pyxrt.device(0)`` opens and the
  model's xclbins validate against ``xclbins/flm_xclbins/manifest.json``; otherwise ``cpu``, with the reason
  logged once per process (INFO, logger ``flm_runtime.backends.select``).

``FLM_BACKEND`` (``flm_runtime.settings``) is the default when a caller passes no backend.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from flm_runtime.errors import BackendUnavailableError, FlmError
from flm_runtime.settings import requested_backend

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "npu")


@dataclass(frozen=True)
class BackendChoice:
    """``name`` is the backend that runs (``cpu`` or ``npu``); ``requested`` what was asked
    (``auto``, ``cpu``, ``npu``); ``reason`` why, in words."""

    name: str
    requested: str
    reason: str


@dataclass
class NpuProbe:
    """What the npu backend needs, checked in order; each ``*_error`` is None when that part is fine.

    Attributes:
        tag: the model (plain registry tag) whose xclbins were validated.
        detection: sysfs's view (``npu.device.NpuDetection``).
        pyxrt_error: why ``import pyxrt`` failed.
        device_error: why ``pyxrt.device(0)`` failed (None also when it was not tried).
        device_name: ``get_info(name)`` of the opened device, when it opened.
        build: the manifest check (``manifest.BuildCheck``), or None when the manifest is unreadable.
        manifest_error: why the manifest could not be read.
    """

    tag: str
    detection: object
    pyxrt_error: str | None = None
    device_error: str | None = None
    device_name: str | None = None
    build: object = None
    manifest_error: str | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing


def probe_npu(tag: str) -> NpuProbe:
    """Check, without raising, everything the npu backend needs for model ``tag``."""
    from flm_runtime.backends import npu
    from flm_runtime.backends.npu import manifest as mf
    from flm_runtime.backends.npu.device import detect_npu

    probe = NpuProbe(tag=tag, detection=detect_npu())
    try:
        pyxrt = npu.import_pyxrt()
    except BackendUnavailableError as e:
        probe.pyxrt_error = str(e)
        probe.missing.append(f"{e}")
        if not probe.detection.usable:
            probe.missing.append(f"NPU: {probe.detection.summary()}")
    else:
        try:
            device = npu.open_device(pyxrt)
            probe.device_name = _device_name(pyxrt, device)
        except BackendUnavailableError as e:
            probe.device_error = str(e)
            probe.missing.append(str(e))
    try:
        probe.build = mf.validate_build(mf.load_manifest(), tag)
    except FlmError as e:
        probe.manifest_error = str(e)
        probe.missing.append(str(e))
    else:
        if not probe.build.ok:
            probe.missing.append(f"xclbins: {probe.build.summary()}")
    return probe


def select_backend(requested: str | None, tag: str) -> BackendChoice:
    """The backend that serves model ``tag`` (a plain registry tag) for ``requested``.

    Raises:
        InvalidRequestError: ``requested`` (or ``$FLM_BACKEND``) is not auto, cpu or npu.
        BackendUnavailableError: ``npu`` was asked for and cannot run; the message lists what is
            missing (pyxrt, a device, the xclbins).
    """
    wanted = requested_backend(requested)
    if wanted == "cpu":
        return BackendChoice("cpu", wanted, "cpu was requested")
    probe = probe_npu(tag)
    if probe.ok:
        return BackendChoice("npu", wanted, f"pyxrt imports, the NPU opens ({probe.device_name or 'device 0'}) "
                                            f"and the xclbins of {tag} validate")
    why = "; ".join(probe.missing)
    if wanted == "npu":
        raise BackendUnavailableError(f"the npu backend was requested for {tag} but cannot run: {why}")
    log_once(f"backend auto chose cpu for {tag}: {why}")
    return BackendChoice("cpu", wanted, why)


_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(message: str) -> None:
    """Log ``message`` at INFO the first time this process sees it."""
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    log.info("%s", message)


def _device_name(pyxrt, device) -> str | None:
    try:
        return str(device.get_info(pyxrt.xrt_info_device.name))
    except Exception:  # noqa: BLE001 - a name is nice to have; its absence is not an error
        return None
