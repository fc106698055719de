"""Public entry point: `cache_write(..., implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

from pjax.kernels import dispatch
from pjax.kernels.cache_write import reference
from pjax.kernels.cache_write.config import DEFAULT


def cache_write(k, v, k_new, v_new, positions, valid=None, *, implementation: str = "auto"):
    """Write new K/V into a KV cache indexed by absolute position -> the updated (k, v).

    k, v [B, S, nkv, hd]; k_new, v_new [B, T, nkv, hd] (cast to the cache dtype); positions [B, T] int; valid [B, T]
    bool or None. Tokens where valid is False, or whose position is outside [0, S), write nothing.
    implementation (`pjax.kernels.dispatch`): the kernel takes every shape; "auto" runs it on a GPU for up to
    `WriteConfig.max_auto_tokens` new tokens per row (decode, verify and drafting) and XLA's scatter for prefill.
    """
    t = k_new.shape[1]
    if not dispatch.use_kernel(implementation, faster=t <= DEFAULT.max_auto_tokens, op="cache_write"):
        return reference.cache_write(k, v, k_new, v_new, positions, valid)
    from pjax.kernels.cache_write import pallas
    return pallas.cache_write(k, v, k_new, v_new, positions, valid)
