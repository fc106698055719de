"""The tree mask of cache attention: T queries that are the nodes of a draft tree written at consecutive cache slots,
each seeing the committed cache and its own ancestors (`TreeMask`), as a dense visibility over the cache."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["TreeMask", "check_window", "tree_visible"]


@dataclasses.dataclass(frozen=True)
class TreeMask:
    """A tree at the M cache slots start..start+M-1, seen by T queries (its nodes). start [B] i32: the first tree
    slot; visible [B, T, M] bool: query i sees tree slot j (its ancestors and itself). M = T: the queries are the
    tree's slots in order (a tree's verification), so tree key j sits at position q_pos[b, j]; M > T: the queries are
    some of the slots (a tree drafted depth by depth: each pass's nodes see the earlier passes'), and the slots have
    no positions (a window must be None or >= M, so it never hides an ancestor). Keys at slots < start: the position
    rule (slot <= q_pos, inside the window); keys at slots >= start + M: hidden."""
    start: jax.Array
    visible: jax.Array


jax.tree_util.register_dataclass(TreeMask, data_fields=["start", "visible"], meta_fields=[])


def check_window(tree: TreeMask, num_queries: int, window: Optional[int]) -> None:
    """A tree of more slots than queries (M > T) has no slot positions: a ValueError unless window is None or >= M."""
    m = tree.visible.shape[-1]
    if m != num_queries and window is not None and window < m:
        raise ValueError(f"cache_attention: a tree of {m} slots seen by {num_queries} queries needs window None or >= "
                         f"{m} (its slots have no positions), got window={window}")


def tree_visible(q_pos, tree: TreeMask, num_keys: int, window: Optional[int] = None, kv_len=None):
    """bool [B, T, S] (S = num_keys): the cache keys each query sees. Committed keys (slot < start) at position =
    slot: slot <= q_pos; tree key j: tree.visible[b, i, j]; in a layer with a sliding window w every key also needs
    position > q_pos - w (with M = T a tree key's position is q_pos[b, j]: the query's ancestors by depth, as if its
    path were committed; with M > T the window is >= M and never hides one, `check_window`); with kv_len [B], slots
    >= kv_len are hidden."""
    b, t = q_pos.shape
    m = tree.visible.shape[-1]
    slot = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
    q = jnp.asarray(q_pos, jnp.int32)[:, :, None]
    j = slot - jnp.asarray(tree.start, jnp.int32)[:, None, None]  # [B, 1, S] index in the tree
    in_tree = (j >= 0) & (j < m)
    jc = jnp.broadcast_to(jnp.clip(j, 0, m - 1), (b, t, num_keys))
    vis = ((j < 0) & (slot <= q)) | (in_tree & jnp.take_along_axis(jnp.asarray(tree.visible, bool), jc, axis=2))
    if window is not None and m == t:
        key_pos = jnp.where(in_tree, jnp.take_along_axis(q.transpose(0, 2, 1), jc[:, :1], axis=2), slot)  # [B, 1, S]
        vis &= key_pos > q - window
    elif window is not None:
        vis &= in_tree | (slot > q - window)
    if kv_len is not None:
        vis &= slot < jnp.asarray(kv_len, jnp.int32)[:, None, None]
    return vis
