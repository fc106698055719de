"""COD sampling (spec D.3) with static shapes, and sequence partitioning of a layout (spec D.5).

A layout is a flat list of elements (anchor_pos, depth) with a validity flag. Depth 0 always holds
every position 0..S-1 (element i = position i). Depth d >= 1 occupies a fixed block of capacity
`cap_d` (the largest count the algorithm can produce for this row length), filled with sorted
anchors and padded with invalid elements (anchor 0). Shapes depend only on (S, CodConfig), so the
sampler runs under jit and every step reuses one compilation.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class CodConfig:
    """num_depths K (depths 0..K-1), ratios r and r_min, max_anchors (None = unlimited).

    filter_position_zero: candidate position 0 is never used (speculators filters it from depths >= 2
    only; here it is also dropped from the depth-1 pool, as NeMo Automodel does, so no anchor is -1).
    same_document: chains never cross a document boundary (a depth-d element's reference position and
    its anchor lie in one document). False reproduces speculators exactly.
    """
    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: Optional[int] = 512
    filter_position_zero: bool = True
    same_document: bool = True

    def validate(self):
        if self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")
        if not 0 < self.down_sample_ratio <= 1 or not 0 <= self.down_sample_ratio_min <= 1:
            raise ValueError(f"down_sample_ratio={self.down_sample_ratio} must be in (0, 1] and "
                             f"down_sample_ratio_min={self.down_sample_ratio_min} in [0, 1]")
        if self.max_anchors is not None and self.max_anchors < 1:
            raise ValueError(f"max_anchors must be >= 1 or None, got {self.max_anchors}")
        return self


@dataclasses.dataclass(frozen=True)
class CodLayout:
    """anchor_pos, depth [N] int32, valid [N] bool. Reference position r = anchor_pos + depth."""
    anchor_pos: jax.Array
    depth: jax.Array
    valid: jax.Array

    @property
    def size(self) -> int:
        return self.anchor_pos.shape[-1]


jax.tree_util.register_dataclass(CodLayout, data_fields=["anchor_pos", "depth", "valid"], meta_fields=[])


@lru_cache(maxsize=64)
def depth_count_table(seq_len: int, cfg: CodConfig) -> np.ndarray:
    """[K, M+1] int32: n_d(seeds) = int(max(0, seeds - d) * max(r**d, r_min)) (Python float math,
    exactly as speculators), d = 0 row = seq_len; M = min(seq_len, max_anchors)."""
    m = seq_len if cfg.max_anchors is None else min(seq_len, cfg.max_anchors)
    t = np.zeros((cfg.num_depths, m + 1), np.int32)
    t[0] = seq_len
    for d in range(1, cfg.num_depths):
        ratio = max(cfg.down_sample_ratio ** d, cfg.down_sample_ratio_min)
        for s in range(m + 1):
            t[d, s] = int(max(0, s - d) * ratio)
    return t


def cod_capacities(seq_len: int, cfg: CodConfig) -> tuple[int, ...]:
    """Per-depth block capacities (depth 0 = seq_len); the element budget is their sum."""
    t = depth_count_table(seq_len, cfg)
    return tuple(int(t[d, -1]) for d in range(cfg.num_depths))


def cod_budget(seq_len: int, cfg: CodConfig) -> int:
    return sum(cod_capacities(seq_len, cfg))


def static_depths(seq_len: int, cfg: CodConfig) -> np.ndarray:
    """The (static) depth of every element slot [N]."""
    caps = cod_capacities(seq_len, cfg)
    return np.concatenate([np.full(c, d, np.int32) for d, c in enumerate(caps)])


def _random_subset(key, candidates, n):
    """Boolean mask choosing min(n, count) candidates uniformly at random (n traced)."""
    u = jax.random.uniform(key, candidates.shape)
    u = jnp.where(candidates, u, 2.0)
    rank = jnp.argsort(jnp.argsort(u))
    return candidates & (rank < n)


def cod_sample(key, loss_mask, cfg: CodConfig, document_ids=None) -> CodLayout:
    """Sample one COD layout for a row. loss_mask [S] (0/1), document_ids [S] (-1 padding) or None.

    Algorithm (spec D.3): seeds = loss-valid positions (a random subset of max_anchors if more);
    for d = 1..K-1: n = int(max(0, |seeds| - d) * max(r**d, r_min)); select a random n-subset of the
    pool (all of it if smaller); emit anchors sel - d; the next pool is {sel + 1} restricted to
    loss-valid positions (and position 0 dropped). Every depth-d element's chain is present and its
    reference position is loss-valid.
    """
    cfg.validate()
    valid = jnp.asarray(loss_mask) == 1
    s = valid.shape[-1]
    table = jnp.asarray(depth_count_table(s, cfg))
    caps = cod_capacities(s, cfg)
    pos = jnp.arange(s, dtype=jnp.int32)
    keys = jax.random.split(key, cfg.num_depths)
    nvalid = jnp.sum(valid.astype(jnp.int32))
    if cfg.max_anchors is not None and cfg.max_anchors < s:
        seeds = _random_subset(keys[0], valid, cfg.max_anchors)
        nseed = jnp.minimum(nvalid, cfg.max_anchors)
    else:
        seeds, nseed = valid, nvalid
    same_doc_prev = None
    if cfg.same_document and document_ids is not None:
        doc = jnp.asarray(document_ids, jnp.int32)
        prev = jnp.concatenate([jnp.full((1,), -2, jnp.int32), doc[:-1]])
        same_doc_prev = (doc == prev) & (doc != -1)  # position p and p-1 in one document
    pool = seeds
    if cfg.filter_position_zero:
        pool = pool & (pos != 0)
    if same_doc_prev is not None:
        pool = pool & same_doc_prev
    anchors, valids = [pos], [jnp.ones((s,), bool)]
    for d in range(1, cfg.num_depths):
        if caps[d] == 0:
            break
        n = table[d, nseed]
        sel = _random_subset(keys[d], pool, n)
        cnt = jnp.sum(sel.astype(jnp.int32))
        idx = jnp.nonzero(sel, size=caps[d], fill_value=d)[0].astype(jnp.int32)
        ok = jnp.arange(caps[d]) < cnt
        anchors.append(jnp.where(ok, idx - d, 0))
        valids.append(ok)
        nxt = jnp.concatenate([jnp.zeros((1,), bool), sel[:-1]])
        if not cfg.filter_position_zero:
            nxt = nxt.at[0].set(sel[-1])
        pool = nxt & valid
        if same_doc_prev is not None:
            pool = pool & same_doc_prev
    anchor = jnp.concatenate(anchors)
    depth = jnp.asarray(static_depths(s, cfg)[:anchor.shape[0]])
    return CodLayout(anchor, depth, jnp.concatenate(valids))


def layout_from_arrays(anchor_pos, depth, valid=None) -> CodLayout:
    """An explicit layout (e.g. the output of speculators `generate_cod_sample_indices`)."""
    anchor_pos = jnp.asarray(anchor_pos, jnp.int32)
    depth = jnp.asarray(depth, jnp.int32)
    valid = jnp.ones(anchor_pos.shape, bool) if valid is None else jnp.asarray(valid, bool)
    return CodLayout(anchor_pos, depth, valid)


# ------------------------------------------------------------------------------- partitioning


def segment_bounds(seq_len: int, num_segments: int) -> list[tuple[int, int]]:
    """Anchor ranges [start, end) of the depth-0 elements owned by each segment (spec D.5)."""
    ends = [min(seq_len, -(-(s + 1) * seq_len // num_segments)) for s in range(num_segments)]
    ends[-1] = seq_len
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def element_segment(anchor_pos, depth, seq_len: int, num_segments: int):
    """Segment of each element: bucket = anchor (depth 0) or anchor + 1 (depth >= 1),
    seg = clamp(bucket * num_segments // seq_len, 0, num_segments - 1)."""
    bucket = anchor_pos + (depth > 0).astype(anchor_pos.dtype)
    return jnp.clip(bucket * num_segments // seq_len, 0, num_segments - 1)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One partition forward: its elements (layout; the depth-0 prefix [0, end) first) and which of
    them it owns (its loss terms); the others are causal-completion context."""
    layout: CodLayout
    owned: jax.Array


jax.tree_util.register_dataclass(Segment, data_fields=["layout", "owned"], meta_fields=[])


def partition_layout(layout: CodLayout, seq_len: int, num_segments: int,
                     capacities: Optional[tuple[int, ...]] = None) -> list[Segment]:
    """Split a layout whose first `seq_len` elements are depth 0 at anchors 0..S-1 (as `cod_sample`
    produces) into `num_segments` forwards with static shapes (see `partition_segment`)."""
    return [partition_segment(layout, seq_len, num_segments, s, capacities) for s in range(num_segments)]


def partition_segment(layout: CodLayout, seq_len: int, num_segments: int, index: int,
                      capacities: Optional[tuple[int, ...]] = None) -> Segment:
    """Segment `index` of a layout (spec D.5): the depth-0 prefix [0, end) (owning [start, end)) and
    the deeper elements whose segment is `index` (all owned), packed per depth into blocks of
    min(cap_d, end - start + 1). `capacities` = the per-depth block sizes of a `cod_sample` layout
    (`cod_capacities`); None treats all deeper elements as one block (any explicit layout; segments
    are then larger)."""
    n = layout.size
    deep_a, deep_d, deep_v = layout.anchor_pos[seq_len:], layout.depth[seq_len:], layout.valid[seq_len:]
    seg_of = element_segment(deep_a, deep_d, seq_len, num_segments)
    start, end = segment_bounds(seq_len, num_segments)[index]
    width = end - start + 1
    anchors = [jnp.arange(end, dtype=jnp.int32)]
    depths = [jnp.zeros((end,), jnp.int32)]
    valids = [jnp.ones((end,), bool)]
    owned = [jnp.arange(end) >= start]
    for (lo, hi) in _deep_blocks(n - seq_len, capacities):
        # one element per anchor and depth: a depth block never needs more than `width` slots
        size = min(hi - lo, width) if capacities is not None else hi - lo
        sel = (seg_of[lo:hi] == index) & deep_v[lo:hi]
        idx = jnp.nonzero(sel, size=size, fill_value=0)[0]
        ok = jnp.arange(size) < jnp.sum(sel.astype(jnp.int32))
        anchors.append(jnp.where(ok, deep_a[lo:hi][idx], 0))
        depths.append(jnp.where(ok, deep_d[lo:hi][idx], 1))
        valids.append(ok)
        owned.append(ok)
    return Segment(CodLayout(jnp.concatenate(anchors), jnp.concatenate(depths), jnp.concatenate(valids)),
                   jnp.concatenate(owned))


def _deep_blocks(num_deep: int, capacities):
    if capacities is None:
        return [(0, num_deep)] if num_deep else []
    blocks, o = [], 0
    for c in capacities[1:]:
        if c:
            blocks.append((o, o + c))
        o += c
    if o != num_deep:
        raise ValueError(f"layout has {num_deep} deeper elements but capacities {capacities[1:]} sum to {o}")
    return blocks
