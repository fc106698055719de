"""The matmul-precision rule of every public forward: a float32 model runs full float32 products.

XLA's default on the GPU multiplies float32 matrices in TF32 (about 1e-3 relative error); PyTorch, and so the
transformers / speculators references, multiply them in full float32 unless TF32 is allowed. pjax follows PyTorch:
a computation involving a float32 Target or Drafter runs under matmul precision "highest" (XLA dots and the Pallas
kernels read it), unless TF32 is asked for ("default" then, set explicitly). A precision chosen explicitly (a
`jax.default_matmul_precision` context, the JAX config, the decoding engine's allow_tf32) is left as it is. On the
CPU every precision is full float32 already.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

__all__ = ["float32_products", "matmul_precision", "precision_scope"]


def _model_dtype(x):
    """The dtype of a Target / Drafter (anything with config, params and dtype), None for other values."""
    if not (hasattr(x, "config") and hasattr(x, "params")) or x.params is None:
        return None
    try:
        return x.dtype
    except (AttributeError, KeyError, TypeError):
        return None


def matmul_precision(*models, allow_tf32: bool = False) -> Optional[str]:
    """When one of `models` (Targets, Drafters, None) is float32: "highest", or "default" (TF32 on the GPU) with
    allow_tf32; else None (nothing to choose)."""
    if not any(_model_dtype(m) == jnp.float32 for m in models):
        return None
    return "default" if allow_tf32 else "highest"


def precision_scope(*models, allow_tf32: bool = False):
    """A context in which computations (and the tracing of jitted ones) follow `matmul_precision`'s rule, unless a
    precision is chosen already."""
    precision = matmul_precision(*models, allow_tf32=allow_tf32)
    if precision is None or jax.config.jax_default_matmul_precision is not None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)


def float32_products(fn: Callable) -> Callable:
    """Decorator of a public entry point: a call with a float32 model among its positional arguments runs (and is
    traced, when jitted inside) under `matmul_precision`'s rule."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with precision_scope(*args):
            return fn(*args, **kwargs)
    return wrapped
