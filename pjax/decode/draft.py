"""Drafting: parallel (P-EAGLE, one drafter pass) and sequential (EAGLE-3, K passes) proposals, chains or trees.

Pairing convention (EAGLE shift): the drafter slot at absolute position p holds (token x_{p+1},
combined target feature g_p); its output predicts x_{p+2}. Drafter KV index = absolute position.
Shapes: B rows, K drafts, T verify rows (K + 1), S slots, H drafter hidden, Vd draft vocab, V target vocab.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pjax.decode.packing import pack_prompts
from pjax.decode.state import EngineSpec, Sampling, any_filter
from pjax.decode.tree import beam_width, build_tree, grow_tree
from pjax.kernels import rng
from pjax.kernels.acceptance.reference import truncation_threshold
from pjax.kernels.cache_attention import TreeMask
from pjax.kernels.flash_attention import causal_mask, document_mask
from pjax.kernels.metadata import build_draft_inputs
from pjax.models.drafter import (draft_logits_from_hidden, draft_to_target, drafter_forward, logits_to_target_vocab,
                                 mask_feature)

# counter-hash stream for draft sampling (distinct from the acceptance streams)
DRAFT_STREAM = 0x44
MASK_SLOT_STEP = 16  # the drafter's prefill pads its mask slots to a multiple of this (`prefill_mask_slots`)


def draft_law(logits, sampling: Sampling, spec: EngineSpec):
    """logits [B, K, Vd] -> q [B, K, Vd] f32: each row's sampling law applied to the draft logits as the acceptance
    applies it to the target's (logits / T, then the row's top-k, then top-p: `truncation_threshold`), so a head
    that matches the target's distribution matches its processed one too and its drafts are accepted as often as
    speculative sampling allows (an unfiltered q puts mass where the processed p has none). Greedy rows: T = 1
    (their q is replaced by a one-hot)."""
    temp = sampling.temperature.astype(jnp.float32)[:, None, None]
    x = logits.astype(jnp.float32) / jnp.where(temp <= 0, 1.0, temp)
    if spec.sampling not in (None, "filtered"):
        return jax.nn.softmax(x, axis=-1)

    def filtered():
        return truncation_threshold(x, sampling.top_k.astype(jnp.int32), sampling.top_p.astype(jnp.float32))
    if spec.sampling == "filtered":
        thr = filtered()
    else:  # decided on the device
        thr = jax.lax.cond(any_filter(sampling), filtered, lambda: jnp.full(x.shape[:2], -jnp.inf, jnp.float32))
    return jax.nn.softmax(jnp.where(x >= thr[..., None], x, -jnp.inf), axis=-1)


def select_drafts(drafter, logits, sampling: Sampling, positions, spec: EngineSpec):
    """logits [B, K, Vd] f32 at draft positions [B, K] -> (drafts [B, K] target ids, q [B, K, V] f32 or None).

    argmax drafts (ties -> lowest id) unless spec.draft_sampling == "sample", where rows with
    temperature > 0 draw d ~ q = `draft_law` (softmax(logits / T) under the row's top-k / top-p) by an exponential
    race keyed on (seed, position, lane).
    """
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if spec.draft_sampling == "argmax":
        return draft_to_target(drafter, greedy_ids).astype(jnp.int32), None
    vd = logits.shape[-1]
    greedy = sampling.temperature[:, None, None] <= 0
    q = draft_law(logits, sampling, spec)
    lanes = jnp.arange(vd, dtype=jnp.int32)
    u = rng.uniform(sampling.seed.astype(jnp.uint32)[:, None, None], positions[:, :, None].astype(jnp.int32),
                    lanes[None, None, :], DRAFT_STREAM)
    sampled = jnp.argmax(q / -jnp.log(u), axis=-1).astype(jnp.int32)
    ids = jnp.where(greedy[..., 0], greedy_ids, sampled)
    q = jnp.where(greedy, jax.nn.one_hot(ids, vd, dtype=jnp.float32), q)
    tids = draft_to_target(drafter, ids).astype(jnp.int32)
    return tids, logits_to_target_vocab(drafter, q, fill=0.0)


def propose(drafter, logits, sampling: Sampling, positions, spec: EngineSpec):
    """One drafter pass's proposal from its logits [B, K, Vd] f32 at draft positions [B, K]: (drafts [B, K], q or
    None, None) by `select_drafts`, or with spec.tree_budget N (drafts [B, 0], None, the tree of the N best paths by
    the log-softmax of each position under spec.tree_score, `tree.build_tree`, its tokens mapped to target ids).
    With spec.state_tree N_max (tree_budget="auto"): the argmax drafts [B, K], and where K = K_max the tree of N_max
    (else None: the state keeps its tree, stale)."""
    nodes = spec.tree_budget if spec.state_tree is None else (spec.state_tree if spec.k == spec.k_max else None)
    if nodes is None:
        return (*select_drafts(drafter, logits, sampling, positions, spec), None)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tree = build_tree(log_probs, nodes, spec.tree_score)
    tree = dataclasses.replace(tree, tokens=draft_to_target(drafter, tree.tokens).astype(jnp.int32))
    drafts = jnp.zeros((logits.shape[0], 0), jnp.int32) if spec.state_tree is None else \
        select_drafts(drafter, logits, sampling, positions, spec)[0]
    return drafts, None, tree


def gather_features(drafter, comb, feature_row, use_mask: bool):
    """comb [B, T, H], feature_row [B, S] (-1 = mask feature) -> hidden_in [B, S, H]."""
    rows = jnp.clip(feature_row, 0, comb.shape[1] - 1)
    h = jnp.take_along_axis(comb, rows[..., None], axis=1)
    if not use_mask:
        return h
    mf = mask_feature(drafter).astype(h.dtype)
    return jnp.where(feature_row[..., None] >= 0, h, mf)


def _draft_pass(drafter, tokens, hidden_in, positions, valid, cache, spec: EngineSpec):
    return drafter_forward(drafter, tokens, hidden_in, positions, cache, valid=valid,
                           implementation=spec.implementation)


def _pick(x, idx):
    """x [B, S, ...], idx [B, J] -> [B, J, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def feedback(drafter, normed, prenorm):
    """The hidden state an EAGLE-3 step feeds to the next one: prenorm, or normed with norm_output."""
    return normed if drafter.config.norm_output else prenorm


def sequential_tail(drafter, cache, first_draft, h, start_pos, active, sampling: Sampling, spec: EngineSpec,
                    first_q):
    """EAGLE-3 steps 2..K: feed back (previous draft, previous prenorm hidden) one position at a time.

    first_draft [B] target id, h [B, H] prenorm hidden of the slot that produced it (at position
    start_pos [B]); step i writes drafter KV at start_pos + i. Returns (drafts [B, K], q or None, cache).
    """
    k = spec.k

    def step(carry, i):
        tok, hid, cache = carry
        p = (start_pos + i)[:, None]
        normed, prenorm, cache = _draft_pass(drafter, tok[:, None], hid[:, None], p, active[:, None], cache, spec)
        logits = draft_logits_from_hidden(drafter, normed)  # [B, 1, Vd]
        d, q = select_drafts(drafter, logits, sampling, p + 2, spec)
        fed = feedback(drafter, normed, prenorm)
        return (d[:, 0], fed[:, 0], cache), (d[:, 0], None if q is None else q[:, 0])

    if k == 1:
        return first_draft[:, None], first_q, cache
    (_, _, cache), (ds, qs) = jax.lax.scan(step, (first_draft, h, cache), jnp.arange(1, k, dtype=jnp.int32))
    drafts = jnp.concatenate([first_draft[:, None], ds.T], axis=1)
    q = None if first_q is None else jnp.concatenate([first_q, jnp.moveaxis(qs, 0, 1)], axis=1)
    return drafts, q, cache


def sequential_tree(drafter, cache, logits, h, root_pos, active, spec: EngineSpec):
    """EAGLE-3's draft tree (EAGLE-2's dynamic tree, `tree.grow_tree`) of spec.tree_budget nodes of depth <= K.

    logits [B, Vd] f32: the drafter at the root, the slot at position root_pos [B] (its last committed slot, whose
    output drafts depth 1); h [B, H]: that slot's fed-back state (`feedback`). Each expansion is one drafter pass
    over the W frontier nodes (W = `tree.beam_width`): node of depth d at position root_pos + d, fed its parent's
    state as `sequential_tail` feeds a chain, its K/V at the scratch slot root_pos + 1 + (its frontier slot), seeing
    the committed slots (<= root_pos) and its ancestors' scratch slots (a `TreeMask` of (K - 1) W slots; nothing
    past the root's slot is read but those). The scratch is rewritten before it is read again: the next round's
    first pass writes the accepted tokens' K/V from the target's features, and a tree only reads the slots its own
    passes wrote. Inactive rows write nothing. Returns (the tree, tokens in target ids; cache)."""
    b = logits.shape[0]
    k, n = spec.k, spec.tree_budget
    w = beam_width(n, k, drafter.config.draft_vocab_size)
    start = root_pos + 1
    lane = jnp.arange(w, dtype=jnp.int32)
    valid = jnp.broadcast_to(active[:, None], (b, w))

    def expand(carry, front):
        cache, fed = carry  # fed [B, W, H]: the states the previous frontier's nodes fed back (depth 1: the root's)
        h_in = _pick(fed, jnp.maximum(front.parent, 0))
        pos = jnp.broadcast_to((root_pos + front.depth)[:, None], (b, w))
        slots = start[:, None] + (front.depth - 1) * w + lane
        normed, prenorm, cache = drafter_forward(drafter, draft_to_target(drafter, front.tokens), h_in, pos, cache,
                                                 valid=valid, slots=slots, tree=TreeMask(start, front.visible),
                                                 implementation=spec.implementation)
        log_probs = jax.nn.log_softmax(draft_logits_from_hidden(drafter, normed), axis=-1)
        return log_probs, (cache, feedback(drafter, normed, prenorm))

    fed = jnp.broadcast_to(h[:, None], (b, w, h.shape[-1]))
    tree, (cache, _) = grow_tree(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), expand, (cache, fed), n, k,
                                 w, spec.tree_score)
    return dataclasses.replace(tree, tokens=draft_to_target(drafter, tree.tokens).astype(jnp.int32)), cache


