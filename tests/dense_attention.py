"""Test harness: grouped-query attention under an explicit bool mask, written as a plain softmax (independent of
pjax's attention), for checking the library's masks, reference and kernels on small shapes."""
from __future__ import annotations

import jax.numpy as jnp


def dense_attention(q, k, v, allowed, scale, sinks=None):
    """q [B, T, nh, hd]; k, v [B, S, nkv, hd]; allowed bool [B or 1, T, S]; sinks [nh] or None -> float32
    [B, T, nh, hd]. Rows with no allowed key are don't-care (compare live rows only)."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
    s = jnp.where(jnp.asarray(allowed)[:, None], s, -1e30)  # finite: no NaN in gradients of dead rows
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None, None])
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sinks.astype(jnp.float32)[None, :, None, None] - m)
    return jnp.einsum("bhts,bshd->bthd", p / den, v, precision="highest")
