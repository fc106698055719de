"""Public entry point: `attention(q, k, v, mask, ..., implementation="xla"|"pallas"|"cudnn"|"auto")`."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from pjax.kernels import dispatch
from pjax.kernels.flash_attention import cudnn, reference
from pjax.kernels.flash_attention.config import DEFAULT, FlashConfig
from pjax.kernels.flash_attention.mask import AttentionMask, query_bounds

__all__ = ["IMPLEMENTATIONS", "attention", "choose"]

IMPLEMENTATIONS = ("xla", "pallas", "cudnn", "auto")
OP = "flash_attention"


def choose(q, k, mask: AttentionMask, sinks=None, implementation: str = "auto") -> str:
    """'xla' | 'pallas' | 'cudnn' for these inputs.

    "pallas": the flash kernel where the mask's keys sit at their index (every training layout), else the reference;
    "cudnn": cuDNN, an error where it cannot express the mask (`cudnn.unsupported_reason`); "auto": on a GPU, cuDNN
    where it can, else the kernel where it can, else the reference; off a GPU the reference."""
    dispatch.check(implementation, IMPLEMENTATIONS, op=OP)
    if implementation == "cudnn":
        reason = cudnn.unsupported_reason(q, k, mask, sinks)
        if reason is not None:
            raise ValueError(f"{OP}: implementation='cudnn' cannot run this attention: {reason}")
        return "cudnn"
    if implementation == "auto" and dispatch.on_gpu() and cudnn.unsupported_reason(q, k, mask, sinks) is None:
        return "cudnn"
    return "pallas" if dispatch.use_kernel(implementation, supported=mask.keys_by_position, op=OP) else "xla"


def attention(q, k, v, mask: AttentionMask, *, scale: float, window: Optional[int] = None, sinks=None, chain_k=None,
              chain_v=None, implementation: str = "auto", config: FlashConfig = DEFAULT):
    """Grouped-query attention under a mask description (`pjax.kernels.flash_attention.mask`), differentiable.

    q [B, T, nh, hd]; k, v [B, S, nkv, hd] (the context keys); chain_k, chain_v [B, M, nkv, hd] (the keys the mask's
    chain part points into); window: the layer's sliding window or None; sinks [nh] or None (GPT-OSS). Returns
    [B, T, nh, hd] in q's dtype. The kernels take the context keys; chain keys (a few per query) and sinks are merged
    in through the kernel's log-sum-exp.
    """
    reference.check_inputs(q, k, v, mask, sinks, chain_k, chain_v, op=OP)
    impl = choose(q, k, mask, sinks, implementation)
    if impl == "xla":
        return reference.attention(q, k, v, mask, scale=scale, window=window, sinks=sinks, chain_k=chain_k,
                                   chain_v=chain_v)
    if impl == "cudnn":
        return cudnn.attention(q, k, v, mask, scale=scale, window=window)
    from pjax.kernels.flash_attention import pallas
    o, lse = pallas.flash_attention(q, k, v, *query_bounds(mask, window), scale=scale, config=config)
    if not mask.has_chain and sinks is None:
        return o
    parts = [(o.astype(jnp.float32), lse)]
    if mask.has_chain:
        parts.append(reference.chain_partial(q, mask, chain_k, chain_v, scale=scale))
    return reference.merge_partials(parts, sinks).astype(q.dtype)
