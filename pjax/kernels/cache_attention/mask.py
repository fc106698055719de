"""The tree mask of cache attention: T queries that are the nodes of a draft tree written at consecutive cache slots,
each seeing the committed cache and its own ancestors (`TreeMask`), as a dense visibility over the cache."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["TreeMask", "tree_visible"]


@dataclasses.dataclass(frozen=True)
class TreeMask:
    """The T queries are a tree's T slots start..start+T-1 of the cache, in order (so tree key j sits at position
    q_pos[b, j]). start [B] i32: the first tree slot; visible [B, T, T] bool: query i sees tree slot j (ancestor or
    self). Keys at slots < start: the position rule (slot <= q_pos, inside the window); keys at slots >= start + T:
    hidden."""
    start: jax.Array
    visible: jax.Array


jax.tree_util.register_dataclass(TreeMask, data_fields=["start", "visible"], meta_fields=[])


def tree_visible(q_pos, tree: TreeMask, num_keys: int, window: Optional[int] = None, kv_len=None):
    """bool [B, T, S] (S = num_keys): the cache keys each query sees. Committed keys (slot < start) at position =
    slot: slot <= q_pos; tree key j: tree.visible[b, i, j]; in a layer with a sliding window w every key also needs
    position > q_pos - w (a tree key's position is q_pos[b, j]: the query's ancestors by depth, as if its path were
    committed); with kv_len [B], slots >= kv_len are hidden."""
    b, t = q_pos.shape
    slot = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
    q = jnp.asarray(q_pos, jnp.int32)[:, :, None]
    j = slot - jnp.asarray(tree.start, jnp.int32)[:, None, None]  # [B, 1, S] index in the tree
    in_tree = (j >= 0) & (j < t)
    jc = jnp.broadcast_to(jnp.clip(j, 0, t - 1), (b, t, num_keys))
    key_pos = jnp.where(in_tree, jnp.take_along_axis(q.transpose(0, 2, 1), jc[:, :1], axis=2), slot)  # [B, 1, S]
    vis = ((j < 0) & (slot <= q)) | (in_tree & jnp.take_along_axis(jnp.asarray(tree.visible, bool), jc, axis=2))
    if window is not None:
        vis &= key_pos > q - window
    if kv_len is not None:
        vis &= slot < jnp.asarray(kv_len, jnp.int32)[:, None, None]
    return vis
