"""Shared building blocks of targets and drafters: RMSNorm, RoPE, linear layers, gated MLPs.

NNX modules in tree style (no shared submodules, no mutable state) and pure functions.
Shapes: B batch, T new tokens, H hidden, hd head dim.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pjax.config import ModelConfig, RopeSpec

__all__ = ["Linear", "MLP", "RMSNorm", "activation", "apply_rope", "head_logits", "linear", "rms_norm", "rope_tables",
           "softcap"]


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


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, fp32_multiply: bool = False, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.fp32_multiply = fp32_multiply

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.fp32_multiply)


def rope_tables(rope: RopeSpec, head_dim: int, positions):
    """cos, sin [B, T, hd/2] float32 (already multiplied by the rope attention factor)."""
    inv_freq, scale = rope.inv_freq(head_dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters) whose one-row products stay matrix products.

    XLA on GPU rewrites the product of a single activation row with a small weight (< 10M elements: the k/v
    projections of a batch-1 decode step) into a multiply and a column reduction, which streams the weight several
    times slower than a GEMM. A single row x [..., din] is padded to two (the zero row is dropped): the H200 batch-1
    Llama-3.1-8B decode step went from 5.42 to 4.37 ms (docs/performance.md).
    """

    def __call__(self, inputs, out_sharding=None):
        if math.prod(inputs.shape[:-1]) != 1:
            return super().__call__(inputs, out_sharding)
        y = super().__call__(jnp.pad(inputs.reshape(1, -1), ((0, 1), (0, 0))), out_sharding)
        return y[:1].reshape(*inputs.shape[:-1], -1)


def linear(din, dout, bias, dtype, rngs) -> Linear:
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


def softcap(x, cap: Optional[float]):
    """cap * tanh(x / cap): logit soft-capping (Gemma, GPT-OSS style configs); x itself when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


@jax.custom_vjp
def _f32_logits(hidden, w):
    return jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)


def _f32_logits_fwd(hidden, w):
    return _f32_logits(hidden, w), (hidden, w)


def _f32_logits_bwd(res, g):
    """The float32 cotangent enters both products in the operands' dtype (bf16 tensor cores for bf16 weights; a
    mixed f32 x bf16 product would run in float32), accumulating in float32."""
    hidden, w = res
    g = g.astype(hidden.dtype)
    dh = jnp.einsum("...v,hv->...h", g, w, preferred_element_type=jnp.float32).astype(hidden.dtype)
    dw = jnp.einsum("...h,...v->hv", hidden, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


_f32_logits.defvjp(_f32_logits_fwd, _f32_logits_bwd)


def head_logits(hidden, w, cap: Optional[float] = None):
    """An LM head: hidden [..., H] @ w [H, V] -> float32 logits [..., V], soft-capped by `cap`. Differentiable: the
    backward products run in hidden's dtype with float32 accumulation."""
    return softcap(_f32_logits(hidden, w), cap)


def activation(kind: str, gate, up, cfg: ModelConfig):
    if kind == "silu":
        return swiglu(gate, up)
    if kind == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    if kind == "gptoss":
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))
    raise ValueError(f"unknown activation {kind!r}")


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, hidden: int, inter: int, *, dtype, rngs):
        self.gate_proj = linear(hidden, inter, cfg.mlp_bias, dtype, rngs)
        self.up_proj = linear(hidden, inter, cfg.mlp_bias, dtype, rngs)
        self.down_proj = linear(inter, hidden, cfg.mlp_bias, dtype, rngs)
        self.cfg = cfg

    def __call__(self, x):
        return self.down_proj(activation(self.cfg.mlp_act, self.gate_proj(x), self.up_proj(x), self.cfg))
