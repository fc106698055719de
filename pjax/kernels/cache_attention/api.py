"""Public entry point: `cache_attention(..., implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from pjax.kernels import _dispatch
from pjax.kernels.cache_attention import reference

# H200 (JAX 0.11.2, 2026-11-22, device time from the profiler): 1.9-6.5x faster than XLA on all measured
# verify/draft shapes (docs/benchmarks.md section 2).
AUTO_PALLAS = True
MAX_QUERY_ROWS = 128  # T * nh / nkv rows held in one program; larger (prefill) stays on XLA


def pallas_supported(q, k) -> bool:
    """The kernel keeps all T * g query rows of a KV head in one program: decode / verify / draft shapes."""
    t, nh, hd = q.shape[1:]
    return t * (nh // k.shape[2]) <= MAX_QUERY_ROWS and hd <= 256


@functools.partial(jax.jit, static_argnames=("scale", "window", "implementation"))
def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    implementation: str = "auto"):
    """Attention of T new queries over a KV cache indexed by absolute position.

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T] absolute positions; kv_len [B] (keys at index
    >= kv_len hidden) or None; window (sliding window) or None; sinks [nh] or None. Visible: key index <=
    q_pos, > q_pos - window, < kv_len. Equals `pjax.nn.attention(q, k, v, q_pos, arange(S), ...)`.
    Returns [B, T, nh, hd] in q's dtype.
    """
    impl = _dispatch.resolve(implementation, auto_pallas=AUTO_PALLAS and pallas_supported(q, k))
    if impl == "xla":
        return reference.cache_attention(q, k, v, q_pos, scale=scale, window=window, sinks=sinks, kv_len=kv_len)
    from pjax.kernels.cache_attention import pallas
    return pallas.cache_attention(q, k, v, q_pos, scale=scale, window=window, sinks=sinks, kv_len=kv_len)
