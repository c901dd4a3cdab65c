"""A user speculation policy that makes ``smollm2-dflash:135m`` speculate at every step on cpu,
for tests in this process (``speculation_forced``) and in a proxy's (its ``XDG_CONFIG_HOME``)."""

from __future__ import annotations

import json
from pathlib import Path

DFLASH_TAG = "smollm2-dflash:135m"

# A speculation policy for DFLASH_TAG on cpu that verifies whole blocks at every context and never
# switches off (an AL is never below a cost_ratio of 1): the shipped cpu table speculates nowhere.
ALWAYS_SPECULATE_TABLE = {"model": DFLASH_TAG, "backend": "cpu", "buckets": [
    {"max_context": 8192, "speculate": True, "draft_length": 7, "min_confidence": 0.0, "cost_ratio": 1.0,
     "expected_al": 1.0}]}


def write_always_speculate_policy(config_home: Path) -> Path:
    """Write ``ALWAYS_SPECULATE_TABLE`` where ``paths.policy_file`` looks for the user's table when
    ``$XDG_CONFIG_HOME`` is ``config_home``; returns ``config_home``."""
    path = config_home / "litellm-flm" / "policy" / "smollm2-dflash" / "135m-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ALWAYS_SPECULATE_TABLE))
    return config_home
