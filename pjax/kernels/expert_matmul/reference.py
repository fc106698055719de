"""XLA reference of the expert matmul: gather the selected experts' weights, then one batched product."""
from __future__ import annotations

import jax.numpy as jnp

from pjax.kernels.quantized import dequantize, is_quantized, take


def check_inputs(x, expert_ids, w, repeat: int = 1):
    """x [P / repeat, din], expert_ids [P] int, w [E, din, dout] (an array or a `QuantizedWeight` of that logical
    shape): raise ValueError naming the mismatch."""
    if (x.ndim != 2 or expert_ids.ndim != 1 or expert_ids.shape[0] != x.shape[0] * repeat or w.ndim != 3
            or w.shape[1] != x.shape[1]):
        raise ValueError(f"expert_matmul: expected x [P / repeat, din], expert_ids [P], w [E, din, dout] with "
                         f"repeat={repeat}; found x {tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)}, "
                         f"w {tuple(w.shape)}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_matmul: expert_ids must be integers, found {expert_ids.dtype}")


def expert_matmul(x, expert_ids, w, repeat: int = 1):
    """out [P, dout] = x[p // repeat] @ w[expert_ids[p]] per row (repeat = top-k: every token row feeds its k
    pairs), accumulated in float32, returned in x's dtype.

    Reads (and materialises) one [din, dout] weight per row: P copies where rows share an expert. A
    `QuantizedWeight` is dequantised (those rows' experts only) to x's dtype first.
    """
    check_inputs(x, expert_ids, w, repeat)
    rows = jnp.repeat(x, repeat, axis=0) if repeat > 1 else x
    selected = dequantize(take(w, expert_ids), x.dtype) if is_quantized(w) else w[expert_ids]
    return jnp.einsum("pf,pfo->po", rows, selected, preferred_element_type=jnp.float32).astype(x.dtype)
