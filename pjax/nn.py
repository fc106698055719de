"""Shared building blocks: norms, RoPE, attention (positional masks, windows, sinks), MLPs, MoE.

Everything here is a Flax NNX module written in tree style (no shared submodules, no mutable state) or
a pure function. Shapes: B batch, T new tokens, S key/value length, H hidden, nh/nkv heads, hd head dim.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec

MASK_VALUE = -1e30  # finite: a query with no visible key gets uniform weights instead of NaN


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


def apply_rope(x, cos, sin):
    """Half-split (rotate_half) RoPE. x [B, T, n, hd]; cos/sin [B, T, hd/2]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q, k, v, q_pos, kv_pos, *, scale: float, window: Optional[int] = None, sinks=None,
              kv_valid=None, mask=None):
    """Grouped-query attention with absolute-position masking (XLA reference path).

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T]; kv_pos [B, S] (or [S]).
    Visible: kv_pos <= q_pos (bottom-right causal by absolute position), kv_pos > q_pos - window,
    kv_valid [B, S]. An explicit `mask` [B, T, S] replaces all of these (drafter training layouts).
    sinks [nh]: one learned logit per head added to the softmax denominator (GPT-OSS).
    Returns [B, T, nh, hd] in q's dtype.
    A structured `mask` (an object with an `attend(q, k, v, *, scale, window, sinks)` method, e.g. the
    memory-bounded training masks of `pjax.train.attention`) computes the attention itself.
    """
    if mask is not None and hasattr(mask, "attend"):
        return mask.attend(q, k, v, scale=scale, window=window, sinks=sinks)
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    qg = q.reshape(b, t, nkv, g, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if mask is None:
        kv_pos = jnp.broadcast_to(kv_pos, (b, k.shape[1]))
        qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
        mask = kp <= qp
        if window is not None:
            mask &= kp > qp - window
        if kv_valid is not None:
            mask &= kv_valid[:, None, :]
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sk = sinks.astype(jnp.float32).reshape(1, nkv, g, 1, 1)
        m = jnp.maximum(m, sk)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sk - m)
    else:
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
    p = (p / denom).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh, hd).astype(q.dtype)


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters) whose one-row products stay matrix products.

    XLA on GPU rewrites the product of a single activation row with a small weight (< 10M elements: the k/v
    projections of a batch-1 decode step) into a multiply and a column reduction, which streams the weight several
    times slower than a GEMM. A single row x [..., din] is padded to two (the zero row is dropped): the H200 batch-1
    Llama-3.1-8B decode step went from 5.42 to 4.37 ms (docs/benchmarks.md section 1).
    """

    def __call__(self, inputs, out_sharding=None):
        if math.prod(inputs.shape[:-1]) != 1:
            return super().__call__(inputs, out_sharding)
        y = super().__call__(jnp.pad(inputs.reshape(1, -1), ((0, 1), (0, 0))), out_sharding)
        return y[:1].reshape(*inputs.shape[:-1], -1)


def _linear(din, dout, bias, dtype, rngs):
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    """Self-attention of one layer. `q_in` may differ from H (EAGLE-3 fused first layer takes 2H)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, q_in: Optional[int] = None, dtype, rngs):
        h = cfg.hidden_size
        din = q_in or h
        hd, nkv = spec.head_dim, spec.num_kv_heads
        self.q_proj = _linear(din, cfg.num_heads * hd, cfg.attention_bias, dtype, rngs)
        self.k_proj = _linear(din, nkv * hd, cfg.attention_bias, dtype, rngs)
        self.v_proj = None if spec.k_eq_v else _linear(din, nkv * hd, cfg.attention_bias, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * hd, h, cfg.attention_bias, dtype, rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_fp32_multiply, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_fp32_multiply, dtype=dtype) if cfg.qk_norm else None
        self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), dtype)) if cfg.sinks else None
        self.num_heads, self.head_dim, self.num_kv_heads = cfg.num_heads, hd, nkv
        self.rope, self.window = spec.rope, spec.sliding_window
        self.v_norm, self.eps = cfg.v_norm, cfg.rms_norm_eps
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else hd ** -0.5

    def qkv(self, x, positions):
        """x [B, T, din] -> q [B, T, nh, hd], k, v [B, T, nkv, hd] with norms and RoPE applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.v_norm:
            v = rms_norm(v, None, self.eps)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_tables(self.rope, self.head_dim, positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x, positions, kv: "LayerKV", *, valid=None, mask=None):
        """Returns (attention output [B, T, H], updated LayerKV or None).

        With a cache (`kv` not None) the new K/V are written at their absolute positions (rows where
        `valid` is False write nothing) and queries attend over the whole cache by position. Without
        a cache they attend over the new tokens only, hiding keys where `valid` is False.
        """
        q, k, v = self.qkv(x, positions)
        sinks = None if self.sinks is None else self.sinks[...]
        if kv is None:
            out = attention(q, k, v, positions, positions, scale=self.scale, window=self.window, sinks=sinks,
                            kv_valid=valid, mask=mask)
        else:
            kv = kv.write(k, v, positions, valid)
            if mask is None:  # GPU: fused cache-attention kernel where measured faster; else this XLA path
                from pjax.kernels.cache_attention import cache_attention
                out = cache_attention(q, kv.k, kv.v, positions, scale=self.scale, window=self.window, sinks=sinks,
                                      implementation="auto")
            else:
                out = attention(q, kv.k, kv.v, positions, jnp.arange(kv.k.shape[1], dtype=jnp.int32),
                                scale=self.scale, window=self.window, sinks=sinks, mask=mask)
        b, t = x.shape[:2]
        return self.o_proj(out.reshape(b, t, -1)), kv


class LayerKV:
    """K/V cache of one layer: k, v [B, S_max, nkv, hd]; cache index = absolute position."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def write(self, k_new, v_new, positions, valid=None):
        """Scatter k_new/v_new [B, T, nkv, hd] at `positions` [B, T]; invalid rows are dropped."""
        cap = self.k.shape[1]
        idx = positions if valid is None else jnp.where(valid, positions, cap)
        idx = jnp.where((idx < 0) | (idx >= cap), cap, idx)
        rows = jnp.broadcast_to(jnp.arange(idx.shape[0])[:, None], idx.shape)
        k = self.k.at[rows, idx].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, idx].set(v_new.astype(self.v.dtype), mode="drop")
        return LayerKV(k, v)


