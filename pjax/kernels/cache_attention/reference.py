"""XLA reference of attention over a KV cache indexed by absolute position (kv_pos = arange(S), kv_valid = arange(S)
< kv_len): the one grouped-query softmax of `pjax.kernels.flash_attention.reference` under a position mask, or under
a draft tree's dense mask (`mask.TreeMask`: the queries are tree nodes at consecutive slots)."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from pjax.kernels.cache_attention.mask import TreeMask, check_window, tree_visible
from pjax.kernels.flash_attention import reference as flash_reference
from pjax.kernels.flash_attention.mask import position_mask

__all__ = ["attention", "cache_attention", "check_inputs", "tree_attention"]


def attention(q, k, v, q_pos, kv_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_valid=None):
    """Grouped-query attention by absolute position: q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T]; kv_pos
    [B, S] or [S]; kv_valid [B, S] or None; sinks [nh] or None. Visible: kv_pos <= q_pos (bottom-right causal by
    absolute position), kv_pos > q_pos - window, kv_valid. Returns [B, T, nh, hd] in q's dtype."""
    return flash_reference.attention(q, k, v, position_mask(q_pos, kv_pos, kv_valid), scale=scale, window=window,
                                     sinks=sinks)


def tree_attention(q, k, v, q_pos, tree: TreeMask, *, scale: float, window: Optional[int] = None, sinks=None,
                   kv_len=None):
    """Grouped-query attention over the cache under a tree mask (`mask.tree_visible`): one [T, S] score tensor per
    head, the one masked softmax. Shapes as `cache_attention`; tree.visible [B, T, M]. Returns [B, T, nh, hd] in q's
    dtype."""
    b, t, nh, hd = q.shape
    s, nkv = k.shape[1], k.shape[2]
    vis = tree_visible(q_pos, tree, s, window, kv_len)  # [B, T, S]
    qg = q.reshape(b, t, nkv, nh // nkv, hd)
    sc = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    (w,), _ = flash_reference.masked_softmax([(sc, vis[:, None, None])], sinks)
    out = jnp.einsum("bkgts,bskd->btkgd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh, hd).astype(q.dtype)


def check_inputs(q, k, v, q_pos, kv_len, sinks, tree=None, window=None):
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
    if tree is not None and (tuple(jnp.shape(tree.start)) != (b,) or jnp.ndim(tree.visible) != 3
                             or tuple(jnp.shape(tree.visible))[:2] != (b, t) or jnp.shape(tree.visible)[2] < t):
        raise ValueError(f"cache_attention: tree.start must have shape {(b,)} and tree.visible {(b, t)} + (M,) with "
                         f"M >= {t}, found {tuple(jnp.shape(tree.start))} and {tuple(jnp.shape(tree.visible))}")
    if tree is not None:
        check_window(tree, t, window)


def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    tree: Optional[TreeMask] = None):
    """q [B, T, nh, hd]; k, v [B, S, nkv, hd] (index = absolute position, tree slots aside); q_pos [B, T]; kv_len [B]
    or None; tree: a `TreeMask` or None. Returns [B, T, nh, hd] in q's dtype."""
    check_inputs(q, k, v, q_pos, kv_len, sinks, tree, window)
    if tree is not None:
        return tree_attention(q, k, v, q_pos, tree, scale=scale, window=window, sinks=sinks, kv_len=kv_len)
    s = k.shape[1]
    kv_pos = jnp.arange(s, dtype=jnp.int32)
    kv_valid = None if kv_len is None else kv_pos[None, :] < jnp.asarray(kv_len, jnp.int32)[:, None]
    return attention(q, k, v, q_pos, kv_pos, scale=scale, window=window, sinks=sinks, kv_valid=kv_valid)
