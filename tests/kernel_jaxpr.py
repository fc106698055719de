"""Reading kernels out of jaxprs: which Pallas kernels a traced function runs (`pjax.kernels.jaxpr`), and with what
dot precision."""
from __future__ import annotations

import jax

from pjax.kernels.jaxpr import equations, pallas_kernel_names, sub_jaxprs

__all__ = ["equations", "kernel_dot_precisions", "pallas_kernel_names", "sub_jaxprs"]


def kernel_dot_precisions(fn, *args) -> list:
    """The precision param of every dot_general inside fn(*args)'s pallas_call kernels."""
    return [e.params["precision"] for e, inside in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if inside and e.primitive.name == "dot_general"]
