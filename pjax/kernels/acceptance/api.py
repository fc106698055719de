"""Public entry point of speculative acceptance: `accept(..., implementation="xla"|"pallas"|"auto")`."""
from __future__ import annotations

import functools

import jax

from pjax.kernels import dispatch
from pjax.kernels.acceptance import reference
from pjax.kernels.acceptance.reference import AcceptResult


@functools.partial(jax.jit, static_argnames=("implementation",))
def accept(logits, draft_ids, draft_probs=None, *, temperature, top_k=None, top_p=None, seeds, positions,
           num_drafts=None, implementation: str = "auto") -> AcceptResult:
    """Chain speculative acceptance (greedy and stochastic rows in one call).

    logits [B, K+1, V] f32|bf16; draft_ids [B, K] i32 (target ids); draft_probs [B, K, V] or None (argmax
    drafts, q one-hot); temperature [B] f32 (<= 0: greedy row); top_k [B] i32 (0 = off) or None; top_p [B]
    f32 (1 = off) or None; seeds [B] u32; positions [B] i32 (absolute position of emitted index 0);
    num_drafts [B] i32 or None (= K). Returns AcceptResult(tokens [B, K+1] -1 padded, num_accepted [B],
    next_token [B]). Exact rule: `pjax.kernels.acceptance.reference`.
    implementation (`pjax.kernels.dispatch`): the kernels take every shape with K >= 1; K = 0 (a plain sample,
    nothing to fuse) always runs the reference. "auto" runs the kernels on a GPU.
    """
    if not dispatch.use_kernel(implementation, supported=draft_ids.shape[1] > 0, op="accept"):
        return reference.accept(logits, draft_ids, draft_probs, temperature=temperature, top_k=top_k, top_p=top_p,
                                seeds=seeds, positions=positions, num_drafts=num_drafts)
    from pjax.kernels.acceptance import pallas
    return pallas.accept(logits, draft_ids, draft_probs, temperature=temperature, top_k=top_k, top_p=top_p,
                         seeds=seeds, positions=positions, num_drafts=num_drafts)
