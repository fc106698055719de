"""Self-attention of one decoder layer: projections, q/k/v norms, RoPE, and attention by absolute position, over
the new tokens or over a KV cache (the fused cache-attention kernel where the kernel switch allows it).

Shapes: B batch, T new tokens, S key/value length, H hidden, nh/nkv heads, hd head dim.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

from pjax.config import LayerSpec, ModelConfig
from pjax.kernels.cache_attention import cache_attention
from pjax.kernels.cache_attention.reference import attention
from pjax.models.cache import LayerKV
from pjax.models.layers import RMSNorm, apply_rope, linear, rms_norm, rope_tables

__all__ = ["Attention", "attend"]


def attend(q, k, v, q_pos, kv_pos, *, scale: float, window=None, sinks=None, kv_valid=None, mask=None):
    """Attention by absolute position (`pjax.kernels.cache_attention.reference.attention`), or through a
    structured training mask (an object with `attend(q, k, v, *, scale, window, sinks)`)."""
    if mask is not None and hasattr(mask, "attend"):
        return mask.attend(q, k, v, scale=scale, window=window, sinks=sinks)
    return attention(q, k, v, q_pos, kv_pos, scale=scale, window=window, sinks=sinks, kv_valid=kv_valid, mask=mask)


class Attention(nnx.Module):
    """Self-attention of one layer. `q_in` may differ from H (EAGLE-3 fused first layer takes 2H)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, q_in: Optional[int] = None, dtype, rngs):
        h = cfg.hidden_size
        din = q_in or h
        hd, nkv = spec.head_dim, spec.num_kv_heads
        self.q_proj = linear(din, cfg.num_heads * hd, cfg.attention_bias, dtype, rngs)
        self.k_proj = linear(din, nkv * hd, cfg.attention_bias, dtype, rngs)
        self.v_proj = None if spec.k_eq_v else linear(din, nkv * hd, cfg.attention_bias, dtype, rngs)
        self.o_proj = linear(cfg.num_heads * hd, h, cfg.attention_bias, dtype, rngs)
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

    def __call__(self, x, positions, kv: Optional[LayerKV], *, valid=None, mask=None, implementation: str = "auto"):
        """Returns (attention output [B, T, H], updated LayerKV or None).

        implementation: the kernel switch ("xla" | "pallas" | "auto", `pjax.kernels`).
        With a cache (`kv` not None) the new K/V are written at their absolute positions (rows where
        `valid` is False write nothing) and queries attend over the whole cache by position. Without
        a cache they attend over the new tokens only, hiding keys where `valid` is False.
        """
        q, k, v = self.qkv(x, positions)
        sinks = None if self.sinks is None else self.sinks[...]
        if kv is None:
            out = attend(q, k, v, positions, positions, scale=self.scale, window=self.window, sinks=sinks,
                            kv_valid=valid, mask=mask)
        else:
            kv = kv.write(k, v, positions, valid)
            if mask is None:  # the fused cache-attention kernel, as the kernel switch says
                out = cache_attention(q, kv.k, kv.v, positions, scale=self.scale, window=self.window, sinks=sinks,
                                      implementation=implementation)
            else:
                out = attend(q, kv.k, kv.v, positions, jnp.arange(kv.k.shape[1], dtype=jnp.int32),
                                scale=self.scale, window=self.window, sinks=sinks, mask=mask)
        b, t = x.shape[:2]
        return self.o_proj(out.reshape(b, t, -1)), kv


