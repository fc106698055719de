"""XLA reference of attention over a KV cache indexed by absolute position (kv_pos = arange(S), kv_valid = arange(S)
< kv_len): the one grouped-query softmax of `pjax.kernels.flash_attention.reference` under a position mask."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from pjax.kernels.flash_attention import reference as flash_reference
from pjax.kernels.flash_attention.mask import position_mask

__all__ = ["attention", "cache_attention", "check_inputs"]


def attention(q, k, v, q_pos, kv_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_valid=None):
    """Grouped-query attention by absolute position: q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T]; kv_pos
    [B, S] or [S]; kv_valid [B, S] or None; sinks [nh] or None. Visible: kv_pos <= q_pos (bottom-right causal by
    absolute position), kv_pos > q_pos - window, kv_valid. Returns [B, T, nh, hd] in q's dtype."""
    return flash_reference.attention(q, k, v, position_mask(q_pos, kv_pos, kv_valid), scale=scale, window=window,
                                     sinks=sinks)


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
