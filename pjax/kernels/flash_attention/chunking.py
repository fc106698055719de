"""Row-chunked maps with rematerialisation: the memory bound of the jnp reference paths (attention over query chunks,
losses over the vocabulary in token chunks). Each chunk's intermediates live only while that chunk runs, in the
forward pass and, recomputed, in the backward pass."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["chunk_size", "chunked_map"]


def chunk_size(n: int, per_row: int, budget: int, chunk: Optional[int] = None, minimum: int = 64) -> int:
    """Rows per chunk: `chunk` when given, else all n when n * per_row <= budget, else budget // per_row (at least
    `minimum`). per_row = elements of the largest intermediate one row makes."""
    if chunk is not None:
        return max(1, min(int(chunk), n))
    if n * per_row <= budget:
        return n
    return min(n, max(minimum, budget // max(1, per_row)))


def chunked_map(fn, xs, chunk: int):
    """fn over chunks of `chunk` rows along axis 0 of every array in the pytree xs (the tail padded, then dropped):
    one chunk at a time (lax.map), each rematerialised in the backward pass. fn returns a pytree of arrays with the
    rows on axis 0. chunk >= the row count calls fn once on everything."""
    leaves = jax.tree.leaves(xs)
    n = leaves[0].shape[0]
    if chunk >= n:
        return fn(xs)
    nc = -(-n // chunk)
    pad = nc * chunk - n

    def prep(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((nc, chunk) + x.shape[1:])

    out = jax.lax.map(jax.checkpoint(fn), jax.tree.map(prep, xs))
    return jax.tree.map(lambda y: y.reshape((nc * chunk,) + y.shape[2:])[:n], out)
