"""XLA reference of the grouped matmul (`jax.lax.ragged_dot`) and of its weight gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pjax.kernels.batching import loop_vmap


def check_inputs(x, w, group_sizes, transpose_rhs: bool = False):
    """x [M, K], w [G, K, N] ([G, N, K] with transpose_rhs), group_sizes [G] int: raise ValueError naming the
    mismatch."""
    k_axis = 2 if transpose_rhs else 1
    if (x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1 or group_sizes.shape[0] != w.shape[0]
            or w.shape[k_axis] != x.shape[1]):
        want = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(f"grouped_matmul: expected x [M, K], w {want}, group_sizes [G] with "
                         f"transpose_rhs={transpose_rhs}; found x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"group_sizes {tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integers, found {group_sizes.dtype}")


def grouped_matmul(x, w, group_sizes, transpose_rhs: bool = False):
    """out [M, N]: rows [start_g, start_g + group_sizes[g]) of x times w[g] (w[g].T with transpose_rhs), groups in
    order from row 0; rows past sum(group_sizes) are zero. Float32 accumulation, x's dtype out. Under `jax.vmap` with
    weights shared by the batch (which ragged_dot cannot batch) one product per member."""
    check_inputs(x, w, group_sizes, transpose_rhs)
    rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    return _ragged_dot(x, rhs, group_sizes.astype(jnp.int32))


def _ragged(x, rhs, group_sizes):
    return jax.lax.ragged_dot(x, rhs, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def _ragged_vjp(x, rhs, group_sizes, g):
    return jax.vjp(lambda a, b: _ragged(a, b, group_sizes), x, rhs)[1](g)


_ragged_batched, _ragged_vjp_batched = loop_vmap(_ragged), loop_vmap(_ragged_vjp)


@jax.custom_vjp
def _ragged_dot(x, rhs, group_sizes):  # ragged_dot and its VJP, each batched by `loop_vmap`
    return _ragged_batched(x, rhs, group_sizes)


def _ragged_dot_fwd(x, rhs, group_sizes):
    return _ragged_dot(x, rhs, group_sizes), (x, rhs, group_sizes)


def _ragged_dot_bwd(res, g):
    x, rhs, group_sizes = res
    return (*_ragged_vjp_batched(x, rhs, group_sizes, g), np.zeros(group_sizes.shape, jax.dtypes.float0))


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def transposed_grouped_matmul(a, b, group_sizes, out_dtype):
    """out [G, A, B] = a[rows of g].T @ b[rows of g] per group g: a [M, A], b [M, B] (the weight gradient of
    `grouped_matmul`, here through ragged_dot's own VJP); empty groups give zeros."""
    g = group_sizes.shape[0]
    rhs = jax.ShapeDtypeStruct((g, a.shape[1], b.shape[1]), jnp.float32)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(a.astype(jnp.float32), w, group_sizes.astype(jnp.int32)),
                     jnp.zeros(rhs.shape, rhs.dtype))
    return vjp(b.astype(jnp.float32))[0].astype(out_dtype)
