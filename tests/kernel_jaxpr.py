"""Reading kernels out of jaxprs: which Pallas kernels a traced function runs (`pjax.kernels.jaxpr`), with what
dot precision, and whether per shard (inside a shard_map)."""
from __future__ import annotations

import jax

from pjax._compat import pallas_call_name
from pjax.kernels.jaxpr import equations, pallas_kernel_names, sub_jaxprs

__all__ = ["equations", "kernel_dot_precisions", "pallas_kernel_names", "shard_kernel_names", "sub_jaxprs"]


def kernel_dot_precisions(fn, *args) -> list:
    """The precision param of every dot_general inside fn(*args)'s pallas_call kernels."""
    return [e.params["precision"] for e, inside in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if inside and e.primitive.name == "dot_general"]


def shard_kernel_names(fn, *args) -> tuple[set, set]:
    """(names of the pallas_call kernels fn(*args) runs inside a shard_map, names of those it runs outside one)."""
    inside, outside = set(), set()

    def walk(jaxpr, in_shard: bool):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                (inside if in_shard else outside).add(pallas_call_name(e.params))
                continue
            for sub in sub_jaxprs(e.params):
                walk(sub, in_shard or e.primitive.name == "shard_map")
    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return inside, outside
