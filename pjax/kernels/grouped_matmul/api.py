"""Public entry point: `grouped_matmul(x, w, group_sizes, implementation="xla"|"pallas"|"mosaic"|"auto")`."""
from __future__ import annotations

import functools

import jax
import numpy as np

from pjax.kernels import dispatch
from pjax.kernels.grouped_matmul import reference
from pjax.kernels.grouped_matmul.config import MIN_ROWS_PER_GROUP
from pjax.kernels.quantized import dequantize, is_quantized, zero_cotangent

IMPLEMENTATIONS = ("xla", "pallas", "mosaic", "auto")  # dispatch.IMPLEMENTATIONS + this op's explicit "mosaic"


def choose(x, w, implementation: str = "auto", transpose_rhs: bool = False) -> str:
    """'xla' | 'pallas' | 'mosaic' for these inputs. "auto" on a GPU: JAX's Hopper kernel (`mosaic`) where it takes
    them from `mosaic.MIN_ROWS_PER_GROUP` mean rows per group, else the Triton kernel where it takes them from
    `config.MIN_ROWS_PER_GROUP` (packed weights: at any row count), else the reference; off a GPU the reference.
    "pallas": the Triton kernel where it takes them (interpret mode off a GPU), else the reference. "mosaic" as
    asked: ValueError off Hopper or for inputs it does not take."""
    from pjax.kernels.grouped_matmul import mosaic, pallas
    dispatch.check(implementation, IMPLEMENTATIONS, op="grouped_matmul")
    if implementation == "mosaic":
        reason = mosaic.unsupported_reason(x, w, transpose_rhs) or (
            None if mosaic.available() else "needs a Hopper (sm_90) GPU and JAX's ragged_dot_mgpu")
        if reason:
            raise ValueError(f"grouped_matmul: implementation='mosaic': {reason}")
        return "mosaic"
    rows, groups = x.shape[0], w.shape[0]
    if (implementation == "auto" and dispatch.on_gpu() and not dispatch.on_mesh() and mosaic.available()
            and mosaic.unsupported_reason(x, w, transpose_rhs) is None and rows >= mosaic.MIN_ROWS_PER_GROUP * groups):
        return "mosaic"
    supported = pallas.unsupported_reason(x, w) is None and not (is_quantized(w) and transpose_rhs)
    # packed weights: the reference dequantises the whole stack first (1.85x the kernel at 1,024 GPT-OSS-20B pairs,
    # and never cheaper than that dequantisation at fewer pairs), so the kernel at any row count
    faster = rows >= MIN_ROWS_PER_GROUP * groups or is_quantized(w)
    return "pallas" if dispatch.use_kernel(implementation, supported=supported, faster=faster,
                                           op="grouped_matmul") else "xla"


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "implementation"))
def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, implementation: str = "auto"):
    """out [M, N]: x [M, K] rows sorted by group, group g's group_sizes[g] rows times w[g] ([G, K, N]; w[g].T of
    [G, N, K] with transpose_rhs); rows past sum(group_sizes) are zero; float32 accumulation, x's dtype out.
    Differentiable: the kernels' backward is the Triton kernel's transposed grouped matmul (dx) and per-group
    transposed product (dw). implementation: see `choose` ("auto": JAX's Hopper kernel for bf16 / f16 with plain
    weights, pjax's Triton kernel for packed weights and other GPUs; measured against ragged_dot's GPU lowering,
    whose cost grows with rows x groups, in docs/performance.md). A `QuantizedWeight` w (logical [G, K, N]) is a
    constant: the Triton kernel dequantises it per tile (with transpose_rhs the reference runs); the reference and
    the backward dequantise the whole stack to x's dtype first."""
    reference.check_inputs(x, w, group_sizes, transpose_rhs)
    impl = choose(x, w, implementation, transpose_rhs)
    if impl != "xla":
        return _kernel_gmm(x, w, group_sizes, transpose_rhs, impl)
    if is_quantized(w):
        w = jax.lax.stop_gradient(dequantize(w, x.dtype))
    return reference.grouped_matmul(x, w, group_sizes, transpose_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_gmm(x, w, group_sizes, transpose_rhs, impl):
    from pjax.kernels.grouped_matmul import mosaic, pallas
    if impl == "mosaic":
        return mosaic.grouped_matmul(x, w, group_sizes)
    return pallas.grouped_matmul(x, w, group_sizes, transpose_rhs=transpose_rhs)


def _fwd(x, w, group_sizes, transpose_rhs, impl):
    return _kernel_gmm(x, w, group_sizes, transpose_rhs, impl), (x, w, group_sizes)


def _bwd(transpose_rhs, impl, res, g):  # the Triton kernels, whichever ran forward
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


_kernel_gmm.defvjp(_fwd, _bwd)
