"""Public entry points: `norm_qkv`, `norm_swiglu`, `norm_linear`, `linear_residual` (each with
`implementation="xla"|"pallas"|"auto"`), and `use_kernel`, the test the models make before taking the fused path."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from pjax.kernels import dispatch
from pjax.kernels.fused_linear import reference
from pjax.kernels.fused_linear.config import DEFAULT


def use_kernel(implementation: str, *, rows: int, k: int, widths, dtypes, head_dim: Optional[int] = None,
               qk_norm: bool = False) -> bool:
    """Whether the fused kernels run for `rows` rows of `k` features into outputs of `widths`, operands of `dtypes`
    (heads of `head_dim`, with q/k-norm): the kernels take at most `FusedLinearConfig.max_rows` (16) rows, one
    floating dtype, K and widths multiples of 16, head_dim / 2 a multiple of 16 (a power of two <= 128 with
    q/k-norm); "pallas" runs them wherever they take the shapes, "auto" on a GPU up to `auto_max_rows` rows."""
    from pjax.kernels.fused_linear import pallas
    reason = pallas.unsupported_reason(rows, k, widths, dtypes, head_dim=head_dim, qk_norm=qk_norm)
    return dispatch.use_kernel(implementation, supported=reason is None, faster=rows <= DEFAULT.auto_max_rows,
                               op="fused_linear")


def _with_reference_vjp(kernel, ref, *args):
    """kernel(*args), differentiable: its VJP is the reference's (a pallas_call has no autodiff rule; training steps
    with few rows reach the kernels too)."""
    f = jax.custom_vjp(kernel)
    f.defvjp(lambda *a: (kernel(*a), a), lambda a, g: jax.vjp(ref, *a)[1](g))
    return f(*args)


@functools.partial(jax.jit, static_argnames=("eps", "fp32_multiply", "implementation"))
def norm_linear(x, norm_weight, w, *, eps: float, fp32_multiply: bool = False, implementation: str = "auto"):
    """rms_norm(x, norm_weight) @ w: x [M, K], norm_weight [K], w [K, N] -> [M, N] (`reference.norm_linear`).
    implementation (`pjax.kernels.dispatch`, shapes the kernel takes: `use_kernel`): one kernel, the norm in its
    prologue. Differentiable (the kernels' VJP is the reference's), as are the other ops."""
    from pjax.kernels.fused_linear import pallas
    reference.check_inputs("norm_linear", x, {"w": w}, {"norm_weight": (norm_weight, x.shape[1])})
    kw = dict(eps=eps, fp32_multiply=fp32_multiply)
    if use_kernel(implementation, rows=x.shape[0], k=x.shape[1], widths=(w.shape[1],),
                  dtypes=(x.dtype, norm_weight.dtype, w.dtype)):
        return _with_reference_vjp(functools.partial(pallas.norm_linear, **kw),
                                   functools.partial(reference.norm_linear, **kw), x, norm_weight, w)
    return reference.norm_linear(x, norm_weight, w, **kw)


@functools.partial(jax.jit, static_argnames=("eps", "fp32_multiply", "implementation"))
def norm_swiglu(x, norm_weight, w_gate, w_up, *, eps: float, fp32_multiply: bool = False,
                implementation: str = "auto"):
    """silu(xn @ w_gate) * (xn @ w_up), xn = rms_norm(x, norm_weight): x [M, K], w_gate / w_up [K, I] -> [M, I]
    (`reference.norm_swiglu`). implementation as `norm_linear`: one kernel, gate and up read once each."""
    from pjax.kernels.fused_linear import pallas
    reference.check_inputs("norm_swiglu", x, {"w_gate": w_gate, "w_up": w_up},
                           {"norm_weight": (norm_weight, x.shape[1])})
    if use_kernel(implementation, rows=x.shape[0], k=x.shape[1], widths=(w_gate.shape[1], w_up.shape[1]),
                  dtypes=(x.dtype, norm_weight.dtype, w_gate.dtype, w_up.dtype)):
        kw = dict(eps=eps, fp32_multiply=fp32_multiply)
        return _with_reference_vjp(functools.partial(pallas.norm_swiglu, **kw),
                                   functools.partial(reference.norm_swiglu, **kw), x, norm_weight, w_gate, w_up)
    return reference.norm_swiglu(x, norm_weight, w_gate, w_up, eps=eps, fp32_multiply=fp32_multiply)


@functools.partial(jax.jit, static_argnames=("head_dim", "eps", "fp32_multiply", "implementation"))
def norm_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, *, head_dim: int, eps: float, fp32_multiply: bool = False,
             q_norm=None, k_norm=None, implementation: str = "auto"):
    """The attention's input side: q, k, v = rms_norm(x) @ w_q / w_k / w_v, then per head the optional q/k-norm and
    half-split RoPE for q and k. x [M, K]; w_q [K, nh x hd]; w_k, w_v [K, nkv x hd]; cos, sin [M, hd / 2] ->
    q [M, nh x hd], k, v [M, nkv x hd] (`reference.norm_qkv`). implementation as `norm_linear`: one kernel for the
    three products from the weights as stored."""
    from pjax.kernels.fused_linear import pallas
    reference.check_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, head_dim, q_norm, k_norm)
    kw = dict(head_dim=head_dim, eps=eps, fp32_multiply=fp32_multiply)
    args = (x, norm_weight, w_q, w_k, w_v, cos, sin, q_norm, k_norm)
    dtypes = [a.dtype for a in (x, norm_weight, w_q, w_k, w_v, q_norm, k_norm) if a is not None]
    if use_kernel(implementation, rows=x.shape[0], k=x.shape[1], widths=(w_q.shape[1], w_k.shape[1]), dtypes=dtypes,
                  head_dim=head_dim, qk_norm=q_norm is not None):
        run = lambda op: lambda *a: op(*a[:7], q_norm=a[7], k_norm=a[8], **kw)  # noqa: E731
        return _with_reference_vjp(run(pallas.norm_qkv), run(reference.norm_qkv), *args)
    return reference.norm_qkv(*args[:7], q_norm=q_norm, k_norm=k_norm, **kw)


@functools.partial(jax.jit, static_argnames=("implementation",))
def linear_residual(x, w, residual, *, implementation: str = "auto"):
    """residual + x @ w: x [M, K], w [K, N], residual [M, N] -> [M, N] (`reference.linear_residual`).
    implementation as `norm_linear`: one kernel, the add in its epilogue."""
    from pjax.kernels.fused_linear import pallas
    reference.check_inputs("linear_residual", x, {"w": w}, rows={"residual": (residual, w.shape[1])})
    if use_kernel(implementation, rows=x.shape[0], k=x.shape[1], widths=(w.shape[1],),
                  dtypes=(x.dtype, w.dtype, residual.dtype)):
        return _with_reference_vjp(pallas.linear_residual, reference.linear_residual, x, w, residual)
    return reference.linear_residual(x, w, residual)
