"""Tensor- and expert-parallel placement of a target (and a drafter) on a `jax.sharding.Mesh` with the axes "data"
(request rows) and "model" (weights).

The plan (`param_spec`) maps a parameter's path and shape to a `PartitionSpec` over the "model" axis of n devices:
- attention: q_proj by its output columns (query heads, column-parallel), o_proj by its input rows (row-parallel),
  the sinks and q biases with their heads; k_proj / v_proj (and their biases) by KV heads when n divides the KV heads,
  else replicated: every device then computes and caches all KV heads (the KV cache takes no memory saving) and
  reads the ones its query heads use;
- gated MLP: gate_proj / up_proj by the intermediate dimension (columns), down_proj by its input rows;
- MoE experts: by expert (expert parallel: gate_up [E, H, 2I], down [E, I, H] and their biases on E) or by the
  intermediate dimension (gate_up on 2I, down on I); the router is replicated; packed (MXFP4 / FP8) experts are
  split by expert in either mode;
- embedding and LM head by vocabulary;
- norms, biases of row-parallel layers and other small leaves replicated.
A dimension that n does not divide is replicated (a tiny vocabulary, 4 heads over 8 devices). Every weight is
replicated over "data". XLA (GSPMD) inserts the collectives of a jitted program whose inputs carry these shardings:
the functions of `pjax.models` stay as they are.

The KV cache [B, S, nkv, hd] is split by rows on "data" and by KV heads on "model" (`kv_spec`, the same divisibility
rule as k_proj). `put` places one host tensor (a memory-mapped checkpoint slice) with a sharding, copying each device
only its slice: a loader never holds a full copy per device.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pjax.config import ModelConfig
from pjax.kernels.quantized import is_quantized
from pjax.models.paths import param_path

__all__ = ["DATA_AXIS", "EXPERT_SHARDING", "MODEL_AXIS", "axis_size", "kv_spec", "leaf_spec", "make_mesh", "param_spec",
           "param_specs", "place", "place_drafter", "place_target", "put", "rows_spec"]

DATA_AXIS, MODEL_AXIS = "data", "model"
EXPERT_SHARDING = ("expert", "intermediate")


def make_mesh(data: Optional[int] = None, model: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A 2-D mesh ("data", "model") of data x model devices (default: all of `devices`, default `jax.devices()`,
    data = their count / model). model: the tensor-parallel degree; data: request rows (decoding) or batch rows
    (training) split over the devices."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(model, int) or model < 1:
        raise ValueError(f"make_mesh: model must be an integer >= 1, got {model!r}")
    if data is None:
        if len(devices) % model:
            raise ValueError(f"make_mesh: model={model} does not divide the {len(devices)} devices")
        data = len(devices) // model
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"make_mesh: data must be an integer >= 1, got {data!r}")
    if data * model > len(devices):
        raise ValueError(f"make_mesh: data={data} x model={model} needs {data * model} devices, "
                         f"{len(devices)} are available")
    grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def axis_size(mesh: Optional[Mesh], axis: str) -> int:
    """Devices along `axis` of the mesh (1 when the mesh is None or has no such axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(axis, 1))


def _split(dim: int, n: int) -> Optional[str]:
    return MODEL_AXIS if n > 1 and dim % n == 0 else None


def _layer_of(path: tuple, cfg: ModelConfig):
    if len(path) > 1 and path[0] == "layers" and str(path[1]).isdigit() and int(path[1]) < len(cfg.layers):
        return cfg.layers[int(path[1])]
    return cfg.layers[0]


