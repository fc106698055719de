"""pjax-native target checkpoints: an orbax StandardCheckpointer copy of the pure-dict params, the Hugging
Face `config.json` (the model is rebuilt from it) and the marker file `pjax_target.json`.

Layout of OUT_DIR:
    config.json        the source model's Hugging Face config (quantization_config removed: weights are dense)
    params/            orbax checkpoint of `Target.params`
    pjax_target.json   marker: format, version, model_type, dtype, parameter count (written last)
The directory is written beside its final location and renamed into place, so it never exists half-way.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import NATIVE_MARKER, read_hf_config
from pjax.config import ConfigError
from pjax.models.families import config_from_hf
from pjax.models.target import Target, abstract_target

FORMAT = "pjax-target"
VERSION = 1


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def param_count(params) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))


def save_native_target(target: Target, hf_config: dict, out, *, overwrite: bool = False) -> Path:
    """Write `target` to the directory `out` atomically (temporary sibling directory, then rename).

    hf_config: the Hugging Face config dict the target was parsed from (must round-trip to
    `target.config`). An existing `out` is an error unless `overwrite`.
    """
    out = Path(out).absolute()
    hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    try:
        parsed = config_from_hf(hf_config)
    except ConfigError as e:
        raise CheckpointError(f"hf_config does not describe a supported model: {e}") from None
    if parsed != target.config:
        raise CheckpointError(f"hf_config parses to {parsed.model_type!r} geometry that differs from the "
                              "target's config; pass the config.json the target was loaded from")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass overwrite=True / --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        ckptr = _checkpointer()
        ckptr.save(tmp / "params", target.params)
        ckptr.wait_until_finished()
        ckptr.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        marker = {"format": FORMAT, "version": VERSION, "model_type": target.config.model_type,
                  "dtype": str(jnp.dtype(target.dtype)), "num_params": param_count(target.params)}
        (tmp / NATIVE_MARKER).write_text(json.dumps(marker, indent=2))
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_marker(path) -> dict:
    marker_path = Path(path) / NATIVE_MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{marker_path}: not found (not a pjax-native target directory)") from None
    except ValueError as e:
        raise CheckpointError(f"{marker_path}: not valid JSON ({e})") from None
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{marker_path}: format {marker.get('format')!r} version {marker.get('version')!r}, "
                              f"expected {FORMAT!r} version {VERSION}")
    return marker


def load_native_target(path, dtype=jnp.bfloat16) -> Target:
    """Load a directory written by `save_native_target` / `python -m pjax convert target`; params cast to dtype."""
    path = Path(path).absolute()
    marker = read_marker(path)
    hf = read_hf_config(path)
    try:
        cfg = config_from_hf(hf, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    stored = abstract_target(cfg, jnp.dtype(marker["dtype"]))
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path / 'params'}: orbax parameter directory is missing")
    ckptr = _checkpointer()
    try:
        params = ckptr.restore(path / "params", stored.params)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{path / 'params'}: does not match the {cfg.model_type!r} model in "
                              f"config.json ({type(e).__name__}: {str(e)[:300]})") from None
    finally:
        ckptr.close()
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return Target(cfg, stored.graphdef, params)
