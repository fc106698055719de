"""Reading kernels out of jaxprs: which Pallas kernels a traced function runs (`python -m pjax check`'s "ran"
column, and the kernel tests)."""
from __future__ import annotations

import jax
from jax.extend import core as jcore

from pjax._compat import pallas_call_name

__all__ = ["equations", "pallas_kernel_names", "sub_jaxprs"]


def sub_jaxprs(params):
    """The jaxprs held in an equation's params (cond branches, loop bodies, pjit, pallas_call kernels...)."""
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def equations(jaxpr, inside_kernel: bool = False):
    """(equation, inside a pallas_call kernel) for every equation of `jaxpr` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, inside_kernel
        for sub in sub_jaxprs(eqn.params):
            yield from equations(sub, inside_kernel or eqn.primitive.name == "pallas_call")


def pallas_kernel_names(fn, *args) -> list[str]:
    """Names of the pallas_call kernels that fn(*args) runs (traced, not run)."""
    return [pallas_call_name(e.params) for e, _ in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "pallas_call"]