def draft_round(drafter, cache, comb, verify_tokens, num_accepted, next_token, start_pos, active,
                sampling: Sampling, spec: EngineSpec):
    """Draft K tokens after a verify round.

    comb [B, K+1, H] combined target features of the verify rows; verify_tokens [B, K+1];
    num_accepted [B]; next_token [B] (bonus / recovered, at position start_pos + n + 1);
    start_pos [B] position of verify_tokens[:, 0]. Returns (drafts [B, K], q or None, tree or None, cache): the
    proposal of `propose` (parallel drafting) or of `sequential_tail`; with spec.tree_budget drafts [B, 0] and the
    tree (`propose`, or `sequential_tree` for sequential drafting).
    """
    k = spec.k
    di = build_draft_inputs(num_accepted, verify_tokens, next_token, start_pos, num_slots=2 * k,
                            mask_token_id=spec.mask_token_id, implementation=spec.implementation)
    valid = di.valid & (di.write_pos >= 0) & active[:, None]
    first_pos = start_pos + num_accepted + 2  # position of d_1
    if spec.drafting.one_pass:
        h_in = gather_features(drafter, comb, di.feature_row, use_mask=k > 1)
        normed, _, cache = _draft_pass(drafter, di.tokens, h_in, di.positions, valid, cache, spec)
        logits = draft_logits_from_hidden(drafter, _pick(normed, di.sample_idx))
        pos = first_pos[:, None] + jnp.arange(k, dtype=jnp.int32)
        return (*propose(drafter, logits, sampling, pos, spec), cache)
    # sequential: accepted + bonus slots only (the first K+1 slots hold all of them)
    fr = di.feature_row[:, :k + 1]
    valid = valid[:, :k + 1] & (fr >= 0)
    h_in = gather_features(drafter, comb, fr, use_mask=False)
    normed, prenorm, cache = _draft_pass(drafter, di.tokens[:, :k + 1], h_in, di.positions[:, :k + 1], valid,
                                         cache, spec)
    n = num_accepted[:, None]
    logits = draft_logits_from_hidden(drafter, _pick(normed, n))
    if spec.tree_budget is not None:
        tree, cache = sequential_tree(drafter, cache, logits[:, 0], _pick(feedback(drafter, normed, prenorm), n)[:, 0],
                                      start_pos + num_accepted, active, spec)
        return jnp.zeros((logits.shape[0], 0), jnp.int32), None, tree, cache
    d1, q1 = select_drafts(drafter, logits, sampling, first_pos[:, None], spec)
    drafts, q, cache = sequential_tail(drafter, cache, d1[:, 0], _pick(feedback(drafter, normed, prenorm), n)[:, 0],
                                       start_pos + num_accepted, active, sampling, spec, q1)
    return drafts, q, None, cache


