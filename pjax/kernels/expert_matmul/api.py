"""Public entry point: `expert_matmul(x, expert_ids, w, implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools

import jax
import numpy as np

from pjax.kernels import dispatch
from pjax.kernels.expert_matmul import reference
from pjax.kernels.quantized import is_quantized, zero_cotangent


@functools.partial(jax.jit, static_argnames=("repeat", "implementation"))
def expert_matmul(x, expert_ids, w, *, repeat: int = 1, implementation: str = "auto"):
    """out [P, dout] = x[p // repeat] @ w[expert_ids[p]]: x [P / repeat, din] (repeat = top-k lets each token row feed
    its k pairs), expert_ids [P] int (indexed as `w[expert_ids]`: negative ids wrap, too large ones clamp),
    w [E, din, dout] (or a `pjax.kernels.quantized.QuantizedWeight`: MXFP4 / FP8 dequantised in the kernel's
    registers, in the reference before the product); float32 accumulation, x's dtype out. Differentiable in x and
    a plain w (the kernel's VJP is the reference's; quantised weights are constants). implementation
    (`pjax.kernels.dispatch`): the kernel takes one dtype for x and a plain w (any floating x for quantised w), at most
    `ExpertMatmulConfig.max_rows` (128) pairs and din / dout multiples of 16 (MXFP4: din a multiple of 32; FP8: a
    k tile of 16 dividing din and the input block); other inputs run the reference, for
    "pallas" too. "auto" runs the kernel on a GPU where it takes the shapes and was measured faster: plain and MXFP4
    weights at every measured decode / verify shape; FP8 weights run the reference (`pallas.measured_faster`)."""
    from pjax.kernels.expert_matmul import pallas
    reference.check_inputs(x, expert_ids, w, repeat)
    supported = pallas.unsupported_reason(x, w, repeat) is None
    if dispatch.use_kernel(implementation, supported=supported, faster=pallas.measured_faster(w),
                           op="expert_matmul"):
        return _pallas_with_reference_vjp(x, expert_ids, w, repeat)
    return reference.expert_matmul(x, expert_ids, w, repeat)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_with_reference_vjp(x, expert_ids, w, repeat):
    from pjax.kernels.expert_matmul import pallas
    return pallas.expert_matmul(x, expert_ids, w, repeat=repeat)


def _fwd(x, expert_ids, w, repeat):
    return _pallas_with_reference_vjp(x, expert_ids, w, repeat), (x, expert_ids, w)


def _bwd(repeat, res, g):
    x, expert_ids, w = res
    if is_quantized(w):  # a constant: only dx
        _, vjp = jax.vjp(lambda x_: reference.expert_matmul(x_, expert_ids, w, repeat), x)
        return vjp(g)[0], np.zeros(expert_ids.shape, jax.dtypes.float0), zero_cotangent(w)
    _, vjp = jax.vjp(lambda x_, w_: reference.expert_matmul(x_, expert_ids, w_, repeat), x, w)
    dx, dw = vjp(g)
    return dx, np.zeros(expert_ids.shape, jax.dtypes.float0), dw


_pallas_with_reference_vjp.defvjp(_fwd, _bwd)
