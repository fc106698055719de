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

    def write(self, k_new, v_new, positions, valid=None, rows=None, slots=None):
        """Scatter k_new/v_new [R, T, nkv, hd] at `positions` [R, T] of the cache rows `rows` [R, T] int32 (None: the
        new tokens' own rows, R = B; a packed prefill gives each token its prompt's row), or at cache indices `slots`
        [R, T] int32 when given (a draft tree's nodes: consecutive slots, positions by depth); tokens where `valid`
        [R, T] is False, or whose index lies outside the cache, are dropped."""
        cap = self.k.shape[1]
        at = positions if slots is None else slots
        idx = at if valid is None else jnp.where(valid, at, cap)
        idx = jnp.where((idx < 0) | (idx >= cap), cap, idx)
        if rows is None:
            rows = jnp.broadcast_to(jnp.arange(idx.shape[0])[:, None], idx.shape)
        k = self.k.at[rows, idx].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, idx].set(v_new.astype(self.v.dtype), mode="drop")
        return LayerKV(k, v)


jax.tree_util.register_pytree_node(LayerKV, lambda c: ((c.k, c.v), None), lambda _, kv: LayerKV(*kv))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> list[LayerKV]:
    """One LayerKV per layer, k/v zeros [batch, capacity, nkv, hd] (geometry may differ per layer)."""
    return [LayerKV(jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype),
                    jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype)) for s in cfg.layers]
