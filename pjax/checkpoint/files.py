"""Files of a checkpoint directory: the Hugging Face `config.json` and the pjax-native marker."""
from __future__ import annotations

import json
from pathlib import Path

from pjax.checkpoint.errors import CheckpointError

__all__ = ["NATIVE_MARKER", "read_hf_config"]

NATIVE_MARKER = "pjax_target.json"


def read_hf_config(path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: not found")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
