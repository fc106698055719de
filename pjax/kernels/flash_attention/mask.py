"""Attention masks as data: which keys each query of a layer sees, as arrays that one attention function interprets
(`pjax.kernels.flash_attention.attention`). Every layout of the library is one `AttentionMask`:

* inference by position (`position_mask`): keys at positions <= the query's, inside its sliding window;
* document-causal packed rows (`document_mask`): causal inside each document (a run of equal ids, -1 = padding);
* causal rows (`causal_mask`): one sequence per row with padding at the end (cuDNN's padding-causal layout);
* drafter training layouts (`pjax.train.masks`): the P-EAGLE COD layout and the EAGLE-3 training-time test.

The rule. Context key j (position kv_pos[j], index j when kv_pos is None) is visible to query i when

    q_start[i] <= kv_pos[j] <= q_pos[i],   kv_valid[j],
    and, in a layer with a sliding window w:   kv_pos[j] > q_pos[i] + min(q_offset[i], w - 1) - w

so the window counts back from the query's reference position q_pos + q_offset (a COD element's anchor + depth)
but never hides the query's own anchor (q_pos itself). `query_bounds` gives the two ends [lo, hi] of that interval;
the reference and the kernels test the same interval. Chain keys: at most E more keys per query, gathered from a
second key array at chain_index[i, e] and visible where chain_valid[i, e] (a COD element's own chain, the earlier
passes of a training-time test).

Shapes: Bm = batch or 1 (shared by every row), T queries, S context keys, E chain slots. Optional fields are None
when a layout does not use them (no lower bound, no offset, keys indexed by position, every key valid, no chain).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["AttentionMask", "bounds_visible", "causal_mask", "document_mask", "document_starts", "position_mask",
           "query_bounds", "visible"]

NO_BOUND = jnp.iinfo(jnp.int32).min // 2  # "no lower bound" (halved: q_pos - window stays representable)


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees (module doc). q_pos, q_start, q_offset [Bm, T] int32; kv_pos [Bm, S] int32 (None:
    key index = position); kv_valid [Bm, S] bool; chain_index [Bm, T, E] int32 into the chain keys; chain_valid
    [Bm, T, E] bool; lengths [B] int32: set only by `causal_mask` (each row one causal sequence of that length).
    Static: num_context: a layer attending over its own T tokens takes its first num_context tokens as the context
    keys (None: all of them), and all T as chain keys; chunk: query rows per chunk of the jnp reference (None =
    automatic), carried with the mask so that it reaches every layer; span: None, or a promise that query i sees no
    context key outside indices (i - span, i] (documents of at most span tokens), which lets the jnp reference score
    each query chunk against that band of keys only instead of all S."""
    q_pos: jax.Array
    q_start: Optional[jax.Array] = None
    q_offset: Optional[jax.Array] = None
    kv_pos: Optional[jax.Array] = None
    kv_valid: Optional[jax.Array] = None
    chain_index: Optional[jax.Array] = None
    chain_valid: Optional[jax.Array] = None
    lengths: Optional[jax.Array] = None
    num_context: Optional[int] = None
    chunk: Optional[int] = None
    span: Optional[int] = None

    @property
    def has_chain(self) -> bool:
        return self.chain_index is not None

    @property
    def keys_by_position(self) -> bool:
        """Context key j sits at position j and every key is valid: what the flash kernels take."""
        return self.kv_pos is None and self.kv_valid is None


jax.tree_util.register_dataclass(
    AttentionMask, data_fields=["q_pos", "q_start", "q_offset", "kv_pos", "kv_valid", "chain_index", "chain_valid",
                                "lengths"], meta_fields=["num_context", "chunk", "span"])


def query_bounds(mask: AttentionMask, window: Optional[int] = None):
    """(lo, hi) int32 [Bm, T]: query i sees the context keys at positions lo[i] <= p <= hi[i] (and kv_valid);
    lo > hi for a query that sees none."""
    hi = jnp.asarray(mask.q_pos, jnp.int32)
    lo = jnp.full(hi.shape, NO_BOUND, jnp.int32) if mask.q_start is None else jnp.asarray(mask.q_start, jnp.int32)
    if window is not None:
        ref = hi if mask.q_offset is None else hi + jnp.minimum(jnp.asarray(mask.q_offset, jnp.int32), window - 1)
        lo = jnp.maximum(lo, ref - window + 1)
    return lo, hi


def visible(mask: AttentionMask, num_keys: int, window: Optional[int] = None):
    """bool [Bm, T, S]: the context keys each query sees (the module's rule, densely; S = num_keys)."""
    return bounds_visible(*query_bounds(mask, window), mask.kv_pos, mask.kv_valid, num_keys)


def bounds_visible(lo, hi, kv_pos, kv_valid, num_keys: int):
    """bool [Bm, T, S] from query bounds lo, hi [Bm, T] and the keys' kv_pos / kv_valid [Bm, S] (or None)."""
    kp = jnp.arange(num_keys, dtype=jnp.int32)[None] if kv_pos is None else jnp.asarray(kv_pos, jnp.int32)
    vis = (kp[:, None, :] >= lo[..., None]) & (kp[:, None, :] <= hi[..., None])
    if kv_valid is not None:
        vis &= jnp.asarray(kv_valid, bool)[:, None, :]
    return vis


def document_starts(document_ids):
    """[..., S] -> int32 [..., S]: index of the first token of each token's document (a run of equal ids)."""
    doc = jnp.asarray(document_ids, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(doc.shape[-1], dtype=jnp.int32), doc.shape)
    prev = jnp.concatenate([jnp.full(doc.shape[:-1] + (1,), -2, jnp.int32), doc[..., :-1]], axis=-1)
    return jax.lax.cummax(jnp.where(doc != prev, idx, 0), axis=doc.ndim - 1)


def document_mask(document_ids, chunk: Optional[int] = None, span: Optional[int] = None) -> AttentionMask:
    """Causal attention inside the documents of packed rows: document_ids [B, S] (-1 = padding, which sees nothing).
    Keys are the row's tokens by index. chunk, span (no document longer than span tokens): see `AttentionMask`."""
    doc = jnp.asarray(document_ids, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(doc.shape[-1], dtype=jnp.int32), doc.shape)
    return AttentionMask(idx, jnp.where(doc == -1, idx + 1, document_starts(doc)), chunk=chunk, span=span)


def causal_mask(lengths, seq_len: int, chunk: Optional[int] = None) -> AttentionMask:
    """Each row one causal sequence: lengths [B] real tokens at the start of rows of seq_len, padding after (which
    sees nothing). The layout cuDNN's fused attention takes (padding-causal, sliding windows)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (lengths.shape[0], seq_len))
    return AttentionMask(idx, jnp.where(idx < lengths[:, None], 0, idx + 1), lengths=lengths, chunk=chunk)


def position_mask(q_pos, kv_pos, kv_valid=None) -> AttentionMask:
    """Attention by absolute position: q_pos [B, T]; kv_pos [B, S] or [S]; kv_valid [B, S] or None. Query i sees the
    valid keys at positions <= q_pos[i] (inside the layer's window)."""
    q_pos = jnp.asarray(q_pos, jnp.int32)
    kv_pos = jnp.asarray(kv_pos, jnp.int32)
    return AttentionMask(q_pos, kv_pos=kv_pos if kv_pos.ndim == 2 else kv_pos[None],
                         kv_valid=None if kv_valid is None else jnp.asarray(kv_valid, bool))
