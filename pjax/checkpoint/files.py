"""Files of checkpoint directories: the Hugging Face `config.json` and the native target's format file. Output
directories are written under the rule of `pjax._io` (`write_output_dir`)."""
from __future__ import annotations

import json
from pathlib import Path

from pjax._io import NATIVE_MARKER
from pjax.checkpoint.errors import CheckpointError

__all__ = ["NATIVE_MARKER", "read_hf_config"]


def read_hf_config(path) -> dict:
    """`path/config.json` as a dict; CheckpointError naming the file when it is absent or not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: not found")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg
