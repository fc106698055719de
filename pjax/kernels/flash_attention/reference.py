"""The one grouped-query masked softmax with sinks (`masked_softmax`) and the jnp attention built on it
(`attention`): every attention of the library (inference by position, cache attention, document-causal target
passes, the drafter's training layouts) computes its weights here or, in a fused kernel, checks against it.

Numerics: float32 scores; a masked score is MASK_VALUE (finite), so a query with no visible key gets uniform
weights over every key instead of NaN; sinks (one logit per head, GPT-OSS) join the softmax denominator only.
Memory: queries are processed in chunks of at most DEFAULT_CHUNK_ELEMENTS elements of float32 scores (batch x heads x
chunk x keys) and gathered chain keys, each chunk rematerialised in the backward pass, so no [T, S] score tensor of
all heads is ever whole. A mask with a `span` (documents of at most span tokens) scores each chunk of queries against
the band of keys it can see only (chunk + span - 1 keys instead of S): packed rows of many short documents cost
T x (chunk + span) scores instead of T x S.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pjax.kernels.flash_attention.chunking import chunk_size, chunked_map
from pjax.kernels.flash_attention.mask import AttentionMask, bounds_visible, query_bounds
from pjax.kernels.rows import take_rows

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "MASK_VALUE", "attention", "chain_partial", "check_inputs", "check_qkv",
           "masked_softmax", "merge_partials"]

MASK_VALUE = -1e30  # finite: a query with no visible key gets uniform weights instead of NaN
DEFAULT_CHUNK_ELEMENTS = 1 << 28  # scores (float32) and gathered chain keys of one query chunk: about 1 GiB
MIN_BAND_CHUNK = 64  # query rows per chunk at least, when a mask's span bands the keys


def masked_softmax(parts, sinks=None):
    """The one grouped-query softmax. parts: [(scores float32 [B, nkv, g, T, K_i], visible bool broadcastable to
    it), ...], one softmax over the keys of all parts together; sinks [nh] (nh = nkv * g) or None.
    Returns ([weights float32 like each part's scores], lse float32 [B, nkv, g, T, 1])."""
    scores = [jnp.where(vis, s, MASK_VALUE) for s, vis in parts]
    m = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    if sinks is not None:
        nkv, g = scores[0].shape[1:3]
        sk = sinks.astype(jnp.float32).reshape(1, nkv, g, 1, 1)
        m = jnp.maximum(m, sk)
    p = [jnp.exp(s - m) for s in scores]
    den = functools.reduce(jnp.add, [jnp.sum(x, axis=-1, keepdims=True) for x in p])
    if sinks is not None:
        den = den + jnp.exp(sk - m)
    return [x / den for x in p], m + jnp.log(den)


def merge_partials(parts, sinks=None):
    """Combine attention over disjoint key sets: parts [(o float32 [B, T, nh, hd], lse float32 [B, T, nh]), ...]
    (each normalised over its own keys) and sinks [nh] -> float32 [B, T, nh, hd], the softmax over all of them."""
    lses = [lse for _, lse in parts]
    m = functools.reduce(jnp.maximum, lses)
    if sinks is not None:
        sk = sinks.astype(jnp.float32)
        m = jnp.maximum(m, sk)
    w = [jnp.exp(lse - m) for lse in lses]
    den = functools.reduce(jnp.add, w)
    if sinks is not None:
        den = den + jnp.exp(sk - m)
    return functools.reduce(jnp.add, [o * (wi / den)[..., None] for (o, _), wi in zip(parts, w)])


def check_qkv(q, k, v, op: str):
    """q [B, T, nh, hd] and k, v [B, S, nkv, hd] with nkv dividing nh, or an error naming the op and the shapes."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"{op}: q must be [B, T, nh, hd] and k, v [B, S, nkv, hd]; found q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: k {k.shape} does not match q {q.shape} (batch, head_dim, nh % nkv == 0)")


def check_inputs(q, k, v, mask: AttentionMask, sinks=None, chain_k=None, chain_v=None, op: str = "attention"):
    """Shape checks with errors that name the tensor and what was expected."""
    check_qkv(q, k, v, op)
    b, t, nh, hd = q.shape
    bm = mask.q_pos.shape[0]
    if mask.q_pos.ndim != 2 or mask.q_pos.shape[1] != t or bm not in (1, b):
        raise ValueError(f"{op}: mask.q_pos must be [{b} or 1, {t}], found {tuple(mask.q_pos.shape)}")
    for name in ("q_start", "q_offset"):
        x = getattr(mask, name)
        if x is not None and tuple(x.shape) != tuple(mask.q_pos.shape):
            raise ValueError(f"{op}: mask.{name} must have q_pos's shape {tuple(mask.q_pos.shape)}, found "
                             f"{tuple(x.shape)}")
    for name in ("kv_pos", "kv_valid"):
        x = getattr(mask, name)
        if x is not None and (x.ndim != 2 or x.shape[0] not in (1, b) or x.shape[1] != k.shape[1]):
            raise ValueError(f"{op}: mask.{name} must be [{b} or 1, {k.shape[1]}] (one per context key), found "
                             f"{tuple(x.shape)}")
    if mask.has_chain:
        if chain_k is None or chain_v is None or chain_k.shape != chain_v.shape:
            raise ValueError(f"{op}: the mask has a chain part but chain_k / chain_v are missing or differ")
        if chain_k.shape[0] != b or chain_k.shape[2:] != k.shape[2:]:
            raise ValueError(f"{op}: chain_k {chain_k.shape} must be [{b}, M, {k.shape[2]}, {hd}]")
        want = (mask.q_pos.shape[0], t)
        if tuple(mask.chain_index.shape[:2]) != want or mask.chain_valid.shape != mask.chain_index.shape:
            raise ValueError(f"{op}: mask.chain_index / chain_valid must be [{want[0]}, {t}, E], found "
                             f"{tuple(mask.chain_index.shape)} / {tuple(mask.chain_valid.shape)}")
    if sinks is not None and tuple(sinks.shape) != (nh,):
        raise ValueError(f"{op}: sinks must have shape {(nh,)}, found {tuple(sinks.shape)}")


def _rows(x, b):
    """[Bm, ...] -> [b, ...] (a mask shared by every row is broadcast)."""
    return jnp.broadcast_to(x, (b,) + x.shape[1:])


def _partial(q, k, v, lo, hi, mask: AttentionMask, chain_k, chain_v, *, scale, sinks, context: bool):
    """(o float32 [B, T, nh, hd], lse float32 [B, T, nh]): softmax over the context keys (if `context`) and the
    chain keys (if the mask has them), query-chunked; with a mask's span, each chunk over its band of keys (a query
    that sees no key then averages its band)."""
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    s = k.shape[1]
    e = mask.chain_index.shape[-1] if mask.has_chain else 0
    per_query = b * (nh * ((s if context else 0) + e) + 2 * e * nkv * hd)  # scores + gathered chain keys / values
    c = chunk_size(t, per_query, DEFAULT_CHUNK_ELEMENTS, mask.chunk)
    band = None  # keys per query chunk when the span bands them
    if context and mask.span is not None and mask.keys_by_position:
        c = min(c, max(mask.span, MIN_BAND_CHUNK))
        band = c + mask.span - 1 if c + mask.span - 1 < s else None
    xs = dict(q=jnp.moveaxis(q, 1, 0))  # every per-query array with the queries on axis 0
    if context:
        xs.update(lo=jnp.moveaxis(lo, 1, 0), hi=jnp.moveaxis(hi, 1, 0))
    if band is not None:
        xs.update(i=jnp.arange(t, dtype=jnp.int32))
    if mask.has_chain:
        xs.update(ci=jnp.moveaxis(_rows(mask.chain_index, b), 1, 0), cv=jnp.moveaxis(mask.chain_valid, 1, 0))

    def block(x):
        c = x["q"].shape[0]
        qg = jnp.moveaxis(x["q"], 0, 1).reshape(b, c, nkv, g, hd)
        parts, values = [], []
        if context:
            kc, vc, kv_pos, n = k, v, mask.kv_pos, s
            if band is not None:  # the keys (i0 - span, i0 + c) of the chunk's queries i0..i0 + c - 1
                start = jnp.clip(x["i"][0] - mask.span + 1, 0, s - band)
                kc, vc = (jax.lax.dynamic_slice_in_dim(a, start, band, axis=1) for a in (k, v))
                kv_pos, n = (start + jnp.arange(band, dtype=jnp.int32))[None], band
            sc = jnp.einsum("bckgd,bskd->bkgcs", qg, kc, preferred_element_type=jnp.float32) * scale
            vis = bounds_visible(jnp.moveaxis(x["lo"], 0, 1), jnp.moveaxis(x["hi"], 0, 1), kv_pos, mask.kv_valid, n)
            parts.append((sc, vis[:, None, None]))
            values.append(("bkgcs,bskd->bckgd", vc))
        if mask.has_chain:
            idx = jnp.moveaxis(x["ci"], 0, 1)  # [b, c, E]
            ck = jax.vmap(take_rows)(chain_k, idx)  # [b, c, E, nkv, hd]
            cv = jax.vmap(take_rows)(chain_v, idx)
            sc = jnp.einsum("bckgd,bcekd->bkgce", qg, ck, preferred_element_type=jnp.float32) * scale
            parts.append((sc, jnp.moveaxis(x["cv"], 0, 1)[:, None, None]))
            values.append(("bkgce,bcekd->bckgd", cv))
        weights, lse = masked_softmax(parts, sinks)
        out = functools.reduce(jnp.add, [jnp.einsum(spec, w.astype(val.dtype), val, preferred_element_type=jnp.float32)
                                         for w, (spec, val) in zip(weights, values)])
        out = jnp.moveaxis(out.reshape(b, c, nh, hd), 1, 0)
        lse = jnp.moveaxis(jnp.moveaxis(lse[..., 0], 3, 1).reshape(b, c, nh), 1, 0)
        return out, lse

    out, lse = chunked_map(block, xs, c)
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1)


def attention(q, k, v, mask: AttentionMask, *, scale: float, window: Optional[int] = None, sinks=None, chain_k=None,
              chain_v=None):
    """Grouped-query attention under `mask` (jnp reference; memory-bounded by query chunks of `mask.chunk` rows,
    None = automatic).

    q [B, T, nh, hd]; k, v [B, S, nkv, hd] (the context keys); chain_k, chain_v [B, M, nkv, hd] (the keys
    `mask.chain_index` points into, when the mask has a chain part); window: the layer's sliding window or None;
    sinks [nh] or None. Returns [B, T, nh, hd] in q's dtype.
    """
    check_inputs(q, k, v, mask, sinks, chain_k, chain_v)
    lo, hi = query_bounds(mask, window)
    out, _ = _partial(q, k, v, lo, hi, mask, chain_k, chain_v, scale=scale, sinks=sinks, context=True)
    return out.astype(q.dtype)


def chain_partial(q, mask: AttentionMask, chain_k, chain_v, *, scale: float):
    """(o float32 [B, T, nh, hd], lse float32 [B, T, nh]) over the chain keys alone (a fused kernel takes the
    context keys; `merge_partials` joins the two)."""
    return _partial(q, chain_k, chain_v, None, None, mask, chain_k, chain_v, scale=scale, sinks=None, context=False)
