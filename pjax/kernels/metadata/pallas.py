"""Pallas (Triton) kernel building every drafter input of a P-EAGLE round in one launch.

Why: the XLA path is a handful of tiny fusions (gather of the shifted verify tokens, selects, iota
adds) whose cost is launch latency, not bytes; one kernel writes all six outputs.
Bytes moved: reads B * (K + 4) int32, writes B * (5 S + K) int32-sized values (S = num_slots) -- under
10 KB even at B = 64, K = 11. Numerics: integer only; outputs equal the reference exactly.
Layout: one program per block of BB rows; each program handles a [BB, SP] tile (SP = next power of two
>= S), with masked gathers/stores (Triton needs power-of-two array shapes).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.metadata.config import DEFAULT, MetadataConfig
from pjax.kernels.metadata.reference import DraftInputs, check_inputs


def _kernel(na_ref, vt_ref, nt_ref, sp_ref, tok_ref, pos_ref, fr_ref, wp_ref, si_ref, val_ref, *, b, k, s, bb,
            sp, kp, mask_tok):
    rows = pl.program_id(0) * bb + jnp.arange(bb, dtype=jnp.int32)
    rmask = rows < b
    n = jnp.clip(pltriton.load(na_ref.at[rows], mask=rmask, other=0), 0, k)[:, None]
    nxt = pltriton.load(nt_ref.at[rows], mask=rmask, other=0)[:, None]
    start = pltriton.load(sp_ref.at[rows], mask=rmask, other=0)[:, None]
    j = jnp.arange(sp, dtype=jnp.int32)[None, :]
    r2 = jnp.broadcast_to(rows[:, None], (bb, sp))
    j2 = jnp.broadcast_to(j, (bb, sp))
    m2 = rmask[:, None] & (j2 < s)
    # not masked by j < n: independent of the loads above, so all loads are in flight together (one round trip)
    shifted = pltriton.load(vt_ref.at[r2, jnp.clip(j2 + 1, 0, k)], mask=m2, other=0)
    valid = j2 < n + k
    tokens = jnp.where(j2 < n, shifted, jnp.where(j2 == n, nxt, jnp.where(valid, mask_tok, 0)))
    positions = start + j2
    pltriton.store(tok_ref.at[r2, j2], tokens, mask=m2)
    pltriton.store(pos_ref.at[r2, j2], positions, mask=m2)
    pltriton.store(fr_ref.at[r2, j2], jnp.where(j2 <= n, j2, -1), mask=m2)
    pltriton.store(wp_ref.at[r2, j2], jnp.where(valid, positions, -1), mask=m2)
    pltriton.store(val_ref.at[r2, j2], valid, mask=m2)
    jk = jnp.broadcast_to(jnp.arange(kp, dtype=jnp.int32)[None, :], (bb, kp))
    rk = jnp.broadcast_to(rows[:, None], (bb, kp))
    pltriton.store(si_ref.at[rk, jk], n + jk, mask=rmask[:, None] & (jk < k))


def build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos, *, num_slots: int,
                       mask_token_id: Optional[int], config: MetadataConfig = DEFAULT,
                       interpret: Optional[bool] = None) -> DraftInputs:
    """Same contract as `pjax.kernels.metadata.reference.build_draft_inputs`. interpret: None = interpret mode
    off GPU."""
    b, k = check_inputs(num_accepted, verify_tokens, next_token, start_pos, num_slots)
    s = num_slots
    bb = min(config.rows_per_program, next_pow2(b))
    num_warps = config.warps_few_rows if bb < 8 else config.warps
    i32 = jnp.int32
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    out_shapes = [jax.ShapeDtypeStruct((b, s), i32)] * 4 + [jax.ShapeDtypeStruct((b, max(k, 1)), i32),
                                                              jax.ShapeDtypeStruct((b, s), jnp.bool_)]
    kern = functools.partial(_kernel, b=b, k=k, s=s, bb=bb, sp=next_pow2(s), kp=next_pow2(max(k, 1)),
                             mask_tok=0 if mask_token_id is None else int(mask_token_id))
    tok, pos, fr, wp, si, val = pl.pallas_call(
        kern, grid=(pl.cdiv(b, bb),), out_shape=out_shapes,
        in_specs=[full((b,)), full((b, k + 1)), full((b,)), full((b,))],
        out_specs=[full(o.shape) for o in out_shapes], name="pjax_draft_inputs",
        **call_kwargs(num_warps, 1, dispatch.interpret(interpret)),
    )(num_accepted.astype(i32), verify_tokens.astype(i32), next_token.astype(i32), start_pos.astype(i32))
    return DraftInputs(tok, pos, fr, wp, si[:, :k], val)
