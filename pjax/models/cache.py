"""Explicit KV caches (pytrees). Cache index = absolute token position; no paging."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pjax.config import ModelConfig

__all__ = ["LayerKV", "init_cache"]


class LayerKV:
    """K/V cache of one layer: k, v [B, S_max, nkv, hd]; cache index = absolute position."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def write(self, k_new, v_new, positions, valid=None):
        """Scatter k_new/v_new [B, T, nkv, hd] at `positions` [B, T]; invalid rows and positions outside the cache
        are dropped."""
        cap = self.k.shape[1]
        keep = (positions >= 0) & (positions < cap)
        keep = keep if valid is None else keep & valid
        if positions.shape == (1, 1):
            return LayerKV(_put_one(self.k, k_new, positions[0, 0], keep[0, 0]),
                           _put_one(self.v, v_new, positions[0, 0], keep[0, 0]))
        idx = jnp.where(keep, positions, cap)
        rows = jnp.broadcast_to(jnp.arange(idx.shape[0])[:, None], idx.shape)
        k = self.k.at[rows, idx].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, idx].set(v_new.astype(self.v.dtype), mode="drop")
        return LayerKV(k, v)


def _put_one(buf, new, pos, keep):
    """buf [1, S, nkv, hd] with new [1, 1, nkv, hd] at position pos when keep. The batch-1 decode step's write: a
    slice update that reads and writes the same slot, which XLA runs in place in one kernel together with new's
    producer (RoPE); the general scatter's drop becomes a select before the update there, two kernels more per layer
    on the GPU."""
    at = jnp.clip(pos, 0, buf.shape[1] - 1)
    old = jax.lax.dynamic_slice_in_dim(buf, at, 1, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, new.astype(buf.dtype), old), at, axis=1)


jax.tree_util.register_pytree_node(LayerKV, lambda c: ((c.k, c.v), None), lambda _, kv: LayerKV(*kv))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> list[LayerKV]:
    """One LayerKV per layer, k/v zeros [batch, capacity, nkv, hd] (geometry may differ per layer)."""
    return [LayerKV(jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype),
                    jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype)) for s in cfg.layers]
