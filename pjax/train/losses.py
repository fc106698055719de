"""P-EAGLE training loss (spec D.2 / D.4) over an explicit COD layout.

Targets: softmax over the draft vocabulary of the frozen target's head applied to the final pre-norm
state, `lm_head(norm(y_r))` restricted to the draft ids (`arange(Vd) + d2t`). Default loss: forward
KL(p_target || q_draft) per element, weighted by loss_mask[r] (r = anchor + depth), summed over all
depths and divided by (sum of weights + 1e-5). "ce" uses the target argmax as a hard label.
Metrics: per-depth top-1 agreement counts (draft argmax == target argmax, loss-masked), and per-anchor chains
(`anchor_grid` -> `chain_metrics`): each depth's agreement given the anchor's earlier depths agree, as acceptance
at decode time requires.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pjax.kernels.flash_attention.chunking import chunk_size, chunked_map
from pjax.kernels.rows import take_rows
from pjax.models.drafter import (Drafter, combine, draft_logits_from_hidden, draft_to_target, drafter_forward,
                                 no_parallel_reason)
from pjax.models.layers import head_logits
from pjax.models.target import Target
from pjax.train.cod import CodLayout, layout_from_arrays
from pjax.train.masks import chain_slots, cod_mask

__all__ = ["LOSS_TYPES", "anchor_grid", "chain_metrics", "cod_hidden", "cod_inputs", "depth_metrics", "draft_logits",
           "drafter_states", "element_terms", "peagle_loss", "peagle_loss_and_metrics", "row_loss_terms",
           "vocab_terms"]

LOSS_EPS = 1e-5
LOSS_TYPES = ("kl", "ce")
DEFAULT_LOSS_CHUNK_ELEMENTS = 1 << 25  # float32 logits of one element chunk (elements x vocabulary): 128 MiB


def with_params(drafter: Drafter, params) -> Drafter:
    return Drafter(drafter.config, drafter.graphdef, params, drafter.d2t)


def cast_drafter(drafter: Drafter, dtype) -> Drafter:
    """Floating params and the layers' compute dtype cast to `dtype` (mixed precision: f32 master weights, bf16
    compute; casting the params alone would leave the layers computing in float32)."""
    return drafter if dtype is None else drafter.astype(dtype)


def target_draft_head(target: Target, drafter: Drafter):
    """(norm module, W [H, Vd]): the target's final norm and its head columns for the draft vocabulary."""
    tm = target.module
    ids = draft_to_target(drafter, jnp.arange(drafter.config.draft_vocab_size, dtype=jnp.int32))
    return tm.norm, jax.lax.stop_gradient(tm.head_weight()[:, ids])


def target_logits(target: Target, norm, w, y):
    """The target's draft-vocabulary logits (float32 [..., Vd], soft-capped, gradient-stopped) of final pre-norm
    states y [..., Ht], from `target_draft_head`'s (norm, w)."""
    return jax.lax.stop_gradient(head_logits(norm(y.astype(w.dtype)), w, target.config.final_logit_softcap))


