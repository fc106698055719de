"""Reading kernels out of jaxprs: which Pallas kernels a traced function runs, and with what dot precision."""
from __future__ import annotations

import jax
from jax.extend import core as jcore

from pjax import _compat


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
    """Names of the pallas_call kernels that fn(*args) runs."""
    return [_compat.pallas_call_name(e.params) for e, _ in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "pallas_call"]


def kernel_dot_precisions(fn, *args) -> list:
    """The precision param of every dot_general inside fn(*args)'s pallas_call kernels."""
    return [e.params["precision"] for e, inside in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if inside and e.primitive.name == "dot_general"]
