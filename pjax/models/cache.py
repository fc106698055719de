"""Explicit KV caches (pytrees). Cache index = absolute token position; no paging."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pjax.config import ModelConfig
from pjax.kernels.cache_write import cache_write

__all__ = ["LayerKV", "init_cache"]


class LayerKV:
    """K/V cache of one layer: k, v [B, S_max, nkv, hd]; cache index = absolute position."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def write(self, k_new, v_new, positions, valid=None, *, implementation: str = "xla"):
        """Write k_new/v_new [B, T, nkv, hd] at `positions` [B, T]; invalid tokens and positions outside the cache
        are dropped (`pjax.kernels.cache_write`, under the kernel switch `implementation`)."""
        return LayerKV(*cache_write(self.k, self.v, k_new, v_new, positions, valid, implementation=implementation))


jax.tree_util.register_pytree_node(LayerKV, lambda c: ((c.k, c.v), None), lambda _, kv: LayerKV(*kv))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> list[LayerKV]:
    """One LayerKV per layer, k/v zeros [batch, capacity, nkv, hd] (geometry may differ per layer)."""
    return [LayerKV(jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype),
                    jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype)) for s in cfg.layers]