def param_spec(path: tuple, shape: tuple, cfg: ModelConfig, n: int, experts: str = "expert") -> P:
    """The PartitionSpec over the "model" axis of n devices of the parameter at `path` (keys of a target's or a
    drafter's pure-dict params, e.g. ("layers", 0, "self_attn", "q_proj", "kernel")) of shape `shape`; cfg: the
    model's config (a drafter's: its `config.layer`); experts: "expert" | "intermediate" (MoE experts split by
    expert or by intermediate dimension)."""
    if experts not in EXPERT_SHARDING:
        raise ValueError(f"experts must be one of {EXPERT_SHARDING}, got {experts!r}")
    names = [str(p) for p in path]
    leaf, module = names[-1], names[-2] if len(names) > 1 else ""
    if n == 1 or not shape:
        return P()
    heads = cfg.num_heads % n == 0
    kv_heads = _layer_of(path, cfg).num_kv_heads % n == 0
    if names[:2] == ["embed_tokens", "embedding"]:
        return P(_split(shape[0], n), None)
    if module == "lm_head" and leaf == "kernel":
        return P(None, _split(shape[1], n))
    if module in ("q_proj", "k_proj", "v_proj"):
        ok = heads if module == "q_proj" else kv_heads
        axis = MODEL_AXIS if ok else None
        return P(None, axis) if leaf == "kernel" else P(axis)
    if module == "o_proj":
        return P(MODEL_AXIS if heads else None, None) if leaf == "kernel" else P()
    if leaf == "sinks":
        return P(MODEL_AXIS if heads else None)
    if module in ("gate_proj", "up_proj"):
        return P(None, _split(shape[-1], n)) if leaf == "kernel" else P(_split(shape[-1], n))
    if module == "down_proj":
        return P(_split(shape[0], n), None) if leaf == "kernel" else P()
    if module == "mlp" and leaf in ("gate_up", "down", "gate_up_bias", "down_bias"):
        if experts == "expert":
            return P(_split(shape[0], n), *([None] * (len(shape) - 1)))
        if leaf == "down_bias":
            return P()
        axis = -1 if leaf in ("gate_up", "gate_up_bias") else 1  # 2I: the last axis; I: down's rows
        spec = [None] * len(shape)
        spec[axis] = _split(shape[axis], n)
        return P(*spec)
    return P()


def leaf_spec(path: tuple, x, cfg: ModelConfig, n: int, experts: str = "expert"):
    """`param_spec` of one parameter leaf (anything with a shape); a packed `QuantizedWeight`: a QuantizedWeight of
    specs, its arrays split by expert where n divides the experts (in either expert mode)."""
    if is_quantized(x):
        e = x.data.shape[0]
        return jax.tree.map(lambda a: P(_split(e, n), *([None] * (a.ndim - 1))), x)
    return param_spec(path, tuple(x.shape), cfg, n, experts)


def param_specs(params, cfg: ModelConfig, n: int, experts: str = "expert"):
    """The plan of a params tree: a matching tree of PartitionSpecs (`leaf_spec`)."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: leaf_spec(param_path(kp), x, cfg, n, experts),
                                            params, is_leaf=is_quantized)


def kv_spec(shape: tuple, mesh: Optional[Mesh]) -> P:
    """A KV cache leaf [B, S, nkv, hd] (or any [B, ...] row leaf of a decode state when it has fewer axes): rows on
    "data", KV heads on "model" where the model axis divides them (as k_proj, `param_spec`)."""
    n = axis_size(mesh, MODEL_AXIS)
    if len(shape) != 4:
        return rows_spec(shape, mesh)
    return P(DATA_AXIS if axis_size(mesh, DATA_AXIS) > 1 else None, None, _split(shape[2], n), None)


def rows_spec(shape: tuple, mesh: Optional[Mesh]) -> P:
    """A per-row leaf [B, ...]: rows on "data" (replicated over "model"); a scalar and an empty leaf (no elements: what
    a program returns for it is replicated) are replicated."""
    return P(DATA_AXIS) if shape and 0 not in shape and axis_size(mesh, DATA_AXIS) > 1 else P()


def put(value, sharding: Optional[NamedSharding], dtype=None) -> jax.Array:
    """One tensor (a numpy array, e.g. a memory-mapped checkpoint view, or a jax.Array) as a jax.Array cast to
    `dtype`: on the default device when sharding is None, else placed with `sharding`, each device receiving only
    its slice (`jax.make_array_from_callback`: a host array is sliced per device, never copied whole to each; a
    jax.Array is read to the host once, which needs no program per shape and works across processes)."""
    if sharding is None:
        return jnp.asarray(value, dtype)
    if isinstance(value, jax.Array):
        value = np.asarray(jax.device_get(value))
    dt = np.dtype(value.dtype if dtype is None else dtype)
    return jax.make_array_from_callback(tuple(value.shape), sharding, lambda idx: np.asarray(value[idx], dt))


def place(tree, specs, mesh: Mesh):
    """`tree`'s leaves placed on `mesh` with the PartitionSpecs of `specs` (a matching tree)."""
    return jax.tree.map(lambda x, s: put(x, NamedSharding(mesh, s)), tree, specs)


def place_target(target, mesh: Mesh, experts: str = "expert"):
    """The target with its params placed on `mesh` by the plan (`param_spec`), its `experts` set to `experts`."""
    specs = param_specs(target.params, target.config, axis_size(mesh, MODEL_AXIS), experts)
    return dataclasses.replace(target, params=place(target.params, specs, mesh), experts=experts)


def place_drafter(drafter, mesh: Mesh):
    """The drafter replicated on every device of `mesh` (params and d2t)."""
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: put(x, rep), drafter)
