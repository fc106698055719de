"""XLA reference of the fused small-M linear ops, and the norm / RoPE / SwiGLU semantics the models use.

`rms_norm`, `apply_rope` and `swiglu` are the one definition of that math in pjax (`pjax.models.layers` re-exports
them): the kernels in `pallas.py` follow their rounding step by step, and the ops below are their compositions with a
projection. Shapes: M rows (B x T flattened), K input features, N output features, hd head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_rope", "check_inputs", "linear_residual", "norm_linear", "norm_qkv", "norm_swiglu", "project",
           "rms_norm", "swiglu"]


def rms_norm(x, weight=None, eps: float = 1e-6, fp32_multiply: bool = False):
    """RMSNorm over the last axis in float32. weight None = weightless (gemma4 v_norm).

    fp32_multiply=False is Llama/Qwen (cast, then multiply by the weight); True is GPT-OSS/Gemma-4
    (multiply in float32, then cast).
    """
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is None:
        return xf.astype(dtype)
    if fp32_multiply:
        return (xf * weight.astype(jnp.float32)).astype(dtype)
    return weight * xf.astype(dtype)


def apply_rope(x, cos, sin):
    """Half-split (rotate_half) RoPE. x [B, T, n, hd]; cos/sin [B, T, hd/2]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def swiglu(gate, up):
    """silu(gate) * up, in the inputs' dtype (the gated MLP's "silu" activation)."""
    return jax.nn.silu(gate) * up


def project(x, w):
    """x [M, K] @ w [K, N]: float32 accumulation, the result in the operands' dtype (a GEMM of XLA, nnx.Linear)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.result_type(x, w))


def check_inputs(op: str, x, ks: tuple, vectors: dict = None, rows: dict = None):
    """x [M, K]; every weight of `ks` (name -> array) [K, N_i]; `vectors` (name -> (array, length)) 1-D of that length;
    `rows` (name -> (array, width)) [M, width]. Raise ValueError naming the mismatch."""
    if x.ndim != 2:
        raise ValueError(f"{op}: expected x [M, K], found x {tuple(x.shape)}")
    m, k = x.shape
    for name, w in ks.items():
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"{op}: expected {name} [K={k}, N], found {name} {tuple(w.shape)}")
    for name, (v, n) in (vectors or {}).items():
        if v is not None and v.shape != (n,):
            raise ValueError(f"{op}: expected {name} [{n}], found {name} {tuple(v.shape)}")
    for name, (r, n) in (rows or {}).items():
        if r.shape != (m, n):
            raise ValueError(f"{op}: expected {name} [M={m}, {n}], found {name} {tuple(r.shape)}")


def norm_linear(x, norm_weight, w, *, eps: float, fp32_multiply: bool = False):
    """rms_norm(x) @ w: x [M, K], norm_weight [K], w [K, N] -> [M, N] in x's dtype."""
    check_inputs("norm_linear", x, {"w": w}, {"norm_weight": (norm_weight, x.shape[1])})
    return project(rms_norm(x, norm_weight, eps, fp32_multiply), w)


def norm_swiglu(x, norm_weight, w_gate, w_up, *, eps: float, fp32_multiply: bool = False):
    """The gated MLP's first half: swiglu(xn @ w_gate, xn @ w_up), xn = rms_norm(x). x [M, K], w_gate / w_up [K, I]
    -> [M, I]. The two products are rounded to the dtype before the activation (what the MLP's `activation` gets)."""
    check_inputs("norm_swiglu", x, {"w_gate": w_gate, "w_up": w_up}, {"norm_weight": (norm_weight, x.shape[1])})
    if w_gate.shape != w_up.shape:
        raise ValueError(f"norm_swiglu: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    xn = rms_norm(x, norm_weight, eps, fp32_multiply)
    return swiglu(project(xn, w_gate), project(xn, w_up))


def check_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, head_dim: int, q_norm, k_norm):
    check_inputs("norm_qkv", x, {"w_q": w_q, "w_k": w_k, "w_v": w_v},
                 {"norm_weight": (norm_weight, x.shape[1]), "q_norm": (q_norm, head_dim),
                  "k_norm": (k_norm, head_dim)},
                 {"cos": (cos, head_dim // 2), "sin": (sin, head_dim // 2)})
    if head_dim % 2 or any(w.shape[1] % head_dim for w in (w_q, w_k, w_v)) or w_k.shape != w_v.shape:
        raise ValueError(f"norm_qkv: w_q [K, nh x hd] and w_k, w_v [K, nkv x hd] with an even head_dim={head_dim}; "
                         f"found {tuple(w_q.shape)}, {tuple(w_k.shape)}, {tuple(w_v.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("norm_qkv: q_norm and k_norm come together (both or neither)")


def norm_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, *, head_dim: int, eps: float, fp32_multiply: bool = False,
             q_norm=None, k_norm=None):
    """The attention's projections: xn = rms_norm(x); q = xn @ w_q, k = xn @ w_k, v = xn @ w_v; per head (hd wide)
    q and k get the optional q_norm / k_norm (Qwen3; same eps and multiply mode) and then half-split RoPE with the
    row's cos / sin. x [M, K]; w_q [K, nh x hd]; w_k, w_v [K, nkv x hd]; cos, sin [M, hd / 2] float32 (cast to
    x's dtype, as `apply_rope`) -> q [M, nh x hd], k, v [M, nkv x hd]."""
    check_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, head_dim, q_norm, k_norm)
    m = x.shape[0]
    xn = rms_norm(x, norm_weight, eps, fp32_multiply)
    heads = lambda w: project(xn, w).reshape(1, m, -1, head_dim)  # noqa: E731  [1, M, n, hd]
    q, k, v = heads(w_q), heads(w_k), heads(w_v)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, fp32_multiply), rms_norm(k, k_norm, eps, fp32_multiply)
    cos, sin = cos[None], sin[None]
    return apply_rope(q, cos, sin).reshape(m, -1), apply_rope(k, cos, sin).reshape(m, -1), v.reshape(m, -1)


def linear_residual(x, w, residual):
    """residual + x @ w: x [M, K], w [K, N], residual [M, N] -> [M, N]; the product is rounded to the dtype before
    the add (an o-projection or down-projection followed by the residual add)."""
    check_inputs("linear_residual", x, {"w": w}, rows={"residual": (residual, w.shape[1])})
    return residual + project(x, w)
