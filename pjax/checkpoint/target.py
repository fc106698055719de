"""Loading a target: a Hugging Face model directory or a pjax-native copy."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from pjax._io import NATIVE_MARKER
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import read_hf_config
from pjax.checkpoint.heads import describe_head
from pjax.checkpoint.hf import load_hf_params, read_target_config
from pjax.checkpoint.native import load_native_target
from pjax.dtypes import parse_dtype
from pjax.kernels import dispatch
from pjax.models.target import Target

__all__ = ["load_target"]


def load_target(path, dtype=jnp.bfloat16, *, verify: bool = True, check_finite: bool = True,
                weights: str | None = None, mesh=None, experts: str = "expert") -> Target:
    """Load a Hugging Face model directory (config.json + model.safetensors or a sharded index), or a
    pjax-native directory written by ``python -m pjax convert target``; floating params cast to `dtype` (bfloat16 /
    float32 / float16, any spelling `pjax.dtypes.parse_dtype` takes).

    verify: compare a native copy's per-tensor checksums (False skips that pass, for speed; file presence
    and sizes are always checked). check_finite: reject NaN / inf weights, naming the tensor (one device
    pass). A drafter head directory is refused with a message saying to use `load_drafter`.
    weights: "native" keeps MXFP4 / FP8 experts of a quantised checkpoint packed (bytes and scales, multiplied by
    the low-bit expert kernels), "dequantized" casts them to `dtype`; None: native on a GPU (where the kernels
    run), dequantized elsewhere. Other weights (and pjax-native copies) load as `dtype` either way.
    mesh: a `jax.sharding.Mesh` with axes "data" and "model" (`pjax.make_mesh`): each tensor is placed as it is read,
    split over "model" by the plan of `pjax.models.sharding` (attention by heads, MLP by the intermediate dimension,
    embedding and LM head by vocabulary), each device receiving only its slice. experts: MoE experts split by
    "expert" (expert parallel) or by "intermediate" dimension.
    """
    dtype = parse_dtype(dtype, what="load_target dtype")
    path = Path(path)
    if (path / NATIVE_MARKER).exists():
        return _named(load_native_target(path, dtype, verify=verify, check_finite=check_finite, mesh=mesh,
                                         experts=experts), path, mesh, experts)
    head = describe_head(path, read_hf_config(path))
    if head is not None:
        raise CheckpointError(f"{path} is {head}, not a target; load it with load_drafter")
    hf, cfg = read_target_config(path)
    if weights is None:
        weights = "native" if dispatch.on_gpu() else "dequantized"
    return _named(load_hf_params(path, cfg, hf, dtype, check_finite=check_finite, weights=weights, mesh=mesh,
                                 experts=experts), path, mesh, experts)


def _named(target: Target, path: Path, mesh, experts: str) -> Target:
    """The target with its config's name_or_path: the checkpoint's `_name_or_path`, else its directory (what a head
    trained for it records as its verifier, `pjax.models.pairing.pair_warnings`); on a mesh, with its `experts`."""
    if mesh is not None:
        target = dataclasses.replace(target, experts=experts)
    if target.config.name_or_path:
        return target
    return dataclasses.replace(target, config=dataclasses.replace(target.config, name_or_path=str(path.resolve())))
