"""Attention over the KV cache for verify (K+1 queries) and parallel drafting (2K queries): GQA,
bottom-right causal by absolute position, sliding windows, sinks, per-row lengths, split over the KV
length (flash-decoding); and a draft tree's nodes under a `TreeMask`. See `pallas` for why the
kernel exists, bytes moved and numerics."""
from pjax.kernels.cache_attention.api import cache_attention
from pjax.kernels.cache_attention.mask import TreeMask

__all__ = ["TreeMask", "cache_attention"]
