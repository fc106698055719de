"""Attention over the KV cache for verify (K+1 queries) and parallel drafting (2K queries): GQA,
bottom-right causal by absolute position, sliding windows, sinks, per-row lengths, split over the KV
length (flash-decoding). See `pallas` for why the kernel exists, bytes moved and numerics."""
from pjax.kernels.cache_attention.api import cache_attention

__all__ = ["cache_attention"]
