"""The packed layout of a batch's prefill: B right-padded sequences [B, S] concatenated in row order into one row,
each attending to its own tokens only (`pjax.kernels.flash_attention.document_mask`) and writing its K/V to its own
cache row. The target's prefill packs the prompts; the drafter's packs its prefill slots the same way."""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["pack_prompts"]


def pack_prompts(prompts, lengths, packed_len: int):
    """The prompts [B, Lp] i32 (right-padded; lengths [B] i32 >= 1) concatenated in row order into one row of
    packed_len >= sum(lengths) tokens. Returns (tokens [1, N] i32 (0 past the last prompt), positions [1, N] i32
    (restarting at 0 in each prompt; 0 past the last), segment [1, N] i32 (the prompt's row; -1 past the last
    prompt), rows [1, N] i32 (the segment clipped to [0, B): a cache row for every token), starts [B] i32 (the
    index of each prompt's first token)), N = packed_len."""
    b, lp = prompts.shape
    ends = jnp.cumsum(lengths).astype(jnp.int32)
    starts = ends - lengths
    i = jnp.arange(packed_len, dtype=jnp.int32)
    seg = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # B past the last prompt
    rows = jnp.minimum(seg, b - 1)
    real = seg < b
    pos = jnp.where(real, i - starts[rows], 0)
    tokens = jnp.where(real, prompts[rows, jnp.minimum(pos, lp - 1)], 0)
    return tokens[None], pos[None], jnp.where(real, seg, -1)[None], rows[None], starts
