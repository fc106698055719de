"""Casting a model value (a Target or a Drafter: config, graphdef, params) to a dtype: the floating params and the NNX
module definition (whose layers carry their compute dtype) together, so a cast the JAX way (`jax.tree.map` over the
params only) can be repaired instead of running a float32 module on bfloat16 weights."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pjax.dtypes import parse_dtype
from pjax.kernels.quantized import is_quantized

__all__ = ["astype", "cast_floating", "matching_module"]


def cast_floating(params, dtype):
    """Every floating leaf of `params` cast to `dtype`; integer leaves and packed low-bit weights unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if not is_quantized(x) and jnp.issubdtype(x.dtype, jnp.floating)
                        else x, params, is_leaf=is_quantized)


@functools.lru_cache(maxsize=64)
def _graphdef(abstract, config, dtype):
    return abstract(config, dtype).graphdef


def astype(value, abstract, dtype, what: str):
    """`value` with params and module both in `dtype`; abstract(config, dtype) builds the value's params-free form."""
    dtype = parse_dtype(dtype, what=f"{what}.astype dtype")
    return dataclasses.replace(value, graphdef=_graphdef(abstract, value.config, dtype),
                               params=cast_floating(value.params, dtype))


def matching_module(value, abstract, what: str):
    """`value` with a module definition matching its params' dtype (rebuilt if the params were cast alone);
    ValueError if its floating params mix dtypes."""
    floats = {x.dtype for x in jax.tree.leaves(value.params, is_leaf=is_quantized)
              if not is_quantized(x) and jnp.issubdtype(x.dtype, jnp.floating)}
    if len(floats) > 1:
        raise ValueError(f"the {what}'s floating params mix dtypes {sorted(str(d) for d in floats)}; cast it whole "
                         f"with {what}.astype(dtype)")
    if not floats:
        return value
    gd = _graphdef(abstract, value.config, jnp.dtype(floats.pop()))
    return value if _same_module(gd, value.graphdef) else dataclasses.replace(value, graphdef=gd)


_SAME: dict = {}  # (id(a), id(b)) -> (a, b, a == b); the objects are kept so that an id is never reused


def _same_module(a, b) -> bool:
    """a == b for two module definitions, remembered: comparing a 24-layer graphdef costs ~1 ms, and every generation
    checks its models (graphdefs are immutable)."""
    if a is b:
        return True
    hit = _SAME.get((id(a), id(b)))
    if hit is None:
        if len(_SAME) >= 256:
            _SAME.clear()
        hit = _SAME[(id(a), id(b))] = (a, b, a == b)
    return hit[2]
