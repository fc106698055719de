"""XLA reference of the expert matmul: gather the selected experts' weights, then one batched product."""
from __future__ import annotations

import jax.numpy as jnp


def check_inputs(x, expert_ids, w):
    """x [P, din], expert_ids [P] int, w [E, din, dout]: raise ValueError naming the mismatch."""
    if x.ndim != 2 or expert_ids.shape != x.shape[:1] or w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"expert_matmul: expected x [P, din], expert_ids [P], w [E, din, dout]; found x "
                         f"{tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)}, w {tuple(w.shape)}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_matmul: expert_ids must be integers, found {expert_ids.dtype}")


def expert_matmul(x, expert_ids, w):
    """out [P, dout] = x[p] @ w[expert_ids[p]] per row, accumulated in float32, returned in x's dtype.

    Reads (and materialises) one [din, dout] weight per row: P copies where rows share an expert.
    """
    check_inputs(x, expert_ids, w)
    return jnp.einsum("pf,pfo->po", x, w[expert_ids], preferred_element_type=jnp.float32).astype(x.dtype)
