"""The EAGLE shift (spec D.1) of packed rows, inside jit: shifted slot p of a document pairs token x_{p+1}, target
feature g_p, the target distribution from y_{p+1} and loss flag l_{p+1} (speculators `shift_batch`, applied per
document). The shifted row keeps its length; each document gives up one slot, which becomes padding at the end."""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["eagle_shift", "shift_index"]


def shift_index(document_ids):
    """document_ids [..., S] (contiguous documents, -1 padding) -> src [..., S] int32: the raw index of
    token x_{p+1} for shifted slot p (its target feature g_p is at src-1), -1 for padding slots.

    Raw index i that is not the first of its document moves to slot i - (number of document starts
    at or before i). Pure jnp (usable inside jit)."""
    doc = jnp.asarray(document_ids, jnp.int32)
    s = doc.shape[-1]
    prev = jnp.concatenate([jnp.full(doc.shape[:-1] + (1,), -2, jnp.int32), doc[..., :-1]], axis=-1)
    is_start = (doc != -1) & (doc != prev)
    keep = (doc != -1) & ~is_start
    dest = jnp.arange(s, dtype=jnp.int32) - jnp.cumsum(is_start.astype(jnp.int32), axis=-1)
    dest = jnp.where(keep, dest, s)
    flat_dest = dest.reshape(-1, s)
    src_vals = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), flat_dest.shape)
    out = jnp.full(flat_dest.shape, -1, jnp.int32)
    rows = jnp.arange(flat_dest.shape[0])[:, None]
    out = out.at[rows, flat_dest].set(src_vals, mode="drop")
    return out.reshape(doc.shape)


def _take(x, idx, fill=0):
    """x [S, ...] gathered at idx [S] (-1 -> fill)."""
    g = jnp.take(x, jnp.clip(idx, 0, x.shape[0] - 1), axis=0)
    ok = (idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(ok, g, jnp.asarray(fill, x.dtype))


def eagle_shift(tokens, loss_mask, document_ids, aux=None, final=None):
    """Shift one raw packed row ([S] arrays; aux [S, A*Ht], final [S, Ht] target features or None).

    Returns dict(input_ids, loss_mask, document_ids, hidden_states, verifier_last_hidden_states, src),
    all of length S (shifted layout of spec D.1; padding: token 0, loss 0, doc -1, zero features)."""
    src = shift_index(document_ids)
    out = dict(input_ids=_take(jnp.asarray(tokens, jnp.int32), src),
               loss_mask=_take(jnp.asarray(loss_mask, jnp.int32), src),
               document_ids=_take(jnp.asarray(document_ids, jnp.int32), src, -1), src=src)
    out["hidden_states"] = None if aux is None else _take(aux, jnp.where(src >= 0, src - 1, -1))
    out["verifier_last_hidden_states"] = None if final is None else _take(final, src)
    return out
