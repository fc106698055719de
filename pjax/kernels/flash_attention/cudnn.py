"""cuDNN fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`) for the masks its public API can
express: each row one causal sequence of a given length (padding after it), with or without a sliding window. JAX
0.10 and 0.11 take no segment ids, no per-query bounds and no sinks there, so packed documents, the drafter's
training layouts and GPT-OSS sinks run the Pallas kernel instead (`api.choose`)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pjax.kernels.flash_attention.mask import AttentionMask

__all__ = ["attention", "unsupported_reason"]

DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256  # Hopper; 128 before it (cuDNN's flash attention)


def unsupported_reason(q, k, mask: AttentionMask, sinks=None) -> Optional[str]:
    """Why cuDNN cannot compute this attention, or None when it can."""
    if mask.lengths is None:
        return "the mask is not one causal sequence per row (pjax.kernels.flash_attention.causal_mask)"
    if mask.has_chain or mask.q_offset is not None or not mask.keys_by_position:
        return "the mask has chain keys, window offsets or explicit key positions"
    if sinks is not None:
        return "attention sinks are not supported by cuDNN"
    if q.shape[1] != k.shape[1]:
        return f"queries ({q.shape[1]}) and keys ({k.shape[1]}) must be the same row"
    if not any(q.dtype == d for d in DTYPES) or k.dtype != q.dtype:
        return f"cuDNN takes bfloat16 / float16 inputs, found q {q.dtype}, k {k.dtype}"
    hd = q.shape[-1]
    if hd % 8 or hd > MAX_HEAD_DIM:
        return f"head_dim {hd} must be a multiple of 8 and <= {MAX_HEAD_DIM}"
    return None


def attention(q, k, v, mask: AttentionMask, *, scale: float, window: Optional[int] = None):
    """q [B, T, nh, hd]; k, v [B, T, nkv, hd]; mask from `causal_mask` (its `lengths` [B]). Returns [B, T, nh, hd]
    (rows past a row's length: zeros)."""
    lengths = jnp.asarray(mask.lengths, jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
                                        key_value_seq_lengths=lengths,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="cudnn")
