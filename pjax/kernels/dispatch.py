"""The one implementation switch of every kernel op.

`implementation=` takes one of IMPLEMENTATIONS:
- "xla": the op's jnp reference, compiled by XLA: no Pallas kernel anywhere.
- "pallas": the op's Pallas kernel (Triton on a GPU, interpret mode elsewhere). Where the kernel cannot take a
  shape, the op falls back to its reference; each op's docstring names those shapes.
- "auto": per op, shape and device: the kernel where it was measured faster on a GPU, else the reference. Off a GPU
  "auto" is "xla" (interpret mode is a correctness tool, not a fast path).
An op may accept extra explicit choices of its own (cache attention: "mosaic").
A Pallas kernel takes the arrays it is given whole: traced under a mesh of several devices (`on_mesh`) outside a
`shard_map`, where XLA would gather its inputs onto every device, an op runs its reference whatever the switch says;
the models run their kernels inside `shard_map`, per shard (`pjax.models.per_shard`).
"""
from __future__ import annotations

import functools
import importlib.util

import jax

__all__ = ["IMPLEMENTATIONS", "check", "interpret", "on_gpu", "on_mesh", "use_kernel"]

IMPLEMENTATIONS = ("xla", "pallas", "auto")


def check(implementation: str, choices: tuple = IMPLEMENTATIONS, op: str = "pjax.kernels") -> str:
    if implementation not in choices:
        raise ValueError(f"{op}: implementation must be one of {choices}, found {implementation!r}")
    return implementation


@functools.lru_cache(maxsize=None)
def on_gpu() -> bool:
    """True when the default backend is a CUDA GPU and the Pallas Triton lowering imports."""
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax.experimental.pallas.triton") is not None


def on_mesh() -> bool:
    """True when the trace runs under a mesh (`jax.sharding.get_abstract_mesh`) with an axis of several devices that
    is not manual: the arrays are whole, split by XLA's partitioner (inside a `shard_map` over every such axis they
    are one device's blocks)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is not None and not mesh.empty and any(
        n > 1 and t != jax.sharding.AxisType.Manual for n, t in zip(mesh.axis_sizes, mesh.axis_types))


def use_kernel(implementation: str, *, supported: bool = True, faster: bool = True, op: str = "pjax.kernels") -> bool:
    """Whether an op runs its Pallas kernel: `supported` = the kernel takes these shapes (else the reference, for
    "pallas" too); `faster` = on a GPU the kernel was measured faster than XLA at these shapes ("auto"). Under a
    mesh (`on_mesh`): the reference."""
    check(implementation, op=op)
    if implementation == "xla" or not supported or on_mesh():
        return False
    return implementation == "pallas" or (faster and on_gpu())


def interpret(interpret: bool | None = None) -> bool:
    """A kernel's interpret flag: as given, or (None) interpret mode everywhere except on a GPU backend."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)
