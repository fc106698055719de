"""Self-attention of one decoder layer: projections, q/k/v norms, RoPE, and attention under a mask description
(`pjax.kernels.flash_attention`): over the new tokens (by position, or a training layout), over a KV cache (the fused
cache-attention kernel), over the new tokens while writing them to a KV cache (the packed prefill: many prompts in one
row, each token's K/V to its own cache row), or over the earlier passes of a multi-pass forward (`StepKV`, the EAGLE-3
training-time test). Under a mesh the kernels run per shard (`pjax.models.per_shard`).

Shapes: B batch, T new tokens, S key/value length, P passes, H hidden, nh/nkv heads, hd head dim.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pjax.config import LayerSpec, ModelConfig
from pjax.kernels.cache_attention import TreeMask
from pjax.kernels.flash_attention import AttentionMask, position_mask
from pjax.models.cache import LayerKV
from pjax.models.layers import RMSNorm, apply_rope, linear, rms_norm, rope_tables
from pjax.models.per_shard import attention, cache_attention

__all__ = ["Attention", "StepKV", "init_step_kv"]


@dataclasses.dataclass(frozen=True)
class StepKV:
    """The K/V one layer computed in the passes so far of a multi-pass forward over the same rows (pass t's queries
    see pass 0's keys as context and the later passes' keys through the mask's chain part): k, v [B, P, S, nkv, hd]
    (pass t at [:, t]; passes not yet run are zeros), step int32 [] = the pass the next write fills. Passed to the
    layers like a KV cache and returned updated, so every layer's attention is a pure function of its inputs."""
    k: jax.Array
    v: jax.Array
    step: jax.Array

    def write(self, k_new, v_new) -> "StepKV":
        """k_new, v_new [B, S, nkv, hd] -> this pass's slot filled, step + 1."""
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), self.step, 1)  # noqa
        return StepKV(put(self.k, k_new), put(self.v, v_new), self.step + 1)


jax.tree_util.register_dataclass(StepKV, data_fields=["k", "v", "step"], meta_fields=[])


def init_step_kv(cfg: ModelConfig, batch: int, passes: int, seq_len: int, dtype=jnp.float32) -> list[StepKV]:
    """One empty StepKV per layer of `cfg`: zeros [batch, passes, seq_len, nkv, hd], step 0."""
    return [StepKV(jnp.zeros((batch, passes, seq_len, s.num_kv_heads, s.head_dim), dtype),
                   jnp.zeros((batch, passes, seq_len, s.num_kv_heads, s.head_dim), dtype), jnp.zeros((), jnp.int32))
            for s in cfg.layers]


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

    def __call__(self, x, positions, kv=None, *, valid=None, mask: Optional[AttentionMask] = None, cache_rows=None,
                 slots=None, tree: Optional[TreeMask] = None, implementation: str = "auto"):
        """Returns (attention output [B, T, H], updated kv).

        implementation: the kernel switch ("xla" | "pallas" | "auto", `pjax.kernels`).
        kv None: the queries attend over the new tokens under `mask`, or by position (hiding keys where `valid` is
        False) when mask is None. kv a LayerKV cache: the new K/V are written at their absolute positions (rows where
        `valid` is False write nothing) of the cache rows `cache_rows` [B, T] (None: their own rows); without a mask
        the queries attend over the whole cache by position, with one (the packed prefill: a document mask over
        prompts packed in one row) over the new tokens under it, their K/V as the cache stores them. A draft tree's
        verification: slots [B, T] int32, the cache indices the new K/V go to (None: their positions), and tree a
        `TreeMask` over those slots (each query sees the committed cache and its ancestors). kv a StepKV:
        this pass's K/V join the earlier passes' and the queries attend under `mask` (context: pass 0; chain: all
        passes).
        """
        q, k, v = self.qkv(x, positions)
        out, kv = self.attend(q, k, v, positions, kv, valid=valid, mask=mask, cache_rows=cache_rows, slots=slots,
                              tree=tree, implementation=implementation)
        return self.o_proj(out), kv

    def attend(self, q, k, v, positions, kv=None, *, valid=None, mask: Optional[AttentionMask] = None,
               cache_rows=None, slots=None, tree: Optional[TreeMask] = None, implementation: str = "auto"):
        """The attention of `__call__` from projected q [B, T, nh, hd], k, v [B, T, nkv, hd]: (out [B, T, nh x hd]
        before the o-projection, updated kv)."""
        sinks = None if self.sinks is None else self.sinks[...]
        kw = dict(scale=self.scale, window=self.window, sinks=sinks, implementation=implementation)
        if isinstance(kv, LayerKV):
            kv = kv.write(k, v, positions, valid, cache_rows, slots)
            if mask is None:
                out = cache_attention(q, kv.k, kv.v, positions, tree=tree, **kw)
            else:  # what a later query reading the cache would see: K/V rounded to the cache's dtype
                stored = lambda a: a.astype(kv.k.dtype).astype(a.dtype)  # noqa: E731
                out = _attend_new(q, stored(k), stored(v), mask, **kw)
        elif cache_rows is not None or slots is not None or tree is not None:
            raise ValueError("Attention: cache_rows / slots / tree need a LayerKV cache")
        elif isinstance(kv, StepKV):
            if mask is None:
                raise ValueError("Attention: a StepKV forward needs its mask (pjax.train.masks.ttt_mask)")
            kv = kv.write(k, v)
            b, p, s = kv.k.shape[:3]
            flat = lambda x: x.reshape((b, p * s) + x.shape[3:])  # noqa: E731
            out = attention(q, kv.k[:, 0], kv.v[:, 0], mask, chain_k=flat(kv.k), chain_v=flat(kv.v), **kw)
        elif kv is None:
            out = _attend_new(q, k, v, position_mask(positions, positions, valid) if mask is None else mask, **kw)
        else:
            raise TypeError(f"Attention: kv must be None, a LayerKV or a StepKV, found {type(kv).__name__}")
        b, t = q.shape[:2]
        return out.reshape(b, t, -1), kv


def _attend_new(q, k, v, mask: AttentionMask, **kw):
    """Queries q [B, T, nh, hd] over the new tokens' own k, v [B, T, nkv, hd] under `mask`: its first num_context
    tokens are the context keys (all when None), all T the chain keys when the mask has a chain part."""
    n = k.shape[1] if mask.num_context is None else mask.num_context
    chain = dict(chain_k=k, chain_v=v) if mask.has_chain else {}
    return attention(q, k[:, :n], v[:, :n], mask, **chain, **kw)