jax.tree_util.register_pytree_node(LayerKV, lambda c: ((c.k, c.v), None), lambda _, kv: LayerKV(*kv))


def activation(kind: str, gate, up, cfg: ModelConfig):
    if kind == "silu":
        return jax.nn.silu(gate) * up
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
        self.gate_proj = _linear(hidden, inter, cfg.mlp_bias, dtype, rngs)
        self.up_proj = _linear(hidden, inter, cfg.mlp_bias, dtype, rngs)
        self.down_proj = _linear(inter, hidden, cfg.mlp_bias, dtype, rngs)
        self.cfg = cfg

    def __call__(self, x):
        return self.down_proj(activation(self.cfg.mlp_act, self.gate_proj(x), self.up_proj(x), self.cfg))


# Token-expert pairs up to this count, and up to twice the expert count, use `expert_matmul` (each selected expert read
# once); more (prefill, training) sort the pairs by expert for a grouped matmul, which reads every expert. H200, MoE
# layer (docs/benchmarks.md section 2): 128 experts, top-8: 64 / 96 / 128 pairs 159 / 273 / 313 us vs 349 / 383 / 403;
# 32 experts, top-4: 32 / 64 pairs 272 / 363 vs 409 / 422 us, but 128 pairs (all experts selected) 492 vs 455 us
# (the boundary between 2x and 4x the expert count was not measured more finely).
MOE_FEW_PAIRS = 128


class MoE(nnx.Module):
    """Top-k mixture of experts. Expert weights are stacked: gate_up [E, H, 2I] (gate half, then up
    half), down [E, I, H]; optional biases. Router: qwen3 (softmax -> top-k -> renormalise) or
    gpt_oss (logits + bias -> top-k -> softmax over the k)."""

    def __init__(self, cfg: ModelConfig, spec: MoeSpec, *, dtype, rngs):
        h, e, i = cfg.hidden_size, spec.num_experts, spec.intermediate_size
        self.router = _linear(h, e, spec.router_bias, dtype, rngs)
        init = nnx.initializers.normal(0.02)
        self.gate_up = nnx.Param(init(rngs.params(), (e, h, 2 * i), dtype))
        self.down = nnx.Param(init(rngs.params(), (e, i, h), dtype))
        self.gate_up_bias = nnx.Param(jnp.zeros((e, 2 * i), dtype)) if spec.expert_bias else None
        self.down_bias = nnx.Param(jnp.zeros((e, h), dtype)) if spec.expert_bias else None
        self.spec, self.cfg = spec, cfg

    def route(self, x):
        """x [N, H] -> (weights [N, k] in x.dtype, expert ids [N, k] int32)."""
        logits = self.router(x)
        if self.spec.router == "topk_softmax":
            top, idx = jax.lax.top_k(logits, self.spec.top_k)
            w = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
        else:
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            w, idx = jax.lax.top_k(probs, self.spec.top_k)
            if self.spec.norm_topk_prob:
                w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w.astype(x.dtype), idx

    def _expert_out(self, e_ids, x_rows, matmul):
        """Shared expert math on gathered rows: activation and down projection with biases."""
        inter = self.spec.intermediate_size
        gu = matmul(x_rows, self.gate_up[...])
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[...][e_ids]
        a = activation(self.cfg.mlp_act, gu[..., :inter], gu[..., inter:], self.cfg)
        out = matmul(a, self.down[...], second=True)
        if self.down_bias is not None:
            out = out + self.down_bias[...][e_ids]
        return out

    def __call__(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k = x.shape[0], self.spec.top_k
        w, idx = self.route(x)
        if n * k <= min(MOE_FEW_PAIRS, 2 * self.spec.num_experts):  # decode / verify: selected experts, once each
            from pjax.kernels.expert_matmul import expert_matmul

            def matmul(a, wts, second=False):  # pairs (token, j) in row-major order; token rows feed k pairs
                rows = a.reshape(n * k, -1) if second else a
                return expert_matmul(rows, idx.reshape(-1), wts, repeat=1 if second else k).reshape(n, k, -1)
            out = self._expert_out(idx, x, matmul)  # [N, k, H]
            y = jnp.einsum("nk,nkh->nh", w.astype(jnp.float32), out.astype(jnp.float32))
        else:  # prefill / training: sort token-expert pairs by expert, grouped matmul
            flat = idx.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            e_sorted = flat[order]
            rows = x[order // k]
            sizes = jnp.bincount(flat, length=self.spec.num_experts).astype(jnp.int32)

            def matmul(a, wts, second=False):
                return jax.lax.ragged_dot(a, wts, sizes, preferred_element_type=jnp.float32).astype(a.dtype)
            out_sorted = self._expert_out(e_sorted, rows, matmul)  # [N*k, H]
            out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(n, k, -1)
            y = jnp.einsum("nk,nkh->nh", w.astype(jnp.float32), out.astype(jnp.float32))
        return y.astype(x.dtype).reshape(shape)