def element_terms(logits, tlogits, loss_type: str = "kl"):
    """Per-element loss [N] and top-1 agreement [N] from draft / target logits [N, Vd] (float32)."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tlogits = tlogits.astype(jnp.float32)
    tgt = jnp.argmax(tlogits, axis=-1)
    if loss_type == "kl":
        logp = jax.nn.log_softmax(tlogits, axis=-1)
        p = jnp.exp(logp)
        loss = jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)
    elif loss_type == "ce":
        loss = -jnp.take_along_axis(logq, tgt[:, None], axis=-1)[:, 0]
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    return loss, jnp.argmax(logits, axis=-1) == tgt


def cod_inputs(drafter: Drafter, input_ids, hidden_states, layout: CodLayout, *, require_mask: bool = True):
    """Tokens [N], combined features [N, H], positions [N] of the COD elements of one row
    (input_ids [S], hidden_states [S, A*Ht]): depth 0 takes the real token and feature at r,
    depth >= 1 the mask token and mask_hidden. require_mask=False lets a head without them (EAGLE-3) run a
    depth-0-only layout. `combine` is row-wise, so it runs on the S rows (and mask_hidden once) before the N
    elements gather its [S, H] output: no [N, A*Ht] feature tensor."""
    cfg = drafter.config
    a, d = layout.anchor_pos, layout.depth
    r = a + d
    real = d == 0
    tokens = input_ids[r]
    feats = take_rows(combine(drafter, hidden_states), r)
    if no_parallel_reason(cfg):
        if not require_mask:
            return tokens.astype(jnp.int32), feats, r.astype(jnp.int32)
        raise ValueError(f"P-EAGLE training needs a head with mask_hidden and a mask_token_id; this {cfg.model_kind} "
                         f"head has mask_hidden={cfg.has_mask_hidden}, mask_token_id={cfg.mask_token_id} "
                         "(train EAGLE-3 heads with the eagle3 objective)")
    mh = combine(drafter, drafter.params["mask_hidden"].reshape(1, -1).astype(hidden_states.dtype))
    feats = jnp.where(real[:, None], feats, mh)
    tokens = jnp.where(real, tokens, jnp.asarray(cfg.mask_token_id, tokens.dtype))
    return tokens.astype(jnp.int32), feats, r.astype(jnp.int32)


def drafter_states(drafter: Drafter, tokens, hidden_in, positions, mask, *, remat: bool = False,
                   implementation: str = "auto"):
    """Normed drafter states [B, T, H] of a training forward (`drafter_forward` without a cache): tokens, positions
    [B, T], hidden_in [B, T, H] (combined features), mask an `AttentionMask`.

    remat: the layers run as a loop over the layer index whose body switches to that layer's program and is
    rematerialised in the backward pass: only each layer's input ([B, T, H]) is stored, not its attention and MLP
    intermediates ([B, T, intermediate] several times per layer), and the backward recomputes one layer at a time (a
    loop body cannot be merged with the forward's values or hoisted next to the other layers' recomputations, which
    XLA does to an unrolled sequence of checkpoints)."""
    if not remat:
        return drafter_forward(drafter, tokens, hidden_in, positions, mask=mask, implementation=implementation)[0]
    module = drafter.module
    graphdefs, states = zip(*(nnx.split(layer) for layer in module.layers))
    e = module.embed(tokens)

    def branch(i):
        def run(states, e, h):
            xs = (e, h) if i == 0 else (h,)
            return nnx.merge(graphdefs[i], states[i])(*xs, positions, None, mask=mask,
                                                       implementation=implementation)[0]
        return run

    branches = [branch(i) for i in range(len(graphdefs))]

    @jax.checkpoint
    def body(h, i):
        return jax.lax.switch(i, branches, states, e, h), None

    h, _ = jax.lax.scan(body, hidden_in.astype(e.dtype), jnp.arange(len(branches)))
    return module.norm(h)


def cod_hidden(drafter: Drafter, input_ids, hidden_states, document_ids, layout: CodLayout, *, num_depths: int,
               num_depth0: Optional[int] = None, attn_chunk=None, chain_slots: Optional[int] = None,
               require_mask: bool = True, remat: bool = False, implementation: str = "auto"):
    """Normed drafter states [N, H] of the COD elements of one row (arrays [S] / [S, A*Ht]) under `cod_mask` (the
    layout's first num_depth0 elements, default S, are its depth-0 prefix; chain_slots: see `cod_mask`).
    remat: rematerialise each draft layer in the backward pass (`drafter_states`); implementation: the kernel switch
    of the drafter's attention ("xla" | "pallas" | "auto")."""
    tokens, f, pos = cod_inputs(drafter, input_ids, hidden_states, layout, require_mask=require_mask)
    s = input_ids.shape[0]
    mask = cod_mask(layout, document_ids, num_depths, s if num_depth0 is None else num_depth0, attn_chunk,
                    chain_slots)
    return drafter_states(drafter, tokens[None], f[None], pos[None], mask, remat=remat,
                          implementation=implementation)[0]


def vocab_terms(drafter: Drafter, target: Target, normed, verifier_last, ref, *, loss_type="kl", loss_chunk=None):
    """Per-element (loss [N], correct [N]) of normed drafter states [N, H] against the target's distribution from its
    final pre-norm states verifier_last [S, Ht] at rows ref [N] (`element_terms`). Computed over element chunks of at
    most DEFAULT_LOSS_CHUNK_ELEMENTS logits (loss_chunk elements when given), each rematerialised in the backward
    pass: no [N, Vd] float32 tensor is ever whole."""
    norm, w = target_draft_head(target, drafter)
    lm = drafter.params["lm_head"]["kernel"]
    verifier_last = jnp.asarray(verifier_last)

    def fn(x):
        return element_terms(head_logits(x["h"], lm), target_logits(target, norm, w, verifier_last[x["r"]]),
                             loss_type)

    n = normed.shape[0]
    return chunked_map(fn, dict(h=normed, r=ref), chunk_size(n, lm.shape[-1], DEFAULT_LOSS_CHUNK_ELEMENTS, loss_chunk))


def row_loss_terms(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last, loss_mask,
                   document_ids, layout: CodLayout, *, num_depths: int, num_depth0=None, loss_type="kl",
                   attn_chunk=None, loss_chunk=None, remat: bool = False, implementation: str = "auto"):
    """Per-element (loss [N], correct [N], weight [N]) for one row; weight = loss_mask[r] * valid. remat: see
    `cod_hidden`."""
    normed = cod_hidden(drafter, input_ids, hidden_states, document_ids, layout, num_depths=num_depths,
                        num_depth0=num_depth0, attn_chunk=attn_chunk, remat=remat, implementation=implementation)
    ref = layout.anchor_pos + layout.depth
    loss, correct = vocab_terms(drafter, target, normed, verifier_last, ref, loss_type=loss_type,
                                loss_chunk=loss_chunk)
    weight = jnp.asarray(loss_mask, jnp.float32)[ref] * layout.valid.astype(jnp.float32)
    return loss, correct, weight


def depth_metrics(correct, weight, depth, num_depths: int):
    """Per-depth (correct counts [K], totals [K]) of supervised elements."""
    c = jax.ops.segment_sum(correct.astype(jnp.float32) * weight, depth, num_segments=num_depths)
    t = jax.ops.segment_sum(weight, depth, num_segments=num_depths)
    return c, t


def anchor_grid(correct, weight, anchor_pos, depth, seq_len: int, num_depths: int):
    """One row's supervised elements (correct, weight, anchor_pos, depth [N]) placed by (anchor, depth) as int32
    grids (supervised [S, K], wrong [S, K]): supervised = an element there has weight > 0, wrong = such an element's
    draft disagrees with the target. Elements of weight 0 or with an anchor outside [0, S) are left out. Grids of
    disjoint element sets (the segments of a partitioned step) add up to the whole row's: an entry > 0 is set."""
    k = num_depths
    sup = (weight > 0) & (anchor_pos >= 0) & (anchor_pos < seq_len)
    flat = jnp.where(sup, anchor_pos * k + depth, seq_len * k)  # past the end: dropped

    def put(v):
        grid = jnp.zeros((seq_len * k,), jnp.int32).at[flat].max(v.astype(jnp.int32), mode="drop")
        return grid.reshape(seq_len, k)

    return put(sup), put(sup & ~correct)


def chain_metrics(supervised, wrong):
    """(cond_correct, cond_total, chain_total) float32 [K] of `anchor_grid`s [..., S, K], summed over the anchors and
    every leading axis. Over the anchors whose depths 0..d are all supervised: chain_total[d] counts them,
    cond_total[d] those whose depths 0..d-1 are right, cond_correct[d] those whose depths 0..d are right. So
    cond_correct / cond_total is depth d's accuracy given the earlier depths right (EAGLE-3's cond_acc) and
    cond_correct / chain_total the whole chain's (what acceptance of d + 1 drafts estimates)."""
    sup = supervised > 0
    k = sup.shape[-1]
    full = jnp.cumprod(sup.astype(jnp.int32), axis=-1) > 0
    right = jnp.cumprod((sup & (wrong == 0)).astype(jnp.int32), axis=-1) > 0  # implies full
    before = jnp.concatenate([jnp.ones_like(right[..., :1]), right[..., :-1]], axis=-1)

    def count(x):
        return jnp.sum(x.reshape(-1, k).astype(jnp.float32), axis=0)

    return count(right), count(full & before), count(full)


def _row(x, name, trailing):
    x = jnp.asarray(x)
    if x.ndim == trailing + 2 and x.shape[0] == 1:
        return x[0]
    if x.ndim != trailing + 1:
        raise ValueError(f"{name}: expected shape [1, S{', ...' if trailing else ''}] or [S...], got {x.shape}")
    return x


def _num_depths(depth, num_depths):
    if num_depths is not None:
        return int(num_depths)
    if isinstance(depth, jax.core.Tracer):
        raise ValueError("num_depths must be given when depth is traced")
    return int(np.max(np.asarray(depth))) + 1


def _check_prefix(anchor_pos, depth, s):
    """Concrete layouts must start with the S depth-0 elements at anchors 0..S-1 (speculators order)."""
    if isinstance(anchor_pos, jax.core.Tracer) or isinstance(depth, jax.core.Tracer):
        return
    a, d = np.asarray(anchor_pos), np.asarray(depth)
    if a.shape[0] < s or not (np.array_equal(a[:s], np.arange(s)) and not d[:s].any()):
        raise ValueError(f"layout must begin with the {s} depth-0 elements at anchors 0..{s - 1} (as speculators' "
                         f"generate_cod_sample_indices emits); got anchors {a[:8].tolist()}... depths {d[:8].tolist()}...")


def peagle_loss_and_metrics(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last_hidden_states,
                            loss_mask, document_ids, anchor_pos, depth, *, valid=None, num_depths=None,
                            loss_type="kl", attn_chunk=None, loss_chunk=None, implementation: str = "auto"):
    """(loss, metrics) with metrics = dict(correct [K], total [K], cond_correct [K], cond_total [K], chain_total [K],
    weight_sum) — see `peagle_loss`, `depth_metrics`, `chain_metrics`."""
    ids, hs = _row(input_ids, "input_ids", 0), _row(hidden_states, "hidden_states", 1)
    vl, lm = _row(verifier_last_hidden_states, "verifier_last_hidden_states", 1), _row(loss_mask, "loss_mask", 0)
    doc = _row(document_ids, "document_ids", 0)
    k = _num_depths(depth, num_depths)
    _check_prefix(anchor_pos, depth, ids.shape[0])
    layout = layout_from_arrays(anchor_pos, depth, valid)
    loss, correct, weight = row_loss_terms(drafter, target, ids, hs, vl, lm, doc, layout, num_depths=k,
                                           loss_type=loss_type, attn_chunk=attn_chunk, loss_chunk=loss_chunk,
                                           implementation=implementation)
    wsum = jnp.sum(weight)
    total = jnp.sum(loss * weight) / (wsum + LOSS_EPS)
    c, t = depth_metrics(correct, weight, layout.depth, k)
    grids = anchor_grid(correct, weight, layout.anchor_pos, layout.depth, ids.shape[0], k)
    cc, ct, ch = chain_metrics(*grids)
    return total, dict(correct=c, total=t, cond_correct=cc, cond_total=ct, chain_total=ch, weight_sum=wsum)


def peagle_loss(drafter: Drafter, target: Target, input_ids, hidden_states, verifier_last_hidden_states, loss_mask,
                document_ids, anchor_pos, depth, **kwargs):
    """Scalar P-EAGLE loss of one packed row with an explicit COD layout (speculators
    `PEagleDraftModel.forward` loss for the same layout).

    input_ids, loss_mask, document_ids [1, S] (after the EAGLE shift of spec D.1, -1 = padding doc);
    hidden_states [1, S, A*Ht] (pre-fc target features); verifier_last_hidden_states [1, S, Ht] (target
    final pre-norm states); anchor_pos, depth [N] (the first S elements must be depth 0 at anchors
    0..S-1, as speculators emits). Keyword options: valid [N] (padding elements), num_depths (required
    under jit), loss_type "kl" | "ce", attn_chunk / loss_chunk (query / element chunk sizes; None =
    automatic), implementation (the drafter attention's kernel switch).
    """
    return peagle_loss_and_metrics(drafter, target, input_ids, hidden_states, verifier_last_hidden_states, loss_mask,
                                   document_ids, anchor_pos, depth, **kwargs)[0]


@functools.partial(jax.jit, static_argnames=("num_depths", "slots"))
def _draft_logits(drafter: Drafter, hidden_states, input_ids, document_ids, anchor_pos, depth, valid, num_depths,
                  slots):
    s = input_ids.shape[-1]
    layout = layout_from_arrays(anchor_pos, depth, valid)
    normed = cod_hidden(drafter, input_ids.reshape(s).astype(jnp.int32), hidden_states.reshape(s, -1),
                        document_ids.reshape(s), layout, num_depths=num_depths, chain_slots=slots,
                        require_mask=False)
    return draft_logits_from_hidden(drafter, normed)


def draft_logits(drafter: Drafter, hidden_states, input_ids, document_ids, anchor_pos, depth, valid=None):
    """Draft-vocab logits float32 [N, Vd] of the N flattened COD elements (training layout).

    hidden_states [1, S, A*Ht] (pre-fc target features, shifted as in speculators: index p pairs
    token x_{p+1} with feature g_p), input_ids [1, S], document_ids [1, S] (-1 = padding),
    anchor_pos [N], depth [N] (the first S elements depth 0 at anchors 0..S-1, as speculators emits; any chains,
    repeated elements too).
    Element i sits at position anchor+depth; depth 0 takes the real token
    and feature at that position, depth >= 1 the mask token and mask_hidden (same combine path).
    valid [N] bool or None (all valid): pass a `cod_sample` layout's `valid` — its padding slots sit at anchor 0 and
    would otherwise join the chain of the real anchor-0 element and change its logits.
    Heads without mask_hidden / mask_token_id accept only all-zero (concrete) depths.
    """
    reason = no_parallel_reason(drafter.config)
    traced = isinstance(depth, jax.core.Tracer)
    if reason:
        if traced or np.any(np.asarray(depth) != 0):
            raise ValueError(reason + "; draft_logits got depth >= 1 elements"
                             + (" (or traced depths)" if traced else ""))
    s = np.shape(input_ids)[-1]
    _check_prefix(anchor_pos, depth, s)
    k = _num_depths(depth, drafter.config.num_depths if traced else None)
    concrete = not (traced or isinstance(anchor_pos, jax.core.Tracer))
    slots = chain_slots(layout_from_arrays(anchor_pos, depth, valid)) if concrete else None
    valid = jnp.ones(np.shape(anchor_pos), bool) if valid is None else jnp.asarray(valid, bool)
    return _draft_logits(drafter, jnp.asarray(hidden_states), jnp.asarray(input_ids), jnp.asarray(document_ids),
                         jnp.asarray(anchor_pos), jnp.asarray(depth), valid, k, slots)
