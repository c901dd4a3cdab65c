"""The npu backend's kernel builds: ``manifest.json`` and the xclbin files it names, installed as
data of this package so that a wheel carries them (``flm_runtime.backends.npu.manifest`` finds them
with ``importlib.resources``). What the manifest promises is in ``xclbins/README.md``."""
