"""Explicit KV caches (pytrees). Cache index = absolute token position; no paging."""
from __future__ import annotations

import jax.numpy as jnp

from pjax.config import ModelConfig
from pjax.nn import LayerKV


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> list[LayerKV]:
    """One LayerKV per layer, k/v zeros [batch, capacity, nkv, hd] (geometry may differ per layer)."""
    return [LayerKV(jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype),
                    jnp.zeros((batch, capacity, s.num_kv_heads, s.head_dim), dtype)) for s in cfg.layers]


def cache_capacity(cache: list[LayerKV]) -> int:
    return cache[0].k.shape[1]
