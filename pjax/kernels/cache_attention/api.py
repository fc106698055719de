"""Public entry point: `cache_attention(..., implementation="xla"|"pallas"|"mosaic"|"auto")`."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from pjax.kernels import _dispatch
from pjax.kernels.cache_attention import reference

IMPLEMENTATIONS = ("xla", "pallas", "mosaic", "auto")
# H200 (JAX 0.11.2, 2026-11-22, device time from the profiler): the Triton kernel is 1.9-6.5x faster than XLA on
# all measured verify/draft shapes (docs/benchmarks.md section 2).
AUTO_PALLAS = True
MAX_QUERY_ROWS = 128  # T * nh / nkv rows held in one program; larger (prefill) stays on XLA
# The Mosaic kernel beats the Triton one where each program streams at least this many 128-key tiles (H200,
# 2026-11-22, JAX 0.11.2, whole op incl. merge, 88 query rows: 8 tiles per program (B=1 16K) 26.6 vs 27.3 us, GPT-OSS
# 96 rows 18.0 vs 19.3 us; 64 (B=8 16K) 136.2 vs 154.4 us; at 1K: 4 tiles (B=8) 18.2 vs 18.1 us, 1 tile (B=1) 10.6 vs
# 8.1 us).
MOSAIC_MIN_TILES = 8


def pallas_supported(q, k) -> bool:
    """The kernel keeps all T * g query rows of a KV head in one program: decode / verify / draft shapes."""
    t, nh, hd = q.shape[1:]
    return t * (nh // k.shape[2]) <= MAX_QUERY_ROWS and hd <= 256


def mosaic_preferred(q, k) -> bool:
    """The Mosaic kernel supports these inputs and its programs are long enough to beat the Triton kernel."""
    from pjax.kernels.cache_attention import mosaic, pallas
    if mosaic.unsupported_reason(q, k) is not None:
        return False
    b, s_len, nkv = k.shape[:3]
    tiles = -(-s_len // mosaic.BLOCK_K)
    return -(-tiles // pallas.num_splits(b, nkv, s_len, mosaic.BLOCK_K)) >= MOSAIC_MIN_TILES


def choose(q, k, implementation: str = "auto") -> str:
    """'xla' | 'pallas' | 'mosaic' for these shapes; 'auto' picks the fastest measured kernel on a GPU."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, found {implementation!r}")
    if implementation != "auto":
        return implementation
    from pjax.kernels.cache_attention import mosaic
    if _dispatch.pallas_gpu_available() and mosaic.available() and mosaic_preferred(q, k):
        return "mosaic"
    return _dispatch.resolve("auto", auto_pallas=AUTO_PALLAS and pallas_supported(q, k))


@functools.partial(jax.jit, static_argnames=("scale", "window", "implementation"))
def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    implementation: str = "auto"):
    """Attention of T new queries over a KV cache indexed by absolute position.

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T] absolute positions; kv_len [B] (keys at index
    >= kv_len hidden) or None; window (sliding window) or None; sinks [nh] or None. Visible: key index <=
    q_pos, > q_pos - window, < kv_len. Equals `pjax.nn.attention(q, k, v, q_pos, arange(S), ...)`.
    Returns [B, T, nh, hd] in q's dtype. "mosaic" (Hopper, JAX >= 0.11) raises for shapes it does not take.
    """
    impl = choose(q, k, implementation)
    kw = dict(scale=scale, window=window, sinks=sinks, kv_len=kv_len)
    if impl == "xla":
        return reference.cache_attention(q, k, v, q_pos, **kw)
    if impl == "mosaic":
        from pjax.kernels.cache_attention import mosaic
        return mosaic.cache_attention(q, k, v, q_pos, **kw)
    from pjax.kernels.cache_attention import pallas
    return pallas.cache_attention(q, k, v, q_pos, **kw)
