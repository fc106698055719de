"""Public entry point: `grouped_matmul(x, w, group_sizes, implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools

import jax
import numpy as np

from pjax.kernels import dispatch
from pjax.kernels.grouped_matmul import reference
from pjax.kernels.grouped_matmul.config import MIN_ROWS_PER_GROUP
from pjax.kernels.quantized import dequantize, is_quantized, zero_cotangent


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "implementation"))
def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, implementation: str = "auto"):
    """out [M, N]: x [M, K] rows sorted by group, group g's group_sizes[g] rows times w[g] ([G, K, N]; w[g].T of
    [G, N, K] with transpose_rhs); rows past sum(group_sizes) are zero; float32 accumulation, x's dtype out.
    Differentiable: the kernel's backward is the transposed grouped matmul (dx) and a per-group transposed product
    (dw). implementation (`pjax.kernels.dispatch`): the kernel takes one floating dtype for x and a plain w, or any
    floating x with a packed w whose tiles fit its format (else the reference, for "pallas" too); "auto" runs it
    on a GPU from `config.MIN_ROWS_PER_GROUP` mean rows per group (its cost grows with the rows, ragged_dot's GPU
    lowering with rows x groups: 2.8x at 1,024 GPT-OSS-20B pairs, 15-20x at 32,768). A `QuantizedWeight` w (logical [G, K, N]) is a constant: the kernel dequantises it per tile
    (with transpose_rhs the reference runs); the reference and the kernel's backward dequantise the whole stack to
    x's dtype first."""
    from pjax.kernels.grouped_matmul import pallas
    reference.check_inputs(x, w, group_sizes, transpose_rhs)
    supported = pallas.unsupported_reason(x, w) is None and not (is_quantized(w) and transpose_rhs)
    faster = x.shape[0] >= MIN_ROWS_PER_GROUP * w.shape[0]
    if dispatch.use_kernel(implementation, supported=supported, faster=faster, op="grouped_matmul"):
        return _pallas_gmm(x, w, group_sizes, transpose_rhs)
    if is_quantized(w):
        w = jax.lax.stop_gradient(dequantize(w, x.dtype))
    return reference.grouped_matmul(x, w, group_sizes, transpose_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_gmm(x, w, group_sizes, transpose_rhs):
    from pjax.kernels.grouped_matmul import pallas
    return pallas.grouped_matmul(x, w, group_sizes, transpose_rhs=transpose_rhs)


def _fwd(x, w, group_sizes, transpose_rhs):
    return _pallas_gmm(x, w, group_sizes, transpose_rhs), (x, w, group_sizes)


def _bwd(transpose_rhs, res, g):
    from pjax.kernels.grouped_matmul import pallas
    x, w, group_sizes = res
    g = g.astype(x.dtype)
    if is_quantized(w):  # a constant: only dx, through the dequantised stack
        dx = pallas.grouped_matmul(g, dequantize(w, x.dtype), group_sizes, transpose_rhs=True)
        return dx, zero_cotangent(w), np.zeros(group_sizes.shape, jax.dtypes.float0)
    dx = pallas.grouped_matmul(g, w, group_sizes, transpose_rhs=not transpose_rhs)
    if transpose_rhs:  # w [G, N, K]: dw[g] = dy_g.T @ x_g
        dw = pallas.transposed_grouped_matmul(g, x, group_sizes, w.dtype)
    else:
        dw = pallas.transposed_grouped_matmul(x, g, group_sizes, w.dtype)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_pallas_gmm.defvjp(_fwd, _bwd)
