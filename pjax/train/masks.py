"""Training attention masks: dense builders (reference, short rows) and structured, memory-bounded
masks that `pjax.nn.attention` hands the computation to (its `mask=` argument accepts any object with
an `attend(q, k, v, *, scale, window, sinks)` method).

* `cod_dense_mask`: the P-EAGLE mask of spec D.2 as a dense bool [N, N] (speculators
  `create_peagle_mask_mod`), with element validity.
* `CodMask`: the same attention computed in two parts and in query chunks: (A) each element against
  the depth-0 context (causal by anchor, same document, optional window), (B) each element against
  its own chain (at most K-1 keys, found by sorting (anchor, depth)). Memory O(chunk * S) instead of
  O(N^2); chunks are rematerialised in the backward pass.
* `DocCausalMask`: causal attention within documents of a packed row (the frozen target's features),
  honouring the layer's sliding window and sinks, query-chunked the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from pjax.kernels.cache_attention.reference import MASK_VALUE
from pjax.train.cod import CodLayout

DEFAULT_CHUNK_ELEMENTS = 1 << 28  # float32 scores per query chunk (heads * chunk * keys): 1 GiB


def cod_dense_mask(layout: CodLayout, document_ids, window: Optional[int] = None):
    """bool [N, N] (q, kv): doc[a_q] != -1, doc[a_q] == doc[a_kv], and either kv is depth 0 with
    a_kv <= a_q (and a_kv > a_q + d_q - window) or kv is in q's chain (a_kv == a_q, d_kv <= d_q);
    invalid elements see and are seen by nothing."""
    a, d, ok = layout.anchor_pos, layout.depth, layout.valid
    doc = jnp.asarray(document_ids, jnp.int32)
    da = doc[a]
    aq, ak, dq, dk = a[:, None], a[None, :], d[:, None], d[None, :]
    ctx = (dk == 0) & (ak <= aq)
    if window is not None:
        ctx &= ak > aq + dq - window
    m = (da[:, None] != -1) & (da[:, None] == da[None, :]) & (ctx | ((ak == aq) & (dk <= dq)))
    return m & ok[:, None] & ok[None, :]


def doc_causal_dense_mask(document_ids, window: Optional[int] = None):
    """bool [..., S, S]: causal by row index within one document (padding sees nothing)."""
    doc = jnp.asarray(document_ids, jnp.int32)
    i = jnp.arange(doc.shape[-1])
    m = (i[None, :] <= i[:, None]) & (doc[..., :, None] == doc[..., None, :]) & (doc[..., :, None] != -1)
    if window is not None:
        m &= i[None, :] > i[:, None] - window
    return m


def chain_index(layout: CodLayout, num_depths: int):
    """For every element and depth d' in 0..K-1: (index of the element with the same anchor at depth
    d' [N, K] int32, found [N, K] bool). Invalid elements are never found."""
    a, d, ok = layout.anchor_pos, layout.depth, layout.valid
    n = a.shape[0]
    k = num_depths
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(ok, (a + 1) * k + d, big)
    order = jnp.argsort(key)
    skey = key[order]
    want = (a[:, None] + 1) * k + jnp.arange(k)[None, :]
    pos = jnp.clip(jnp.searchsorted(skey, want), 0, n - 1)
    found = (skey[pos] == want) & ok[:, None]
    return order[pos].astype(jnp.int32), found


