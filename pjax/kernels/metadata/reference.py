"""jnp reference of the drafter-input metadata of one parallel-drafting (P-EAGLE) round.

Row b with n = num_accepted[b] accepted drafts, verify tokens t_0..t_K at absolute positions
start_pos[b] + 0..K, recovered/bonus token `next_token[b]`. Slot j (0 <= j < S = num_slots):
- j < n:            token t_{j+1},      feature row j  (target feature of verify position j)
- j == n:           token next_token,   feature row n
- n < j < n + K:    token mask_token,   feature row -1 (the precomputed mask feature)
- j >= n + K:       padding: token 0, feature row -1, valid False, write_pos -1.
positions[b, j] = start_pos[b] + j for every slot; write_pos = positions on valid slots, else -1;
sample_idx[b] = n .. n+K-1 (the slots whose drafter output gives the K new drafts).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class DraftInputs(NamedTuple):
    tokens: jax.Array  # [B, S] i32
    positions: jax.Array  # [B, S] i32
    feature_row: jax.Array  # [B, S] i32 index into the K+1 verify feature rows, -1 = mask feature
    write_pos: jax.Array  # [B, S] i32 KV write position, -1 = no write
    sample_idx: jax.Array  # [B, K] i32
    valid: jax.Array  # [B, S] bool


def check_inputs(num_accepted, verify_tokens, next_token, start_pos, num_slots):
    """Returns (B, K); raises ValueError naming the offending argument."""
    if verify_tokens.ndim != 2:
        raise ValueError(f"build_draft_inputs: verify_tokens must be [B, K+1], found {verify_tokens.shape}")
    b, k1 = verify_tokens.shape
    k = k1 - 1
    for name, arr in (("num_accepted", num_accepted), ("next_token", next_token), ("start_pos", start_pos)):
        if tuple(jnp.shape(arr)) != (b,):
            raise ValueError(f"build_draft_inputs: {name} must have shape ({b},), found {tuple(jnp.shape(arr))}")
    if num_slots < 2 * k:
        raise ValueError(f"build_draft_inputs: num_slots={num_slots} must be >= 2K = {2 * k}")
    return b, k


def build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos, *, num_slots: int,
                       mask_token_id: Optional[int]) -> DraftInputs:
    b, k = check_inputs(num_accepted, verify_tokens, next_token, start_pos, num_slots)
    mask_tok = 0 if mask_token_id is None else int(mask_token_id)
    n = jnp.clip(num_accepted.astype(jnp.int32), 0, k)[:, None]
    j = jnp.arange(num_slots, dtype=jnp.int32)[None]
    vt = verify_tokens.astype(jnp.int32)
    shifted = jnp.take_along_axis(vt, jnp.clip(j + 1, 0, k), axis=1) if k > 0 else jnp.zeros((b, num_slots), jnp.int32)
    valid = j < n + k
    tokens = jnp.where(j < n, shifted, jnp.where(j == n, next_token.astype(jnp.int32)[:, None],
                                                 jnp.where(valid, mask_tok, 0)))
    positions = start_pos.astype(jnp.int32)[:, None] + j
    feature_row = jnp.where(j <= n, j, -1)
    write_pos = jnp.where(valid, positions, -1)
    sample_idx = n + jnp.arange(k, dtype=jnp.int32)[None]
    return DraftInputs(tokens.astype(jnp.int32), positions, feature_row.astype(jnp.int32),
                       write_pos.astype(jnp.int32), sample_idx.astype(jnp.int32), valid)
