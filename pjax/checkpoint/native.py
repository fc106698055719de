"""pjax-native target checkpoints: an orbax StandardCheckpointer copy of the pure-dict params, the Hugging
Face `config.json` (the model is rebuilt from it) and the format file `pjax_target.json`.

Layout of OUT_DIR:
    config.json        the source model's Hugging Face config (quantization_config removed: weights are dense)
    params/            orbax checkpoint of `Target.params`
    pjax_target.json   format, version, model_type, dtype, parameter count; per-tensor checksums
                       (`pjax.checkpoint.integrity`) and the size of every file under params/
    pjax_output.json   the pjax output marker (kind "target"; see `pjax._io`)
The directory is written beside its final location and renamed into place (`write_output_dir`), so it never
exists half-way. Loading checks that every recorded file is present with its recorded size (a truncated or
deleted file is one error naming it), then compares the checksums of the restored tensors (one device pass;
`verify=False` skips it). Version 1 copies (no checksums) load only with `verify=False`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pjax._io import NATIVE_MARKER, signals_deferred, write_json, write_output_dir
from pjax.checkpoint import integrity
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import read_hf_config
from pjax.config import ConfigError
from pjax.dtypes import parse_dtype
from pjax.models.families import config_from_hf
from pjax.models.paths import param_path
from pjax.models.sharding import MODEL_AXIS, axis_size, param_specs
from pjax.models.target import Target, abstract_target

FORMAT = "pjax-target"
VERSION = 2
READABLE = (1, 2)


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def _save_params(directory: Path, params) -> None:
    """orbax copy of `params` at `directory`; returns when every file is written. The caller holds signals
    meanwhile: orbax writes from background threads that an interrupt would leave running past a cleanup."""
    ckptr = _checkpointer()
    try:
        ckptr.save(directory, params)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()


def param_count(params) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))


def _names(params) -> tuple[list[str], list, object]:
    """(dotted parameter names, leaves, treedef) of a params tree."""
    flat, treedef = jax.tree.flatten_with_path(params)
    names = [".".join(map(str, param_path(kpath))) for kpath, _ in flat]
    return names, [leaf for _, leaf in flat], treedef


def _file_sizes(out: Path) -> dict[str, int]:
    """Size of every file under out/params, keyed by its path relative to `out`."""
    return {p.relative_to(out).as_posix(): p.stat().st_size
            for p in sorted((out / "params").rglob("*")) if p.is_file()}


def save_native_target(target: Target, hf_config: dict, out, *, overwrite: bool = False, sources=()) -> Path:
    """Write `target` to the directory `out` atomically (temporary sibling directory, then rename).

    hf_config: the Hugging Face config dict the target was parsed from (must round-trip to `target.config`).
    overwrite: replace an existing pjax-native copy at `out`; any other existing directory is refused, as is
    an `out` equal to, inside or containing one of `sources` (`pjax.checkpoint.prepare_output`).
    """
    hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if target.config.name_or_path and not hf_config.get("_name_or_path"):
        hf_config["_name_or_path"] = target.config.name_or_path  # the copy keeps its source's name (verifier checks)
    try:
        parsed = config_from_hf(hf_config)
    except ConfigError as e:
        raise CheckpointError(f"hf_config does not describe a supported model: {e}") from None
    if parsed != target.config:
        raise CheckpointError(f"hf_config parses to {parsed.model_type!r} geometry that differs from the "
                              "target's config; pass the config.json the target was loaded from")
    names, leaves, _ = _names(target.params)
    sums = integrity.checksums(leaves)
    with write_output_dir(out, force=overwrite, kind="target", sources=sources) as tmp:
        with signals_deferred(notice="pjax: stopping once the orbax write in progress has finished"):
            _save_params(tmp / "params", target.params)
        write_json(tmp / "config.json", hf_config)
        write_json(tmp / NATIVE_MARKER, {
            "format": FORMAT, "version": VERSION, "model_type": target.config.model_type,
            "dtype": str(jnp.dtype(target.dtype)), "num_params": param_count(target.params),
            "checksum": integrity.CHECKSUM, "checksums": dict(zip(names, sums)), "files": _file_sizes(tmp)})
    return Path(os.path.abspath(out))


def read_marker(path) -> dict:
    """The validated `pjax_target.json` of a native copy."""
    marker_path = Path(path) / NATIVE_MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{marker_path}: not found (not a pjax-native target directory)") from None
    except ValueError as e:
        raise CheckpointError(f"{marker_path}: not valid JSON ({e})") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{marker_path}: expected a JSON object, found {type(marker).__name__}")
    if marker.get("format") != FORMAT or marker.get("version") not in READABLE:
        raise CheckpointError(f"{marker_path}: format {marker.get('format')!r} version {marker.get('version')!r}, "
                              f"expected {FORMAT!r} version {' or '.join(map(str, READABLE))}")
    try:
        valid = isinstance(marker.get("dtype"), str) and jnp.dtype(marker["dtype"]) is not None
    except TypeError:
        valid = False
    if not valid:
        raise CheckpointError(f"{marker_path}: dtype {marker.get('dtype')!r} is not a dtype name")
    if marker["version"] >= 2:
        files, sums = marker.get("files"), marker.get("checksums")
        if (not isinstance(files, dict) or not all(isinstance(v, int) and v >= 0 for v in files.values())
                or any(Path(k).is_absolute() or ".." in Path(k).parts for k in files)):
            raise CheckpointError(f"{marker_path}: 'files' must map relative paths to sizes in bytes")
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise CheckpointError(f"{marker_path}: 'checksums' must map parameter names to hex strings")
        if marker.get("checksum") != integrity.CHECKSUM:
            raise CheckpointError(f"{marker_path}: checksum algorithm {marker.get('checksum')!r} is not "
                                  f"{integrity.CHECKSUM!r}")
    return marker


def _check_files(path: Path, files: dict) -> None:
    for rel, size in files.items():
        f = path / rel
        try:
            found = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{f}: missing (incomplete copy)") from None
        if found != size:
            raise CheckpointError(f"{f}: {found} bytes, expected {size} (truncated or damaged copy)")


def load_native_target(path, dtype=jnp.bfloat16, *, verify: bool = True, check_finite: bool = True, mesh=None,
                       experts: str = "expert") -> Target:
    """Load a directory written by `save_native_target` / `python -m pjax convert target`; params cast to dtype.

    Every recorded file must be present with its recorded size. verify: compare each restored tensor's
    checksum with the one written at conversion (one device pass; False skips it). check_finite: reject NaN /
    inf parameters (after the cast), naming the tensor. mesh / experts: restore each tensor straight into its
    shards on the mesh (`pjax.models.sharding`), as `load_target`."""
    dtype = parse_dtype(dtype, what="load_native_target dtype")
    path = Path(path).absolute()
    marker = read_marker(path)
    if marker["version"] < 2 and verify:
        raise CheckpointError(f"{path / NATIVE_MARKER}: a version {marker['version']} copy has no checksums; write "
                              "it again with `python -m pjax convert target ... --force`, or load it with "
                              "verify=False / --no-verify")
    hf = read_hf_config(path)
    try:
        cfg = config_from_hf(hf, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    params_dir = path / "params"
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir}: orbax parameter directory is missing")
    if marker["version"] >= 2:
        _check_files(path, marker["files"])
    stored = abstract_target(cfg, jnp.dtype(marker["dtype"]))
    wanted = stored.params
    if mesh is not None:
        specs = param_specs(wanted, cfg, axis_size(mesh, MODEL_AXIS), experts)
        wanted = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                              wanted, specs)
    ckptr = _checkpointer()
    try:
        params = ckptr.restore(params_dir, wanted)
    except Exception as e:  # orbax / tensorstore raise bare Exceptions with multi-line specs
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CheckpointError(f"{params_dir}: could not be restored as the {cfg.model_type!r} model of config.json "
                              f"({type(e).__name__}: {first})") from None
    finally:
        ckptr.close()
    names, leaves, treedef = _names(params)
    if verify:
        want = marker["checksums"]
        if set(want) != set(names):
            diff = sorted(set(want) ^ set(names))
            raise CheckpointError(f"{path / NATIVE_MARKER}: checksums name other tensors than the model has "
                                  f"({diff[:4]}{' ...' if len(diff) > 4 else ''})")
        for name, got in zip(names, integrity.checksums(leaves)):
            if got != want[name]:
                raise CheckpointError(f"{params_dir}: tensor {name!r} fails its checksum (stored {want[name]}, "
                                      f"read {got}): the copy is damaged; write it again with `python -m pjax "
                                      "convert target ... --force`")
    leaves = [jnp.asarray(x, dtype) for x in leaves]
    if check_finite:
        integrity.check_finite(leaves, lambda i: f"{params_dir}: tensor {names[i]!r}")
    return Target(cfg, stored.graphdef, jax.tree.unflatten(treedef, leaves))
