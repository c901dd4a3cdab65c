"""Where the runtime keeps and finds model files.

Every function reads the settings (``flm_runtime.settings``) when called (not at import), so a
test or a long-running process that changes ``FLM_MODEL_PATH`` or ``FLM_MODELS_FILE`` sees the
change at once:

    FLM_MODEL_PATH: the model cache directory. Default: the platform's user cache directory for
        ``litellm-flm`` plus ``models`` (``~/.cache/litellm-flm/models`` on Linux).
    FLM_MODELS_FILE: the user models file (YAML; see ``flm_runtime.registry``). Default:
        ``models.yaml`` in the platform's user config directory for ``litellm-flm``
        (``~/.config/litellm-flm/models.yaml`` on Linux).
"""

from __future__ import annotations

from pathlib import Path

import platformdirs

from flm_runtime.settings import Settings

APP_NAME = "litellm-flm"


def model_dir() -> Path:
    """The model cache directory (absolute; not created here)."""
    override = Settings.from_env().model_path
    if override:
        return Path(override).expanduser().resolve()
    return platformdirs.user_cache_path(APP_NAME) / "models"


def converted_dir() -> Path:
    """Where model files' converted weights are kept (``flm_runtime.loading.converted``):
    ``<model dir>/.converted`` (not created here)."""
    return model_dir() / ".converted"


def config_dir() -> Path:
    """The user config directory of litellm-flm (not created here)."""
    return platformdirs.user_config_path(APP_NAME)


def models_file() -> Path:
    """The user models file: ``$FLM_MODELS_FILE`` or ``<config dir>/models.yaml`` (may not exist)."""
    override = Settings.from_env().models_file
    if override:
        return Path(override).expanduser().resolve()
    return config_dir() / "models.yaml"


def package_dir() -> Path:
    """The installed ``flm_runtime`` package directory (drafts shipped with the package live here)."""
    return Path(__file__).resolve().parent


def tag_dir(tag: str) -> Path:
    """The cache sub-directory of a ``family:size`` tag: ``<model dir>/<family>/<size>``.

    Two levels instead of one name with ``:`` (not allowed in Windows file names) and without
    joining family and size with a character that a family name may itself contain.
    """
    family, _, size = tag.partition(":")
    assert family and size, tag
    return model_dir() / family / size


def policy_file(tag: str, backend: str) -> Path:
    """Where ``litellm-flm calibrate`` writes the speculation policy table of a DFlash ``tag`` on
    ``backend``: ``<config dir>/policy/<family>/<size>-<backend>.json`` (may not exist; it
    overrides the table shipped in the draft directory)."""
    family, _, size = tag.partition(":")
    assert family and size, tag
    return config_dir() / "policy" / family / f"{size}-{backend}.json"


def host_costs_file(tag: str, backend: str) -> Path:
    """Where the verify cost curve of a DFlash ``tag``'s target on this host is kept
    (``flm_runtime.speculation.costs``): ``<config dir>/policy/<family>/<size>-<backend>-host.json``."""
    return policy_file(tag, backend).with_name(f"{tag.partition(':')[2]}-{backend}-host.json")
