"""EAGLE-3 training-time test (TTT) objective, so an EAGLE-3 head trains in the same pipeline.

Step 0 is a plain causal pass over the shifted row (token x_{p+1}, combined feature g_p, position p).
Step t >= 1 feeds the previous step's output state (pre-norm; normed with `norm_output`) with the
teacher-forced tokens shifted left by t (zero padded) at positions p + t; every step-t query attends to
the step-0 keys causally inside its document plus its own keys of steps 1..t (the diagonal blocks of
speculators `extend_mask_for_draft_tokens`). Step t's logits at p are scored against the target
distribution at p + t (loss mask l_{p+t+1}); loss = sum_t decay**t * masked mean (speculators
`Eagle3DraftModel.forward` / `compute_metrics`). Embeddings get no gradient (speculators embeds
under no_grad).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pjax.models.drafter import Drafter, combine, drafter_forward
from pjax.kernels.cache_attention.reference import MASK_VALUE
from pjax.models.target import Target
from pjax.train.masks import _auto_chunk, _chunked
from pjax.train.losses import LOSS_EPS, _target_logits, element_terms, target_draft_head


class TTTMask:
    """Structured mask for one TTT forward sequence. Stateful at trace time: the k/v of every
    layer call are remembered so step t sees steps 0..t (calls arrive layer by layer, step by step).
    Use one instance per row and per loss evaluation."""

    def __init__(self, document_ids, num_layers: int, chunk=None):
        self.document_ids = jnp.asarray(document_ids, jnp.int32)
        self.num_layers = num_layers
        self.chunk = chunk
        self.history = [[] for _ in range(num_layers)]
        self.calls = 0

    def attend(self, q, k, v, *, scale, window=None, sinks=None):
        if sinks is not None:
            raise NotImplementedError("attention sinks are not supported in drafter training")
        layer = self.calls % self.num_layers
        self.calls += 1
        hist = self.history[layer]
        hist.append((k, v))
        k0, v0 = hist[0]
        b, s, nh, hd = q.shape
        nkv = k.shape[2]
        g = nh // nkv
        doc = self.document_ids
        kv_idx = jnp.arange(s)
        kd = jnp.stack([h[0] for h in hist[1:]], axis=2) if len(hist) > 1 else None  # [b, s, t, nkv, hd]
        vd = jnp.stack([h[1] for h in hist[1:]], axis=2) if len(hist) > 1 else None

        def chunk_fn(qc, qi):
            c = qc.shape[0]
            qg = jnp.moveaxis(qc, 0, 1).reshape(b, c, nkv, g, hd)
            sa = jnp.einsum("bckgd,bskd->bkgcs", qg, k0, preferred_element_type=jnp.float32) * scale
            dq = doc[qi]
            vis = (kv_idx[None, :] <= qi[:, None]) & (doc[None, :] == dq[:, None]) & (dq[:, None] != -1)
            if window is not None:
                vis &= kv_idx[None, :] > qi[:, None] - window
            vis |= kv_idx[None, :] == qi[:, None]
            sa = jnp.where(vis[None, None, None], sa, MASK_VALUE)
            m = jnp.max(sa, -1, keepdims=True)
            if kd is not None:
                kc, vc = kd[:, qi], vd[:, qi]  # [b, c, t, nkv, hd]
                sb = jnp.einsum("bckgd,bctkd->bkgct", qg, kc, preferred_element_type=jnp.float32) * scale
                m = jnp.maximum(m, jnp.max(sb, -1, keepdims=True))
            pa = jnp.exp(sa - m)
            den = jnp.sum(pa, -1, keepdims=True)
            if kd is not None:
                pb = jnp.exp(sb - m)
                den = den + jnp.sum(pb, -1, keepdims=True)
            out = jnp.einsum("bkgcs,bskd->bckgd", (pa / den).astype(v.dtype), v0, preferred_element_type=jnp.float32)
            if kd is not None:
                out += jnp.einsum("bkgct,bctkd->bckgd", (pb / den).astype(v.dtype), vc,
                                  preferred_element_type=jnp.float32)
            return jnp.moveaxis(out.reshape(b, c, nh, hd), 1, 0)

        c = _auto_chunk(s, s, nh, self.chunk)
        out = _chunked(chunk_fn, (jnp.moveaxis(q, 1, 0), jnp.arange(s)), s, c)
        return jnp.moveaxis(out, 0, 1).astype(q.dtype)


def _shift_left(x, t, fill=0):
    if t == 0:
        return x
    pad = jnp.full((t,) + x.shape[1:], fill, x.dtype)
    return jnp.concatenate([x[t:], pad], axis=0)


def eagle3_row_loss(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last, loss_mask,
                    document_ids, *, ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0, loss_type: str = "kl",
                    attn_chunk=None):
    """(loss, metrics) of one shifted row: input_ids, loss_mask, document_ids [S]; hidden_states
    [S, A*Ht]; verifier_last [S, Ht]. metrics: correct/total [ttt_steps] (full accuracy per step),
    cond_correct/cond_total [ttt_steps] (accuracy given all earlier steps correct)."""
    s = input_ids.shape[0]
    params = dict(drafter.params)
    params["embed_tokens"] = jax.tree.map(jax.lax.stop_gradient, params["embed_tokens"])
    drafter = Drafter(drafter.config, drafter.graphdef, params, drafter.d2t)
    norm, w = target_draft_head(target, drafter)
    tlogits = _target_logits(target, norm, w, verifier_last)  # [S, Vd]
    lm = jnp.asarray(loss_mask, jnp.float32)
    h = combine(drafter, hidden_states)
    ids = jnp.asarray(input_ids, jnp.int32)
    pos = jnp.arange(s, dtype=jnp.int32)
    tmask = TTTMask(document_ids, len(drafter.config.layer.layers), attn_chunk)
    chain = lm > 0
    total = jnp.zeros((), jnp.float32)
    corr, tot, ccorr, ctot = [], [], [], []
    lmk = drafter.params["lm_head"]["kernel"]
    for t in range(ttt_steps):
        normed, prenorm, _ = drafter_forward(drafter, ids[None], h[None], (pos + t)[None], mask=tmask)
        logits = jnp.einsum("sh,hv->sv", normed[0], lmk, preferred_element_type=jnp.float32)
        lm_t = _shift_left(lm, t)
        loss_el, correct = element_terms(logits, _shift_left(tlogits, t), loss_type)
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
    ttt_step_loss_decay, loss_type, attn_chunk."""
    sq = lambda x: jnp.asarray(x)[0]  # noqa: E731
    return eagle3_row_loss(drafter, target, sq(input_ids), sq(hidden_states), sq(verifier_last_hidden_states),
                           sq(loss_mask), sq(document_ids), **kwargs)[0]
