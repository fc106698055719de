"""The jnp cache write: a scatter that drops invalid tokens and positions outside the cache."""
from __future__ import annotations

import jax.numpy as jnp


def keep_mask(positions, valid, capacity: int):
    """[B, T] bool: tokens that are written (valid, 0 <= position < capacity)."""
    keep = (positions >= 0) & (positions < capacity)
    return keep if valid is None else keep & valid


def cache_write(k, v, k_new, v_new, positions, valid=None):
    """k, v [B, S, nkv, hd] with k_new / v_new [B, T, nkv, hd] (cast to the cache dtype) at positions [B, T];
    tokens where valid [B, T] is False, or whose position is outside [0, S), write nothing."""
    cap = k.shape[1]
    idx = jnp.where(keep_mask(positions, valid, cap), positions, cap)
    rows = jnp.broadcast_to(jnp.arange(idx.shape[0])[:, None], idx.shape)
    return (k.at[rows, idx].set(k_new.astype(k.dtype), mode="drop"),
            v.at[rows, idx].set(v_new.astype(v.dtype), mode="drop"))
