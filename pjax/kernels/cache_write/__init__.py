"""Writing new K/V into a KV cache in place (one launch for K and V)."""
from pjax.kernels.cache_write.api import cache_write

__all__ = ["cache_write"]
