"""``litellm-flm validate``: the NPU, its driver and firmware, pyxrt, the xclbins, and the backend
``auto`` would choose for a model, as a dict (``--json``) or text. Never raises for what is
missing: reporting it is the point."""

from __future__ import annotations

import os
import sys

from flm_runtime.backends.npu import manifest as mf
from flm_runtime.backends.select import probe_npu
from flm_runtime.errors import FlmError
from flm_runtime.settings import Settings, requested_backend, variable


def validate_report(tag: str, target: str | None = None) -> dict:
    """Everything ``validate`` shows, for model ``tag`` as asked, whose kernels are those of
    ``target`` (a plain registry tag: a DFlash tag's base; None: ``tag`` itself)."""
    target = target or tag
    probe = probe_npu(target)
    report = {
        "tag": tag,
        "target": target,
        "npu": probe.detection.as_dict(),
        "pyxrt": {"importable": probe.pyxrt_error is None, "error": probe.pyxrt_error,
                  "path": getattr(sys.modules.get("pyxrt"), "__file__", None) if probe.pyxrt_error is None else None},
        "device": {"opened": probe.pyxrt_error is None and probe.device_error is None,
                   "name": probe.device_name, "error": probe.device_error},
        "manifest": _manifest_report(),
        "backend": _backend_report(target, probe),
    }
    return report


def _manifest_report() -> dict:
    try:
        manifest = mf.load_manifest()
    except FlmError as e:
        return {"path": str(mf.xclbin_dir() / mf.MANIFEST_NAME), "error": str(e), "builds": []}
    builds = []
    for build in manifest.builds:
        check = mf.validate_build(manifest, build.model)
        builds.append({
            "model": build.model, "ok": check.ok, "problems": check.problems,
            "roles": [{"role": k.role, "ok": k.ok, "xclbin": str(k.files.xclbin), "kernel": k.files.kernel,
                       "uuid": k.uuid, "problems": k.problems} for k in check.kernels],
        })
    return {"path": str(manifest.path), "error": None, "shipped": manifest.shipped, "status": manifest.status,
            "builds": builds}


def _backend_report(tag: str, probe) -> dict:
    settings = Settings.from_env()
    env = settings.backend
    try:
        configured, config_error = requested_backend(None, settings), None
    except FlmError as e:
        configured, config_error = None, str(e)
    auto = "npu" if probe.ok else "cpu"
    reason = (f"pyxrt imports, the NPU opens and the xclbins of {tag} validate" if probe.ok
              else "; ".join(probe.missing))
    runs = {"cpu": "cpu", "auto": auto, "npu": "npu" if probe.ok else None}.get(configured)
    return {"env": env, "configured": configured, "configured_error": config_error, "auto": auto,
            "reason": reason, "missing": list(probe.missing), "would_run": runs}


def format_report(report: dict) -> str:
    """The report as text, one topic per block."""
    npu, lines = report["npu"], ["NPU"]
    for d in npu["devices"]:
        fields = [d["generation"], f"driver {d['driver'] or 'none bound'}",
                  f"firmware {d['fw_version'] or 'unknown'}", ", ".join(d["accel_nodes"]) or "no /dev/accel node"]
        if d["vbnv"]:
            fields.append(d["vbnv"])
        if not d["supported"]:
            fields.append("not supported by our kernels (they target XDNA2)")
        lines.append(f"  {d['pci_id']} at {d['bdf']}: {'; '.join(fields)}")
    if not npu["devices"]:
        lines.append("  none on the PCI bus (looked for AMD 1022:17f0 XDNA2 and 1022:1502 XDNA1)")
    version = f" (version {npu['driver_version']})" if npu["driver_version"] else ""
    lines.append(f"  driver: amdxdna {'loaded' + version if npu['driver_loaded'] else 'not loaded'}")
    py, dev = report["pyxrt"], report["device"]
    lines.append(f"pyxrt: importable ({py['path']})" if py["importable"] else f"pyxrt: {py['error']}")
    if py["importable"]:
        lines.append(f"device 0: opened ({dev['name'] or 'name unknown'})" if dev["opened"]
                     else f"device 0: {dev['error']}")
    m = report["manifest"]
    lines.append(f"xclbins: {m['path']}")
    if m["error"]:
        lines.append(f"  {m['error']}")
    elif not m["shipped"]:
        lines.append(f"  {m['status']}")
    for b in m["builds"]:
        lines.append(f"  {b['model']}: {'validates' if b['ok'] else 'does not validate'}")
        lines += [f"    {p}" for p in b["problems"]]
        for r in b["roles"]:
            lines.append(f"    {r['role']}: {'ok' if r['ok'] else 'FAILS'} ({os.path.basename(r['xclbin'])}: "
                         f"{r['kernel']}{', ' + r['uuid'] if r['uuid'] else ''})")
            lines += [f"      {p}" for p in r["problems"]]
    if m.get("builds") == [] and not m["error"]:
        lines.append("  no builds")
    bk = report["backend"]
    runs_as = f" (runs its target {report['target']})" if report["target"] != report["tag"] else ""
    lines.append(f"backend for {report['tag']}{runs_as}")
    if bk["missing"]:
        lines.append(f"  auto would choose {bk['auto']}, because:")
        lines += [f"    - {m}" for m in bk["missing"]]
    else:
        lines.append(f"  auto would choose {bk['auto']}: {bk['reason']}")
    if bk["configured_error"]:
        lines.append(f"  {bk['configured_error']}")
    else:
        source = f"{variable('backend')}={bk['env']}" if bk["env"] else f"{variable('backend')} unset (auto)"
        runs = bk["would_run"] or "nothing: the npu backend cannot run (see above)"
        lines.append(f"  {source}: runs on {runs}")
    return "\n".join(lines)
