"""The drafter's training layouts as attention masks (data: `pjax.kernels.flash_attention.AttentionMask`), which the
one attention of the library interprets (reference, Pallas kernel):

* `cod_mask`: the P-EAGLE mask of spec D.2 (speculators `create_peagle_mask_mod`) over a COD layout. Context part:
  element (a, d) sees the depth-0 keys at anchors <= a in its document (window counted back from a + d, never
  hiding a itself); chain part: the elements of its own chain at depths 1..d (K - 1 keys at most, found by sorting
  (anchor, depth)). Invalid elements and padding anchors see nothing; nothing sees them.
* `ttt_mask`: pass t of the EAGLE-3 training-time test (speculators `create_combined_mask_mod` extended by
  `extend_mask_for_draft_tokens` once per earlier pass): query p sees pass 0's keys causally inside its document
  (window counted back from p: speculators' eagle3 rule, unlike the COD rule) and its own keys of passes 1..t.
  The same rule as COD with anchor = p, depth = pass, except for the window offset.
* `cod_dense_mask`: the COD rule evaluated densely as bool [N, N] (tests compare it with speculators' mask).
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from pjax.kernels.flash_attention.mask import AttentionMask, document_starts, visible
from pjax.train.cod import CodLayout

__all__ = ["chain_index", "chain_slots", "cod_dense_mask", "cod_mask", "ttt_mask"]


def chain_index(layout: CodLayout, num_depths: int, slots: Optional[int] = None):
    """Each element's own chain: the valid elements with its anchor at depths 1..its depth, as (index [N, E] int32,
    found [N, E] bool) with E = slots (default num_depths - 1: one element per anchor and depth, as `cod_sample` and
    speculators lay them out; `chain_slots` counts a layout with repeated elements). Found by sorting the elements by
    (anchor, depth): a chain is one run of the sorted order. Invalid elements are never found."""
    a, d, ok = layout.anchor_pos, layout.depth, layout.valid
    n = a.shape[0]
    k = num_depths
    e = k - 1 if slots is None else slots
    key = jnp.where(ok, (a + 1) * k + d, jnp.iinfo(jnp.int32).max)  # anchors >= -1, depths < k: runs never overlap
    order = jnp.argsort(key)
    skey = key[order]
    start = jnp.searchsorted(skey, (a + 1) * k + 1, side="left")
    end = jnp.searchsorted(skey, (a + 1) * k + d, side="right")
    pos = start[:, None] + jnp.arange(e)[None, :]
    return order[jnp.clip(pos, 0, n - 1)].astype(jnp.int32), (pos < end[:, None]) & ok[:, None]


def chain_slots(layout: CodLayout) -> int:
    """The longest chain of a concrete layout (`chain_index` slots that hold every chain, repeated elements too)."""
    a, d, ok = (np.asarray(x) for x in (layout.anchor_pos, layout.depth, layout.valid))
    same = (a[:, None] == a[None, :]) & (d[None, :] >= 1) & (d[None, :] <= d[:, None]) & ok[None, :]
    return int(same.sum(axis=1).max(initial=0))


def cod_mask(layout: CodLayout, document_ids, num_depths: int, num_depth0: int, chunk: Optional[int] = None,
             slots: Optional[int] = None) -> AttentionMask:
    """The P-EAGLE mask of one row's COD layout (module doc). layout [N] elements whose first `num_depth0` are the
    depth-0 elements at anchors 0..num_depth0-1 (as `cod_sample`, partition segments and speculators emit them):
    those are the context keys; document_ids [S] (-1 padding); num_depths K (static); slots: chain keys per element
    (`chain_index`). Masks a batch of 1 row."""
    a, d, ok = layout.anchor_pos, layout.depth, layout.valid
    doc = jnp.asarray(document_ids, jnp.int32)
    live = ok & (doc[a] != -1)
    q_start = jnp.where(live, document_starts(doc)[a], a + 1)
    e = num_depths - 1 if slots is None else slots
    if e == 0:  # depth 0 only: no chains
        return AttentionMask(a[None], q_start[None], d[None], num_context=int(num_depth0), chunk=chunk)
    chain, found = chain_index(layout, num_depths, e)
    return AttentionMask(a[None], q_start[None], d[None], chain_index=chain[None],
                         chain_valid=(found & live[:, None])[None], num_context=int(num_depth0), chunk=chunk)


def ttt_mask(document_ids, step: int, passes: int, chunk: Optional[int] = None) -> AttentionMask:
    """Pass `step` (0-based) of a training-time test of `passes` passes over one row: document_ids [S] (-1
    padding). Context keys: pass 0's [S]; chain keys: the passes flattened [P * S] (pass t of row p at t * S + p,
    `pjax.models.attention.StepKV`). Masks a batch of 1 row."""
    doc = jnp.asarray(document_ids, jnp.int32)
    s = doc.shape[-1]
    idx = jnp.arange(s, dtype=jnp.int32)
    q_start = jnp.where(doc == -1, idx + 1, document_starts(doc))
    if passes == 1:
        return AttentionMask(idx[None], q_start[None], chunk=chunk)
    later = jnp.arange(1, passes, dtype=jnp.int32)[None, :]
    chain = later * s + idx[:, None]
    valid = jnp.broadcast_to(later <= step, chain.shape)
    return AttentionMask(idx[None], q_start[None], chain_index=chain[None], chain_valid=valid[None], chunk=chunk)


def cod_dense_mask(layout: CodLayout, document_ids, window: Optional[int] = None):
    """bool [N, N] (query, key): `cod_mask`'s rule over all N elements as keys, for a concrete layout as `cod_mask`
    takes it (its depth-0 prefix of len(document_ids) elements)."""
    s = jnp.shape(document_ids)[-1]
    depth = np.asarray(layout.depth)
    m = cod_mask(layout, document_ids, int(depth.max(initial=0)) + 1, s, slots=chain_slots(layout))
    n = layout.size
    dense = jnp.zeros((n, n), jnp.int32).at[:, :s].set(visible(m, s, window)[0].astype(jnp.int32))
    if m.has_chain:
        dense = dense.at[jnp.arange(n)[:, None], m.chain_index[0]].add(m.chain_valid[0].astype(jnp.int32))
    return dense > 0
