"""Public entry point: `build_draft_inputs(..., implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools
from typing import Optional

import jax

from pjax.kernels import dispatch
from pjax.kernels.metadata import reference
from pjax.kernels.metadata.reference import DraftInputs


@functools.partial(jax.jit, static_argnames=("num_slots", "mask_token_id", "implementation"))
def build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos, *, num_slots: int,
                       mask_token_id: Optional[int], implementation: str = "auto") -> DraftInputs:
    """Drafter inputs of a parallel-drafting round.

    num_accepted [B] i32, verify_tokens [B, K+1] i32, next_token [B] i32, start_pos [B] i32 (absolute
    position of verify_tokens[:, 0]) -> DraftInputs(tokens, positions, feature_row, write_pos [B, S] i32,
    sample_idx [B, K] i32, valid [B, S] bool), S = num_slots >= 2K. Slot layout:
    `pjax.kernels.metadata.reference`. implementation (`pjax.kernels.dispatch`): the kernel takes every shape;
    "auto" runs it on a GPU (one launch instead of XLA's several small fusions).
    """
    if not dispatch.use_kernel(implementation, op="build_draft_inputs"):
        return reference.build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos,
                                            num_slots=num_slots, mask_token_id=mask_token_id)
    from pjax.kernels.metadata import pallas
    return pallas.build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos, num_slots=num_slots,
                                     mask_token_id=mask_token_id)
