"""Public entry point: `cache_attention(..., implementation="xla"|"pallas"|"mosaic"|"auto")`."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from pjax.kernels import dispatch
from pjax.kernels.cache_attention import reference
from pjax.kernels.cache_attention.config import DEFAULT, AttentionConfig
from pjax.kernels.cache_attention.mask import TreeMask

IMPLEMENTATIONS = ("xla", "pallas", "mosaic", "auto")  # dispatch.IMPLEMENTATIONS + this op's explicit "mosaic"


def pallas_supported(q, k, config: AttentionConfig = DEFAULT) -> bool:
    """The Triton kernel keeps all T * g query rows of a KV head in one program: decode / verify / draft shapes."""
    t, nh, hd = q.shape[1:]
    return t * (nh // k.shape[2]) <= config.max_query_rows and hd <= config.max_head_dim


def mosaic_preferred(q, k, config: AttentionConfig = DEFAULT) -> bool:
    """The Mosaic kernel supports these inputs and its programs are long enough to beat the Triton kernel."""
    from pjax.kernels.cache_attention import mosaic, pallas
    if mosaic.unsupported_reason(q, k, config=config) is not None:
        return False
    b, s_len, nkv = k.shape[:3]
    tiles = -(-s_len // config.mosaic_block_k)
    return -(-tiles // pallas.num_splits(b, nkv, s_len, config.mosaic_block_k)) >= config.mosaic_min_tiles


def tree_kernel_supported(q, window: Optional[int], has_kv_len: bool, config: AttentionConfig = DEFAULT) -> bool:
    """The Triton kernel takes a tree mask (its query blocks hold any number of rows) where its rule for the tree
    slots equals the reference's: no kv_len, and no sliding window that could hide an ancestor (window >= T)."""
    t, hd = q.shape[1], q.shape[3]
    return hd <= config.max_head_dim and not has_kv_len and (window is None or window >= t)


def choose(q, k, implementation: str = "auto", config: AttentionConfig = DEFAULT, tree: bool = False,
           window: Optional[int] = None, has_kv_len: bool = False) -> str:
    """'xla' | 'pallas' | 'mosaic' for these shapes. "pallas" falls back to 'xla' past the Triton kernel's rows
    (`pallas_supported`; under a tree mask `tree_kernel_supported`); "auto" picks the fastest measured kernel on a
    GPU (Mosaic on Hopper for long programs of 65..128 rows without a tree, else Triton where it takes the shape),
    'xla' off GPU; "mosaic" is taken as asked (an error under a tree mask)."""
    dispatch.check(implementation, IMPLEMENTATIONS, op="cache_attention")
    if implementation == "mosaic":
        if tree:
            raise ValueError("cache_attention: implementation='mosaic' takes no tree mask (use 'pallas' or 'auto')")
        return "mosaic"
    if tree:
        supported = tree_kernel_supported(q, window, has_kv_len, config)
    else:
        if implementation == "auto" and dispatch.on_gpu() and not dispatch.on_mesh():
            from pjax.kernels.cache_attention import mosaic
            if mosaic.available() and mosaic_preferred(q, k, config):
                return "mosaic"
        supported = pallas_supported(q, k, config)
    return "pallas" if dispatch.use_kernel(implementation, supported=supported, op="cache_attention") else "xla"


@functools.partial(jax.jit, static_argnames=("scale", "window", "implementation"))
def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    tree: Optional[TreeMask] = None, implementation: str = "auto"):
    """Attention of T new queries over a KV cache indexed by absolute position.

    q [B, T, nh, hd]; k, v [B, S, nkv, hd]; q_pos [B, T] absolute positions; kv_len [B] (keys at index
    >= kv_len hidden) or None; window (sliding window) or None; sinks [nh] or None. Visible: key index <=
    q_pos, > q_pos - window, < kv_len. Equals `reference.attention(q, k, v, q_pos, arange(S), ...)`.
    tree: None, or a `TreeMask`: the queries are nodes of a draft tree at the M slots tree.start..+M-1 (M = T: all of
    them, in order), each seeing the committed keys before tree.start by the rule above and its ancestors among the
    tree slots (`mask.tree_visible`); the Triton kernel runs it where `tree_kernel_supported`, else the reference.
    Returns [B, T, nh, hd] in q's dtype.
    implementation (`pjax.kernels.dispatch`, see `choose`): "pallas" runs the Triton kernel for up to
    `AttentionConfig.max_query_rows` (128) query rows per KV head (T * nh / nkv) and head_dim <= 256, the reference
    past that (prefill); "mosaic" (Hopper, bf16 / f16, 65..128 rows) raises ValueError for shapes it does not take.
    """
    impl = choose(q, k, implementation, tree=tree is not None, window=window, has_kv_len=kv_len is not None)
    kw = dict(scale=scale, window=window, sinks=sinks, kv_len=kv_len)
    if impl == "xla":
        return reference.cache_attention(q, k, v, q_pos, tree=tree, **kw)
    if impl == "mosaic":
        from pjax.kernels.cache_attention import mosaic
        return mosaic.cache_attention(q, k, v, q_pos, **kw)
    from pjax.kernels.cache_attention import pallas
    if tree is not None:
        kw.update(tree_start=tree.start, tree_visible=tree.visible)
    return pallas.cache_attention(q, k, v, q_pos, **kw)
