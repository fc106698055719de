"""XLA reference of attention by absolute position (the one grouped-query softmax with sinks), and of attention
over a KV cache indexed by absolute position (kv_pos = arange(S), kv_valid = arange(S) < kv_len)."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

__all__ = ["MASK_VALUE", "attention", "cache_attention", "check_inputs"]

MASK_VALUE = -1e30  # finite: a query with no visible key gets uniform weights instead of NaN


def attention(q, k, v, q_pos, kv_pos, *, scale: float, window: Optional[int] = None, sinks=None,
              kv_valid=None, mask=None):
    """Grouped-query attention with absolute-position masking (XLA reference path).

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T]; kv_pos [B, S] (or [S]).
    Visible: kv_pos <= q_pos (bottom-right causal by absolute position), kv_pos > q_pos - window,
    kv_valid [B, S]. An explicit `mask` [B, T, S] replaces all of these (drafter training layouts).
    sinks [nh]: one learned logit per head added to the softmax denominator (GPT-OSS).
    Returns [B, T, nh, hd] in q's dtype.
    """
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


def check_inputs(q, k, v, q_pos, kv_len, sinks):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"cache_attention: q must be [B, T, nh, hd] and k, v [B, S, nkv, hd]; found q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    b, t, nh, hd = q.shape
    if k.shape[0] != b or k.shape[3] != hd or nh % k.shape[2]:
        raise ValueError(f"cache_attention: k {k.shape} does not match q {q.shape} (batch, head_dim, nh % nkv == 0)")
    if tuple(q_pos.shape) != (b, t):
        raise ValueError(f"cache_attention: q_pos must have shape {(b, t)}, found {tuple(q_pos.shape)}")
    if kv_len is not None and tuple(jnp.shape(kv_len)) != (b,):
        raise ValueError(f"cache_attention: kv_len must have shape {(b,)}, found {tuple(jnp.shape(kv_len))}")
    if sinks is not None and tuple(sinks.shape) != (nh,):
        raise ValueError(f"cache_attention: sinks must have shape {(nh,)}, found {tuple(sinks.shape)}")


def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None):
    """q [B, T, nh, hd]; k, v [B, S, nkv, hd] (index = absolute position); q_pos [B, T]; kv_len [B] or None.
    Returns [B, T, nh, hd] in q's dtype."""
    check_inputs(q, k, v, q_pos, kv_len, sinks)
    s = k.shape[1]
    kv_pos = jnp.arange(s, dtype=jnp.int32)
    kv_valid = None if kv_len is None else kv_pos[None, :] < jnp.asarray(kv_len, jnp.int32)[:, None]
    return attention(q, k, v, q_pos, kv_pos, scale=scale, window=window, sinks=sinks, kv_valid=kv_valid)
