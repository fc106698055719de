"""Row gathers whose gradient accumulates in float32.

`x[idx]`'s gradient is a scatter-add into x's shape and dtype. On the GPU a bfloat16 scatter-add is a
compare-and-swap loop per element, and training gathers repeat rows many times (every deeper COD element embeds the
one mask token; chain keys are read by up to K - 1 queries): in a bf16 P-EAGLE head step those scatters took 85 of
233 ms (H200, docs/performance.md "Training throughput and memory"). `take_rows` gathers the same values and
accumulates its gradient in float32 (native atomic adds), cast back to x's dtype once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["take_rows"]


@jax.custom_vjp
def take_rows(x, idx):
    """x [M, ...], idx int [...] -> x[idx] [..., ...] (`jnp.take` along axis 0: an index out of range reads NaN and gets
    no gradient); the gradient w.r.t. x is summed in float32."""
    return jnp.take(x, idx, axis=0)


def _fwd(x, idx):
    return jnp.take(x, idx, axis=0), (x, idx)


def _bwd(res, g):
    x, idx = res
    dx = jnp.zeros(x.shape, jnp.float32).at[idx].add(g.astype(jnp.float32))
    return dx.astype(x.dtype), None


take_rows.defvjp(_fwd, _bwd)
