"""Package marker: installs this folder (manifest.json, kernel builds) as ``flm_runtime.xclbins``."""
