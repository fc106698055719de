"""Prefill and one speculative round (verify -> accept -> draft) as pure, jit/vmap-able functions.

`prefill` and `spec_round` work on a batch (ragged: per-row lengths and positions); `prefill_single`
and `round_single` are the same computation for one sequence (no batch axis) for `jax.vmap`.
`decode_loop` runs rounds in a `lax.while_loop` until every row stops (no host round-trip).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pjax.decode import draft as D
from pjax.decode.drafting import Drafting
from pjax.decode.packing import pack_prompts
from pjax.decode.state import (RUNNING, SAMPLING_MODES, STOP_CAPACITY, STOP_EOS, STOP_LENGTH, STOP_NONFINITE,
                               DecodeState, EngineSpec, Sampling, add_batch_axis, any_filter, drop_batch_axis)
from pjax.decode.tree import TreeAccept, accept_tree, accept_tree_greedy, commit_path
from pjax.kernels.acceptance import AcceptResult, accept
from pjax.kernels.cache_attention import TreeMask
from pjax.kernels.flash_attention import causal_mask, document_mask
from pjax.models.cache import init_cache
from pjax.models.drafter import combine, init_drafter_cache
from pjax.models.target import forward, logits_from_hidden


def _accept(logits, drafts, q, sampling: Sampling, positions, num_drafts, spec: EngineSpec) -> AcceptResult:
    """Chain acceptance, with the top-k / top-p truncation (a vocabulary sort) when spec.sampling is "filtered"
    (spec.sampling None: a device branch on whether some row asks for it)."""
    kw = dict(temperature=sampling.temperature.astype(jnp.float32), seeds=sampling.seed.astype(jnp.uint32),
              positions=positions.astype(jnp.int32), num_drafts=num_drafts.astype(jnp.int32),
              implementation=spec.implementation)

    def plain():
        return accept(logits, drafts, q, **kw)

    def filtered():
        return accept(logits, drafts, q, top_k=sampling.top_k.astype(jnp.int32),
                      top_p=sampling.top_p.astype(jnp.float32), **kw)
    if spec.sampling is not None:
        return filtered() if spec.sampling == "filtered" else plain()
    return jax.lax.cond(any_filter(sampling), filtered, plain)


def _accept_tree(logits, tree, sampling: Sampling, positions, num_nodes, spec: EngineSpec) -> TreeAccept:
    """Tree acceptance: `accept_tree_greedy` when every row is greedy, else `accept_tree` (with the top-k / top-p
    truncation, a vocabulary sort, when some row asks for it); chosen by spec.sampling, or on the device."""
    kw = dict(temperature=sampling.temperature.astype(jnp.float32), seeds=sampling.seed.astype(jnp.uint32),
              positions=positions.astype(jnp.int32), num_nodes=num_nodes)
    branches = {"greedy": lambda: accept_tree_greedy(logits, tree, spec.k, num_nodes),
                "sampled": lambda: accept_tree(logits, tree, spec.k, **kw),
                "filtered": lambda: accept_tree(logits, tree, spec.k, top_k=sampling.top_k.astype(jnp.int32),
                                                top_p=sampling.top_p.astype(jnp.float32), **kw)}
    if spec.sampling is not None:
        return branches[spec.sampling]()
    index = jnp.any(sampling.temperature > 0).astype(jnp.int32) * (1 + any_filter(sampling).astype(jnp.int32))
    return jax.lax.switch(index, [branches[m] for m in SAMPLING_MODES])


def _finite_rows(logits, num_valid):
    """[B] bool: the logits [B, J, V] of the first num_valid[b] positions are all finite (max over the vocabulary
    propagates NaN and is inf when any lane is +inf; an all -inf row is not finite either)."""
    fin = jnp.isfinite(jnp.max(logits, axis=-1))
    j = jnp.arange(logits.shape[1], dtype=jnp.int32)[None]
    return jnp.all(fin | (j >= num_valid[:, None]), axis=1)


def _sample_one(logits, sampling, positions, spec):
    """Plain sampling of one token per row from logits [B, V] (acceptance with no drafts)."""
    b = logits.shape[0]
    res = _accept(logits[:, None], jnp.zeros((b, 0), jnp.int32), None, sampling, positions,
                  jnp.zeros((b,), jnp.int32), spec)
    return res.next_token


def _emit(state: DecodeState, tokens, count, new_pos, active, spec: EngineSpec, capacity: int, eos=None,
          max_new=None, finite=None):
    """Append tokens[b, :count[b]] to the output, apply EOS / length / capacity / non-finite stops.

    tokens [B, J] i32, count [B] i32 (>= 1 for active rows), new_pos [B] position of the new pending
    token, eos [B, E] i32 stop ids (-1 unused) or None, max_new [B] i32 row limits or None (=
    spec.max_new_tokens), finite [B] bool or None: rows whose logits were not finite emit nothing and stop.
    """
    j = tokens.shape[1]
    idx = jnp.arange(j, dtype=jnp.int32)[None]
    bad = jnp.zeros_like(active) if finite is None else active & ~finite
    count = jnp.where(active & ~bad, count, 0)
    stop = state.stop
    if eos is not None:
        is_eos = jnp.any((tokens[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0), axis=-1)
        is_eos &= idx < count[:, None]
        hit = jnp.any(is_eos, axis=1)
        first = jnp.argmax(is_eos, axis=1).astype(jnp.int32)
        count = jnp.where(hit, first + 1, count)
    else:
        hit = jnp.zeros_like(active)
    limit = spec.max_new_tokens if max_new is None else jnp.minimum(max_new, spec.max_new_tokens)
    remaining = limit - state.num_out
    long = count >= remaining
    count = jnp.minimum(count, remaining)
    n_buf = state.out.shape[1]
    slot = jnp.where(idx < count[:, None], state.num_out[:, None] + idx, n_buf)
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], slot.shape)
    out = state.out.at[rows, slot].set(tokens, mode="drop")
    full = new_pos >= capacity
    new_stop = jnp.where(bad, STOP_NONFINITE, jnp.where(hit, STOP_EOS, jnp.where(long, STOP_LENGTH, jnp.where(
        full, STOP_CAPACITY, RUNNING))))
    stop = jnp.where(active, new_stop, stop)
    return out, state.num_out + count, stop != RUNNING, stop


def target_spec(spec: EngineSpec) -> EngineSpec:
    """The settings `prefill_target` depends on: `spec` without its drafting fields, so that every K and drafting
    mode with the same aux_layer_ids shares one compiled target prefill."""
    return dataclasses.replace(spec, num_speculative_tokens=0, drafting=Drafting.NONE, draft_sampling="argmax",
                               mask_token_id=0, acceptance=None, tree_budget=None, tree_score="product")


def _target_pass(target, prompts, lengths, cache, spec: EngineSpec, packed_len, rows=None):
    """The target over the prompts [B, Lp] (lengths [B]), writing their K/V to `cache`: padded (one row per prompt,
    packed_len None) or packed (`pack_prompts`: one row of packed_len tokens under a document mask, each token's K/V
    to its prompt's cache row). rows [B] i32: prompt b's cache row (None: row b; rows outside the cache are
    dropped). Returns (hidden [B, H] at each prompt's last token, aux [B, Lp, A*Ht] or None, the cache); both
    layouts give the same values at every real position (the aux past a prompt's length: the padding's in the padded
    layout, zeros in the packed one)."""
    b, lp = prompts.shape
    kw = dict(aux_layer_ids=spec.aux_layer_ids, implementation=spec.implementation)
    j = jnp.arange(lp, dtype=jnp.int32)[None]
    if packed_len is None:  # a first pass: attend over the prompt's own tokens (flash), not the cache row
        out = forward(target, prompts, jnp.broadcast_to(j, (b, lp)), cache, valid=j < lengths[:, None],
                      mask=causal_mask(lengths, lp),
                      cache_rows=None if rows is None else jnp.broadcast_to(rows[:, None], (b, lp)), **kw)
        last_h = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return last_h, out.aux, out.cache
    tokens, positions, segment, prow, starts = pack_prompts(prompts, lengths, packed_len)
    out = forward(target, tokens, positions, cache, valid=segment >= 0, mask=document_mask(segment, span=lp),
                  cache_rows=prow if rows is None else rows[prow], **kw)
    last_h = out.hidden[0, starts + lengths - 1]
    aux = out.aux
    if aux is not None:  # unpacked: prompt b's token j from the packed index starts[b] + j
        idx = jnp.minimum(starts[:, None] + j, packed_len - 1)
        aux = jnp.where((j < lengths[:, None])[..., None], aux[0, idx], 0)
    return last_h, aux, out.cache


def _cleared(cache, rows):
    """The cache with rows `rows` zeroed (rows outside it dropped): a position a query masks must still hold a
    finite value, since the attention's product takes 0 x inf as nan."""
    return jax.tree.map(lambda x: x.at[rows].set(0, mode="drop"), cache)


def prefill_target(target, prompts, lengths, sampling: Sampling, *, spec: EngineSpec, capacity: int,
                   cache_dtype=None, packed_len=None, cache=None, rows=None):
    """The target's part of `prefill`: run the prompts, sample and emit the first token.

    prompts [B, Lp] i32 (right-padded), lengths [B] i32 (1 <= L <= Lp, L <= capacity); sampling [B]; spec: a
    `target_spec` (K = 0). packed_len: None runs the target over [B, Lp] (one row per prompt); an integer N >=
    sum(lengths) runs it over the prompts packed into one row of N tokens (`pack_prompts`), each attending to its own
    earlier tokens only and writing its K/V to its row of the cache: the same results for B * Lp / N times fewer
    positions computed. cache / rows: None, or a larger cache [R, capacity] (R rows of any content; donate it)
    and rows [B] i32, each prompt's row in it (rows >= R: dropped, e.g. padding): those rows are cleared and take
    the prompts' K/V in place, and the state's target_cache is that cache, so no [B, capacity] cache is allocated
    (`pjax.serve.admit`). Returns (state with K = 0 and no drafter cache, aux features [B, Lp, A*Ht] or None).
    The first generated token sits at position L; its randomness is keyed on (seed, L).
    """
    b = prompts.shape[0]
    prompts = prompts.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    if cache is None:
        tcache, rows = init_cache(target.config, b, capacity, cache_dtype or target.dtype), None
    else:
        rows = rows.astype(jnp.int32)
        tcache = _cleared(cache, rows)
    last_h, aux, tcache = _target_pass(target, prompts, lengths, tcache, spec, packed_len, rows)
    first_logits = logits_from_hidden(target, last_h)
    first = _sample_one(first_logits, sampling, lengths, spec)
    k = spec.k
    state = DecodeState(
        target_cache=tcache, drafter_cache=None, last=first, pos=lengths,
        drafts=jnp.zeros((b, k), jnp.int32), draft_probs=None,
        out=jnp.full((b, spec.out_len), -1, jnp.int32), num_out=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool), stop=jnp.zeros((b,), jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        num_drafts=jnp.zeros((b,), jnp.int32), num_draft_tokens=jnp.zeros((b,), jnp.int32),
        accepted=jnp.zeros((b,), jnp.int32), accepted_at=jnp.zeros((b, k), jnp.int32))
    active = jnp.ones((b,), bool)
    o, num_out, done, stop = _emit(state, first[:, None], jnp.ones((b,), jnp.int32), lengths, active, spec,
                                   capacity, sampling.eos, sampling.max_new,
                                   _finite_rows(first_logits[:, None], jnp.ones((b,), jnp.int32)))
    return dataclasses.replace(state, out=o, num_out=num_out, done=done, stop=stop), aux


def prefill_drafter(drafter, state: DecodeState, aux, prompts, lengths, sampling: Sampling, *, spec: EngineSpec,
                    capacity: int, cache_dtype=None, packed_len=None, cache=None, rows=None) -> dict:
    """The drafter's part of `prefill`: the first drafts, and the state's K-sized fields.

    state, aux: `prefill_target`'s outputs for the same prompts [B, Lp] and lengths [B]; spec: the full settings
    (drafting "parallel" or "sequential"); packed_len: the target prefill's packed row length or None, which packs
    the drafter's prefill slots alike (`draft.draft_prefill`); cache / rows: as `prefill_target`'s, for the
    drafter's cache (parallel drafting only). Returns the fields to replace in `state`
    (drafter_cache, drafts [B, K], draft_probs, and out / accepted_at widened to K): nothing of the target's state
    passes through, so the compiled program neither copies nor donates its KV cache; with spec.tree_budget also the
    first tree, and drafts [B, 0]; with spec.state_k the drafts widened to [B, K_max], ready [B] = K and tested_at
    [B, K_max] zeros)."""
    b, k = prompts.shape[0], spec.k_max
    widen = lambda x, n, v: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=v)  # noqa: E731
    if cache is None:
        dcache, rows = init_drafter_cache(drafter, b, capacity, cache_dtype or drafter.dtype), None
    else:
        rows = rows.astype(jnp.int32)
        dcache = _cleared(cache, rows)
    comb = combine(drafter, aux)
    drafts, q, tree, dcache = D.draft_prefill(drafter, dcache, comb, prompts.astype(jnp.int32),
                                              lengths.astype(jnp.int32), state.last, ~state.done, sampling, spec,
                                              packed_len, rows)
    fields = dict(drafter_cache=dcache, drafts=drafts, draft_probs=q, tree=tree,
                  out=widen(state.out, spec.out_len, -1), accepted_at=widen(state.accepted_at, k, 0))
    if spec.state_k is not None:
        fields.update(drafts=widen(drafts, k, 0), ready=jnp.full((b,), spec.k, jnp.int32),
                      tested_at=jnp.zeros((b, k), jnp.int32))
        if q is not None:
            fields["draft_probs"] = jnp.pad(q, ((0, 0), (0, k - q.shape[1]), (0, 0)))
    return fields


def prefill(target, drafter, prompts, lengths, sampling: Sampling, *, spec: EngineSpec, capacity: int,
            cache_dtype=None, packed_len=None, target_cache=None, drafter_cache=None, rows=None) -> DecodeState:
    """Run the prompts, sample the first token, propose the first drafts (`prefill_target`, then
    `prefill_drafter` unless drafting is "none").

    prompts [B, Lp] i32 (right-padded), lengths [B] i32 (1 <= L <= Lp, L <= capacity); sampling [B]; packed_len:
    the target's pass over [B, Lp] (None) or over the prompts packed into one row of that many tokens
    (`prefill_target`). target_cache / drafter_cache / rows: K/V written in place into rows `rows` [B] of those
    caches, which the state then holds (`prefill_target`'s and `prefill_drafter`'s cache / rows; the drafter's with
    parallel drafting only). The first generated token sits at position L; its randomness is keyed on (seed, L).
    """
    state, aux = prefill_target(target, prompts, lengths, sampling, spec=target_spec(spec), capacity=capacity,
                                cache_dtype=cache_dtype, packed_len=packed_len, cache=target_cache, rows=rows)
    if not spec.drafting.speculative:
        return state
    return dataclasses.replace(state, **prefill_drafter(drafter, state, aux, prompts, lengths, sampling, spec=spec,
                                                        capacity=capacity, cache_dtype=cache_dtype,
                                                        packed_len=packed_len, cache=drafter_cache, rows=rows))


def _origin(pos, active):
    """pos [B] where `active`, else 0: a round computes every slot, and a free slot's queries at its last request's
    positions would read that request's whole context from the cache (its outputs are unused and it writes no K/V);
    at 0 they read a tile."""
    return jnp.where(active, pos, 0)


def verify(target, state: DecodeState, num_drafts, active, spec: EngineSpec):
    """Target pass over [last, d_1..d_K] at positions pos..pos+K (rows beyond num_drafts or inactive
    write no KV; the state's first K drafts, of K_max with spec.state_k). Returns (logits [B, K+1, V] f32, aux
    [B, K+1, A*Ht] or None, cache, tokens [B, K+1])."""
    k = spec.k
    tokens = jnp.concatenate([state.last[:, None], state.drafts[:, :k]], axis=1)
    idx = jnp.arange(k + 1, dtype=jnp.int32)[None]
    positions = _origin(state.pos, active)[:, None] + idx
    valid = active[:, None] & (idx <= num_drafts[:, None])
    out = forward(target, tokens, positions, state.target_cache, valid=valid, aux_layer_ids=spec.aux_layer_ids,
                  implementation=spec.implementation)
    return logits_from_hidden(target, out.hidden), out.aux, out.cache, tokens


def verify_tree(target, state: DecodeState, tree, num_nodes, active, spec: EngineSpec):
    """Target pass over the tree [last, node 0..N-1] (`tree`: the state's, or its first N nodes): positions pos +
    depth (the root, `last`, at depth 0), K/V at the consecutive slots pos..pos+N (not at their positions), each node
    attending to the committed cache and its ancestors (`TreeMask`); nodes i >= num_nodes[b] and inactive rows write
    no KV. Returns (logits [B, N+1, V] f32, aux [B, N+1, A*Ht] or None, cache, tokens [B, N+1])."""
    tokens = jnp.concatenate([state.last[:, None], tree.tokens], axis=1)
    idx = jnp.arange(tree.size + 1, dtype=jnp.int32)[None]
    depth = jnp.concatenate([jnp.zeros_like(tree.depth[:, :1]), tree.depth], axis=1)
    valid = active[:, None] & (idx <= num_nodes[:, None])
    pos = _origin(state.pos, active)
    out = forward(target, tokens, pos[:, None] + depth, state.target_cache, valid=valid,
                  slots=pos[:, None] + idx, tree=TreeMask(pos, tree.visible),
                  aux_layer_ids=spec.aux_layer_ids, implementation=spec.implementation)
    return logits_from_hidden(target, out.hidden), out.aux, out.cache, tokens


def _verify_accept(target, state: DecodeState, sampling: Sampling, active, capacity: int, spec: EngineSpec):
    """Verify the drafts (a chain, or the tree) and accept: (result in chain form (tokens [B, K+1], num_accepted
    [B], next_token [B]), finite [B], drafts verified [B], and in chain layout aux [B, K+1, A*Ht] or None, the
    target cache (the accepted path's K/V at positions pos + 1..pos + n) and the verified tokens [B, K+1])."""
    k = spec.k
    width = k if spec.tree_budget is None else spec.tree_budget
    num_drafts = jnp.where(active, jnp.clip(capacity - 1 - state.pos, 0, width), 0).astype(jnp.int32)
    if state.ready is not None:  # a budget that follows the load: only the drafts proposed for this pos (a tree of
        # tree_budget="auto" is proposed by rounds that draft every depth)
        fresh = state.ready if spec.tree_budget is None else jnp.where(state.ready == spec.k_max, width, 0)
        num_drafts = jnp.minimum(num_drafts, fresh)
    if spec.tree_budget is None:
        logits, aux, tcache, vtokens = verify(target, state, num_drafts, active, spec)
        drafts = state.drafts[:, :k]
        if spec.acceptance is None:
            q = None if state.draft_probs is None else state.draft_probs[:, :k]
            res = _accept(logits, drafts, q, sampling, state.pos + 1, num_drafts, spec)
        else:
            res = spec.acceptance(logits, drafts, sampling, state.pos + 1, num_drafts, spec)
        return res, _finite_rows(logits, num_drafts + 1), num_drafts, aux, tcache, vtokens
    tree = state.tree.prefix(width)
    logits, aux, tcache, vtokens = verify_tree(target, state, tree, num_drafts, active, spec)
    finite = _finite_rows(logits, num_drafts + 1)
    valid = jnp.where(finite, num_drafts, 0)  # a non-finite row accepts none
    t = _accept_tree(logits, tree, sampling, state.pos + 1, valid, spec)
    rows = jnp.concatenate([jnp.zeros_like(t.path[:, :1]), t.path + 1], axis=1)  # [B, K+1] (root, path; root past it)
    aux = None if aux is None else jnp.take_along_axis(aux, rows[..., None], axis=1)
    tcache = commit_path(tcache, state.pos, t.path, t.num_accepted)
    return (AcceptResult(t.tokens, t.num_accepted, t.next_token), finite, num_drafts, aux, tcache,
            jnp.take_along_axis(vtokens, rows, axis=1))


def spec_round(target, drafter, state: DecodeState, sampling: Sampling, *, spec: EngineSpec) -> DecodeState:
    """One round for every row still running: verify -> accept -> draft. Pure; jit / vmap as is. With a tree
    (spec.tree_budget) the accepted path is compacted into chain form (its K/V, features and tokens), so the drafting
    that follows is the chain's."""
    k, k_max = spec.k, spec.k_max
    capacity = state.target_cache[0].k.shape[1]
    active = ~state.done
    res, finite, num_drafts, aux, tcache, vtokens = _verify_accept(target, state, sampling, active, capacity, spec)
    active_ok = active & finite
    n = jnp.where(active_ok, res.num_accepted, 0).astype(jnp.int32)
    new_pos = state.pos + n + 1
    out, num_out, done, stop = _emit(state, res.tokens, n + 1, new_pos, active, spec, capacity, sampling.eos,
                                     sampling.max_new, finite)
    has = active_ok & (num_drafts > 0)
    i = jnp.arange(k_max, dtype=jnp.int32)[None]
    acc_at = (i < n[:, None]) & has[:, None]
    tested = None
    if state.tested_at is not None:  # position i verified with the drafts before it accepted
        tested = state.tested_at + ((i < num_drafts[:, None]) & (i <= n[:, None]) & has[:, None]).astype(jnp.int32)
    new = dataclasses.replace(
        state, target_cache=tcache, out=out, num_out=num_out, done=done, stop=stop,
        last=jnp.where(active_ok, res.next_token, state.last).astype(jnp.int32),
        pos=jnp.where(active_ok, new_pos, state.pos),
        rounds=state.rounds + active.astype(jnp.int32),
        num_drafts=state.num_drafts + has.astype(jnp.int32),
        num_draft_tokens=state.num_draft_tokens + jnp.where(has, num_drafts, 0),
        accepted=state.accepted + jnp.where(has, n, 0),
        accepted_at=state.accepted_at + acc_at.astype(jnp.int32), tested_at=tested)
    if not spec.drafting.speculative:
        return new
    comb = combine(drafter, aux)
    keep = active & ~done
    origin = _origin(state.pos, keep)  # a row not drafting (its drafts are dropped) reads no context
    if k == 0:  # no drafts: the drafter only takes the new token (one slot), so that drafting resumes exactly
        dcache = D.catch_up(drafter, state.drafter_cache, comb, res.next_token, origin, keep, spec)
        return dataclasses.replace(new, drafter_cache=dcache, ready=jnp.where(keep, 0, state.ready))
    drafts, q, tree, dcache = D.draft_round(drafter, state.drafter_cache, comb, vtokens, n, res.next_token,
                                            origin, keep, sampling, spec)
    if k < k_max:  # the state's drafts k.. stay as they are
        drafts = state.drafts.at[:, :k].set(drafts)
        q = None if q is None else state.draft_probs.at[:, :k].set(q)
    held = lambda new, old: jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    drafts = held(drafts, state.drafts)
    if q is not None:
        q = held(q, state.draft_probs)
    tree = state.tree if tree is None else jax.tree.map(held, tree, state.tree)  # (None: a chain round keeps it)
    ready = None if state.ready is None else jnp.where(keep, k, state.ready)
    return dataclasses.replace(new, drafter_cache=dcache, drafts=drafts, draft_probs=q, tree=tree, ready=ready)


def decode_loop(target, drafter, state: DecodeState, sampling: Sampling, max_rounds=None, *, spec: EngineSpec):
    """Rounds in one `lax.while_loop` until every row stops or `max_rounds` (i32 scalar, runtime data: the host runs
    a long generation in bounded chunks with one program) rounds ran; None = max_new_tokens, enough for any
    generation (every round emits >= 1 token per running row). Returns (state, rounds executed i32)."""
    bound = spec.max_new_tokens if max_rounds is None else max_rounds

    def cond(carry):
        s, i = carry
        return jnp.any(~s.done) & (i < bound)

    def body(carry):
        s, i = carry
        return spec_round(target, drafter, s, sampling, spec=spec), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))


def prefill_single(target, drafter, prompt, length, sampling: Sampling, *, spec: EngineSpec, capacity: int,
                   cache_dtype=None) -> DecodeState:
    """`prefill` for one sequence: prompt [Lp] (right-padded), length [] i32, scalar sampling fields.
    Returns a DecodeState without the batch axis (vmap it to batch many sequences)."""
    s = prefill(target, drafter, prompt[None], jnp.asarray(length)[None], add_batch_axis(sampling), spec=spec,
                capacity=capacity, cache_dtype=cache_dtype)
    return drop_batch_axis(s)


def round_single(target, drafter, state: DecodeState, sampling: Sampling, *, spec: EngineSpec) -> DecodeState:
    """`spec_round` for one sequence (state and sampling without the batch axis): the research API.

    `jax.vmap(functools.partial(round_single, spec=spec), in_axes=(None, None, 0, 0))` runs many
    independent sequences (each with its own seed) in lock step."""
    return drop_batch_axis(spec_round(target, drafter, add_batch_axis(state), add_batch_axis(sampling), spec=spec))
