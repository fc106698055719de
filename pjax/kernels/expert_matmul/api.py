"""Public entry point: `expert_matmul(x, expert_ids, w, implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools

import jax

from pjax.kernels import _dispatch
from pjax.kernels.expert_matmul import reference

# H200 (JAX 0.11.2, 2026-11-22, device time from the profiler): the kernel is 3.5-20x faster than the XLA gather path at
# the Qwen3-30B-A3B and GPT-OSS-20B expert shapes with 1 and 8 tokens (docs/benchmarks.md section 2).


@functools.partial(jax.jit, static_argnames=("implementation",))
def expert_matmul(x, expert_ids, w, *, implementation: str = "auto"):
    """out [P, dout] = x[p] @ w[expert_ids[p]]: x [P, din], expert_ids [P] int, w [E, din, dout]; float32
    accumulation, x's dtype out. "auto" takes the Pallas kernel on a GPU where it supports the shapes."""
    from pjax.kernels.expert_matmul import pallas
    supported = pallas.unsupported_reason(x, w) is None
    if _dispatch.resolve(implementation, auto_pallas=supported) == "pallas":
        return pallas.expert_matmul(x, expert_ids, w)
    return reference.expert_matmul(x, expert_ids, w)