def catch_up(drafter, cache, comb, next_token, start_pos, active, spec: EngineSpec):
    """The drafter's part of a round with no drafts (a budget of 0, `EngineSpec.state_k`): the slot of the new token
    only, next_token [B] with the target's feature at start_pos [B] (comb [B, 1, H]), written to the drafter's cache
    at start_pos as a round with drafts writes it, so that a later round drafts from an exact cache. One drafter
    position per row and no drafter logits; parallel and sequential drafting alike. Returns the cache."""
    _, _, cache = _draft_pass(drafter, next_token[:, None].astype(jnp.int32), comb[:, :1], start_pos[:, None],
                              active[:, None], cache, spec)
    return cache


def prefill_mask_slots(k: int) -> int:
    """Slots the drafter's prefill pass adds after the prompt for K drafts: K - 1 rounded up to a multiple of
    MASK_SLOT_STEP (0 for K = 1), so the pass has the same shapes for K = 2..17 (a K sweep reuses its compiled
    kernels and the GPU's autotuned matrix products)."""
    return -(-(k - 1) // MASK_SLOT_STEP) * MASK_SLOT_STEP


def prefill_draft_inputs(prompts, lengths, first_token, k: int, mask_token_id: int):
    """Drafter slots after prefill: slot j < L-1: (prompt[j+1], feature j); slot L-1: (first token,
    feature L-1); slots L..L+K-2: mask token / mask feature; positions = slot index; rest padding.

    prompts [B, Lp], lengths [B], first_token [B] -> tokens, feature_row (-1 = mask), positions, valid [B, S]
    with S = Lp + prefill_mask_slots(K).
    """
    b, lp = prompts.shape
    s = lp + prefill_mask_slots(k)
    j = jnp.arange(s, dtype=jnp.int32)[None, :]
    L = lengths[:, None]
    nxt = jnp.take_along_axis(prompts, jnp.clip(j + 1, 0, lp - 1), axis=1) if s > 0 else prompts
    tokens = jnp.where(j < L - 1, nxt, jnp.where(j == L - 1, first_token[:, None], mask_token_id))
    valid = j < L + k - 1
    tokens = jnp.where(valid, tokens, 0).astype(jnp.int32)
    feature_row = jnp.where(j < L, j, -1).astype(jnp.int32)
    positions = jnp.broadcast_to(j, (b, s)).astype(jnp.int32)
    return tokens, feature_row, positions, valid


def packed_draft_length(packed_len: int, rows: int, k: int) -> int:
    """Slots of the drafter's packed prefill row when the target's prompts of `rows` rows packed into packed_len
    tokens: each row adds K - 1 slots (K = 1 for sequential drafting), rounded up to a multiple of 16."""
    return -(-(packed_len + rows * (k - 1)) // 16) * 16


def draft_prefill(drafter, cache, comb, prompts, lengths, first_token, active, sampling: Sampling,
                  spec: EngineSpec, packed_len=None, rows=None):
    """First drafts after prefill. comb [B, Lp, H] combined prompt features; first_token [B] sits at
    position lengths[b]. packed_len: None runs the drafter over the slots [B, S] (`prefill_draft_inputs`); the
    target's packed row length N packs each row's L + K - 1 slots into one row of `packed_draft_length` slots
    (`pack_prompts`: a document mask, each slot's K/V to its own cache row), the same values at every slot.
    rows [B] i32: prompt b's row of `cache` (None: row b; rows outside the cache dropped); parallel drafting only
    (sequential drafting's later passes read the cache by batch row). Returns (drafts [B, K], q or None, tree or
    None, cache) as `draft_round`."""
    k = spec.k
    use_masks = spec.drafting.one_pass
    kk = k if use_masks else 1
    if rows is not None and not use_masks:
        raise ValueError("draft_prefill: rows (K/V written into other cache rows) needs parallel drafting")
    tokens, fr, positions, valid = prefill_draft_inputs(prompts, lengths, first_token, kk, spec.mask_token_id)
    b, s = tokens.shape
    if comb.shape[1] < s:
        comb = jnp.pad(comb, ((0, 0), (0, s - comb.shape[1]), (0, 0)))
    h_in = gather_features(drafter, comb, fr, use_mask=use_masks and k > 1)
    valid = valid & active[:, None]
    idx = (lengths - 1)[:, None] + jnp.arange(kk, dtype=jnp.int32)  # [B, kk] the slots that draft
    if packed_len is None:  # a first pass: each row attends over its own L + kk - 1 slots (flash)
        normed, prenorm, cache = drafter_forward(
            drafter, tokens, h_in, positions, cache, valid=valid, mask=causal_mask(lengths + kk - 1, s),
            cache_rows=None if rows is None else jnp.broadcast_to(rows[:, None], (b, s)),
            implementation=spec.implementation)
    else:  # slot (b, j) -> packed index starts[b] + j; the packed row's outputs back to [B, kk] by that index
        flat = jnp.arange(b * s, dtype=jnp.int32).reshape(b, s)
        slot, ppos, seg, prow, starts = pack_prompts(flat, lengths + kk - 1, packed_draft_length(packed_len, b, kk))
        real = seg >= 0

        def take(x):  # [B, S, ...] -> [1, N, ...] at the packed slots, 0 past the last one
            g = x.reshape((b * s,) + x.shape[2:])[slot]
            return jnp.where(real.reshape(real.shape + (1,) * (g.ndim - 2)), g, 0)
        normed, prenorm, cache = drafter_forward(
            drafter, take(tokens), take(h_in), ppos, cache, valid=take(valid), mask=document_mask(seg, span=s),
            cache_rows=prow if rows is None else rows[prow], implementation=spec.implementation)
        normed, prenorm = normed[0][starts[:, None] + idx], prenorm[0][starts[:, None] + idx]  # [B, kk, H]
        idx = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), (b, kk))
    first_pos = lengths + 1  # position of d_1
    logits = draft_logits_from_hidden(drafter, _pick(normed, idx))
    if use_masks:
        return (*propose(drafter, logits, sampling, first_pos[:, None] + jnp.arange(k, dtype=jnp.int32), spec),
                cache)
    h = _pick(feedback(drafter, normed, prenorm), idx)[:, 0]
    if spec.tree_budget is not None:
        tree, cache = sequential_tree(drafter, cache, logits[:, 0], h, lengths - 1, active, spec)
        return jnp.zeros((b, 0), jnp.int32), None, tree, cache
    d1, q1 = select_drafts(drafter, logits, sampling, first_pos[:, None], spec)
    drafts, q, cache = sequential_tail(drafter, cache, d1[:, 0], h, lengths - 1, active, sampling, spec, q1)
    return drafts, q, None, cache
