"""EAGLE-3 training-time test (TTT) objective, so an EAGLE-3 head trains in the same pipeline.

Step 0 is a plain causal pass over the shifted row (token x_{p+1}, combined feature g_p, position p).
Step t >= 1 feeds the previous step's output state (pre-norm; normed with `norm_output`) with the
teacher-forced tokens shifted left by t (zero padded) at positions p + t; every step-t query attends to
the step-0 keys causally inside its document plus its own keys of steps 1..t (the diagonal blocks of
speculators `extend_mask_for_draft_tokens`): `pjax.train.masks.ttt_mask`, with the earlier steps' K/V handed to
every layer explicitly (`pjax.models.attention.StepKV`, threaded through the passes like a KV cache).
Step t's logits at p are scored against the target distribution at p + t (loss mask l_{p+t+1}); loss = sum_t
decay**t * masked mean (speculators `Eagle3DraftModel.forward` / `compute_metrics`). Embeddings get no gradient
(speculators embeds under no_grad).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pjax.models.attention import init_step_kv
from pjax.models.drafter import Drafter, combine, drafter_forward
from pjax.models.target import Target
from pjax.train.losses import LOSS_EPS, vocab_terms
from pjax.train.masks import ttt_mask


def _shift_left(x, t, fill=0):
    if t == 0:
        return x
    pad = jnp.full((t,) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([x[t:], pad], axis=0)


def eagle3_row_loss(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last, loss_mask,
                    document_ids, *, ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0, loss_type: str = "kl",
                    attn_chunk=None, loss_chunk=None, implementation: str = "auto"):
    """(loss, metrics) of one shifted row: input_ids, loss_mask, document_ids [S]; hidden_states
    [S, A*Ht]; verifier_last [S, Ht]. metrics: correct/total [ttt_steps] (full accuracy per step),
    cond_correct/cond_total [ttt_steps] (accuracy given all earlier steps correct). attn_chunk / loss_chunk:
    query / element chunk sizes (None = automatic); implementation: the drafter attention's kernel switch."""
    s = input_ids.shape[0]
    params = dict(drafter.params)
    params["embed_tokens"] = jax.tree.map(jax.lax.stop_gradient, params["embed_tokens"])
    drafter = Drafter(drafter.config, drafter.graphdef, params, drafter.d2t)
    lm = jnp.asarray(loss_mask, jnp.float32)
    h = combine(drafter, hidden_states)
    ids = jnp.asarray(input_ids, jnp.int32)
    pos = jnp.arange(s, dtype=jnp.int32)
    history = init_step_kv(drafter.config.layer, 1, ttt_steps, s, h.dtype)
    chain = lm > 0
    total = jnp.zeros((), jnp.float32)
    corr, tot, ccorr, ctot = [], [], [], []
    for t in range(ttt_steps):
        normed, prenorm, history = drafter_forward(drafter, ids[None], h[None], (pos + t)[None], history,
                                                   mask=ttt_mask(document_ids, t, ttt_steps, attn_chunk),
                                                   implementation=implementation)
        # step t at p is scored against the target at p + t; rows past the end carry no loss (lm_t = 0)
        loss_el, correct = vocab_terms(drafter, target, normed[0], verifier_last, jnp.minimum(pos + t, s - 1),
                                       loss_type=loss_type, loss_chunk=loss_chunk)
        lm_t = _shift_left(lm, t)
        total = total + jnp.sum(loss_el * lm_t) * (ttt_step_loss_decay ** t) / (jnp.sum(lm_t) + LOSS_EPS)
        ok = lm_t > 0
        corr.append(jnp.sum(correct & ok).astype(jnp.float32))
        tot.append(jnp.sum(ok).astype(jnp.float32))
        live = chain & (pos < s - t)
        ctot.append(jnp.sum(live).astype(jnp.float32))
        chain = live & correct
        ccorr.append(jnp.sum(chain & ok).astype(jnp.float32))
        h = (normed if drafter.config.norm_output else prenorm)[0]
        ids = _shift_left(jnp.asarray(input_ids, jnp.int32), t + 1)
    metrics = dict(correct=jnp.stack(corr), total=jnp.stack(tot), cond_correct=jnp.stack(ccorr),
                   cond_total=jnp.stack(ctot), weight_sum=jnp.sum(lm))
    return total, metrics


def eagle3_loss(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last_hidden_states, loss_mask,
                document_ids, **kwargs):
    """Scalar EAGLE-3 TTT loss of one packed row with speculators' shapes ([1, S] rows after the
    shift; hidden_states [1, S, A*Ht]; verifier_last_hidden_states [1, S, Ht]). kwargs: ttt_steps,
    ttt_step_loss_decay, loss_type, attn_chunk, loss_chunk, implementation."""
    sq = lambda x: jnp.asarray(x)[0]  # noqa: E731
    return eagle3_row_loss(drafter, target, sq(input_ids), sq(hidden_states), sq(verifier_last_hidden_states),
                           sq(loss_mask), sq(document_ids), **kwargs)[0]
