"""Loading a target: a Hugging Face model directory or a pjax-native copy."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from pjax.checkpoint.files import NATIVE_MARKER
from pjax.checkpoint.hf import load_hf_params, read_target_config
from pjax.checkpoint.native import load_native_target
from pjax.models.target import Target

__all__ = ["load_target"]


def load_target(path, dtype=jnp.bfloat16) -> Target:
    """Load a Hugging Face model directory (config.json + model.safetensors or a sharded index), or a
    pjax-native directory written by ``python -m pjax convert target``."""
    path = Path(path)
    if (path / NATIVE_MARKER).exists():
        return load_native_target(path, dtype)
    hf, cfg = read_target_config(path)
    return load_hf_params(path, cfg, hf, dtype)
