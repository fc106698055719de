"""Public entry point: `expert_matmul(x, expert_ids, w, implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools

import jax
import numpy as np

from pjax.kernels import _dispatch
from pjax.kernels.expert_matmul import reference

# H200 (JAX 0.11.2, 2026-11-22, device time from the profiler): the kernel is 4.1-21x faster than the XLA gather path at
# the Qwen3-30B-A3B and GPT-OSS-20B expert shapes with 1 and 8 tokens (docs/benchmarks.md section 2).


@functools.partial(jax.jit, static_argnames=("repeat", "implementation"))
def expert_matmul(x, expert_ids, w, *, repeat: int = 1, implementation: str = "auto"):
    """out [P, dout] = x[p // repeat] @ w[expert_ids[p]]: x [P / repeat, din] (repeat = top-k lets each token row feed
    its k pairs), expert_ids [P] int (indexed as `w[expert_ids]`: negative ids wrap, too large ones clamp),
    w [E, din, dout]; float32 accumulation, x's dtype out. "auto" takes the Pallas kernel on a GPU where it supports
    the shapes. Differentiable (the kernel's VJP is the reference's)."""
    from pjax.kernels.expert_matmul import pallas
    reference.check_inputs(x, expert_ids, w, repeat)
    supported = pallas.unsupported_reason(x, w, repeat) is None
    if _dispatch.resolve(implementation, auto_pallas=supported) == "pallas":
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
    _, vjp = jax.vjp(lambda x_, w_: reference.expert_matmul(x_, expert_ids, w_, repeat), x, w)
    dx, dw = vjp(g)
    return dx, np.zeros(expert_ids.shape, jax.dtypes.float0), dw


_pallas_with_reference_vjp.defvjp(_fwd, _bwd)