def _auto_chunk(n, s0, nh, chunk):
    if chunk is not None:
        return max(1, min(int(chunk), n))
    if n * s0 * nh <= DEFAULT_CHUNK_ELEMENTS:
        return n
    c = max(64, DEFAULT_CHUNK_ELEMENTS // max(1, s0 * nh))
    return min(n, c)


def _chunked(fn, xs, n, c):
    """Apply fn to chunks of size c along axis 0 of every array in xs (padding the tail); concat."""
    if c >= n:
        return fn(*xs)
    nc = -(-n // c)
    pad = nc * c - n

    def prep(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((nc, c) + x.shape[1:])
    out = jax.lax.map(lambda args: jax.checkpoint(fn)(*args), tuple(prep(x) for x in xs))
    return out.reshape((nc * c,) + out.shape[2:])[:n]


@dataclasses.dataclass(frozen=True)
class CodMask:
    """Structured P-EAGLE training mask (see module doc). The first `num_depth0` elements must be the
    depth-0 elements at anchors 0..num_depth0-1 (true for `cod_sample` layouts, segments and
    speculators layouts). q/k/v passed to `attend` are [B, N, heads, hd] (B rows share the layout)."""
    layout: CodLayout
    document_ids: jax.Array  # [S]
    chain: jax.Array  # [N, K]
    chain_found: jax.Array  # [N, K]
    num_depth0: int
    chunk: Optional[int] = None

    @classmethod
    def build(cls, layout: CodLayout, document_ids, num_depths: int, num_depth0: int, chunk=None):
        chain, found = chain_index(layout, num_depths)
        return cls(layout, jnp.asarray(document_ids, jnp.int32), chain, found, int(num_depth0), chunk)

    def attend(self, q, k, v, *, scale, window=None, sinks=None):
        if sinks is not None:
            raise NotImplementedError("attention sinks are not supported in drafter training layouts")
        b, n, nh, hd = q.shape
        nkv = k.shape[2]
        g = nh // nkv
        s0 = self.num_depth0
        k0, v0 = k[:, :s0], v[:, :s0]
        doc = self.document_ids
        doc0 = doc[:s0]
        kv_idx = jnp.arange(s0)
        a, d, ok = self.layout.anchor_pos, self.layout.depth, self.layout.valid
        dq = doc[a]
        ok_q = ok & (dq != -1)
        nd = self.chain.shape[1]
        slot = jnp.arange(nd)[None, :]
        # chain part: depths 1..d_q of the same anchor; the depth-0 root only when the window hides it
        vis_b = self.chain_found & (slot <= d[:, None]) & ok_q[:, None]
        root_in_ctx = jnp.ones_like(d, bool) if window is None else d < window
        vis_b &= (slot > 0) | ~root_in_ctx[:, None]

        def chunk_fn(qc, ac, dc, okc, dqc, cidx, cvis):
            c = qc.shape[0]
            qg = jnp.moveaxis(qc, 0, 1).reshape(b, c, nkv, g, hd)
            sa = jnp.einsum("bckgd,bskd->bkgcs", qg, k0, preferred_element_type=jnp.float32) * scale
            va = okc[:, None] & (kv_idx[None, :] <= ac[:, None]) & (doc0[None, :] == dqc[:, None])
            if window is not None:
                va &= kv_idx[None, :] > (ac + dc)[:, None] - window
            sa = jnp.where(va[None, None, None], sa, MASK_VALUE)
            kc, vc = k[:, cidx], v[:, cidx]  # [b, c, nd, nkv, hd]
            sb = jnp.einsum("bckgd,bcjkd->bkgcj", qg, kc, preferred_element_type=jnp.float32) * scale
            sb = jnp.where(cvis[None, None, None], sb, MASK_VALUE)
            m = jnp.maximum(jnp.max(sa, -1, keepdims=True), jnp.max(sb, -1, keepdims=True))
            pa, pb = jnp.exp(sa - m), jnp.exp(sb - m)
            den = jnp.sum(pa, -1, keepdims=True) + jnp.sum(pb, -1, keepdims=True)
            pa, pb = (pa / den).astype(v.dtype), (pb / den).astype(v.dtype)
            out = jnp.einsum("bkgcs,bskd->bckgd", pa, v0, preferred_element_type=jnp.float32)
            out += jnp.einsum("bkgcj,bcjkd->bckgd", pb, vc, preferred_element_type=jnp.float32)
            return jnp.moveaxis(out.reshape(b, c, nh, hd), 0, 1)  # [c, b, nh, hd]

        c = _auto_chunk(n, s0, nh, self.chunk)
        out = _chunked(chunk_fn, (jnp.moveaxis(q, 1, 0), a, d, ok_q, dq, self.chain, vis_b), n, c)
        return jnp.moveaxis(out, 0, 1).astype(q.dtype)


jax.tree_util.register_dataclass(CodMask, data_fields=["layout", "document_ids", "chain", "chain_found"],
                                 meta_fields=["num_depth0", "chunk"])


@dataclasses.dataclass(frozen=True)
class DocCausalMask:
    """Causal attention inside the documents of packed rows: document_ids [B, S] (-1 padding)."""
    document_ids: jax.Array
    chunk: Optional[int] = None

    def attend(self, q, k, v, *, scale, window=None, sinks=None):
        b, s, nh, hd = q.shape
        nkv = k.shape[2]
        g = nh // nkv
        doc = self.document_ids
        kv_idx = jnp.arange(k.shape[1])

        def chunk_fn(qc, qi):
            c = qc.shape[0]
            qg = jnp.moveaxis(qc, 0, 1).reshape(b, c, nkv, g, hd)
            sc = jnp.einsum("bckgd,bskd->bkgcs", qg, k, preferred_element_type=jnp.float32) * scale
            dq = jnp.take(doc, qi, axis=1)  # [b, c]
            vis = (kv_idx[None, None, :] <= qi[None, :, None]) & (doc[:, None, :] == dq[:, :, None])
            vis &= dq[:, :, None] != -1
            if window is not None:
                vis &= kv_idx[None, None, :] > qi[None, :, None] - window
            sc = jnp.where(vis[:, None, None], sc, MASK_VALUE)
            m = jnp.max(sc, -1, keepdims=True)
            if sinks is not None:
                sk = sinks.astype(jnp.float32).reshape(1, nkv, g, 1, 1)
                m = jnp.maximum(m, sk)
                p = jnp.exp(sc - m)
                den = jnp.sum(p, -1, keepdims=True) + jnp.exp(sk - m)
            else:
                p = jnp.exp(sc - m)
                den = jnp.sum(p, -1, keepdims=True)
            p = (p / den).astype(v.dtype)
            out = jnp.einsum("bkgcs,bskd->bckgd", p, v, preferred_element_type=jnp.float32)
            return jnp.moveaxis(out.reshape(b, c, nh, hd), 1, 0)

        c = _auto_chunk(s, k.shape[1], nh, self.chunk)
        out = _chunked(chunk_fn, (jnp.moveaxis(q, 1, 0), jnp.arange(s)), s, c)
        return jnp.moveaxis(out, 0, 1).astype(q.dtype)


jax.tree_util.register_dataclass(DocCausalMask, data_fields=["document_ids"], meta_fields=["chunk"])
