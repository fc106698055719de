"""Pallas (Triton) speculative acceptance: one launch for small batches, two for large ones.

Why: the XLA reference reads the [B, K+1, V] logits once per reduction it cannot fuse (argmax, max,
sum-exp) and launches several fusions. Here, for large batches (B (K+1) V > FUSED_MAX_ELEMENTS or with
draft_probs):
1. `stats` reads every logit exactly once (grid B x (K+1) x vocab splits; per-lane running values over
   vocabulary tiles, reduced across lanes once at the end; greedy and stochastic rows in the same launch,
   each taking only the loop it needs: greedy rows a raw argmax, stochastic rows the kept max / sum-exp
   with one exp per element) and writes 4 numbers per (row, position, split);
2. `walk_race` (grid B x vocab splits): each program merges its row's split statistics, runs the
   acceptance walk (the arithmetic of `reference.accept_walk`: p(d_i) from one gathered logit per
   draft, counter-hash u_i) and then reads only the row where the request draws its next token (plus
   the same row of draft_probs when given), computing the counter-hash Gumbel noise in-kernel (same
   `pjax.kernels.rng` code as the reference, so the noise is bit-identical); greedy rows skip the
   pass;
3. one small XLA fusion merges the race splits and writes the -1 padded tokens.
Bytes moved: B (K+2) V logit elements (+ B V draft probabilities), vs >= 3 B (K+1) V for XLA.
For small batches (batch 1 decoding), where launches and not bytes set the time, everything is one
launch (`accept_fused`): the stats programs also run the race at every position (for position i
excluding d_i when i < n; the walk later picks position a), then the last program of each row to
finish (an atomic arrival counter) merges the row's statistics, runs the walk and writes the tokens.
Top-k / top-p: the per-position keep threshold comes from the shared sort-based pre-pass
(`reference.truncation_threshold`, a full sort of B (K+1) V floats -- the dominant cost when enabled,
skipped entirely when top_k and top_p are None); the kernels then mask with `x >= thr`.
Numerics: raw argmax and all integer outputs are exact; m is exact; z = sum exp(x - m) is summed in a
different order than the reference (relative difference ~1e-7), so an acceptance test or race whose
margin is below that can differ -- probability ~1e-7 per test on random inputs.
Triton constraints honoured: power-of-two tiles with masked loads for the vocabulary tail, no value
slicing, no int64 (uint32 hash).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import rng
from pjax.kernels._dispatch import interpret
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.acceptance import reference as ref
from pjax.kernels.acceptance.reference import AcceptResult

TILE = 1024  # vocabulary lanes per load (power of two)
UNROLL = 4  # loads issued back to back per loop step (bytes in flight per thread: the loops are latency bound)
TARGET_PROGRAMS = 1024  # ~8 programs per H200 SM: split the vocabulary until the grid is this large
FUSED_MAX_ELEMENTS = 1 << 22  # single-launch path up to this many logits (racing every position costs compute)
NEG_INF = float("-inf")
_BIG = np.int32(2 ** 31 - 1)
_FMIN = np.float32(np.finfo(np.float32).min)


def _splits(v: int, rows: int, tile: int):
    """(num_splits, chunk): chunk is a multiple of tile, num_splits * chunk >= v."""
    tiles = pl.cdiv(v, tile)
    ns = max(1, min(tiles, pl.cdiv(TARGET_PROGRAMS, rows)))
    chunk = pl.cdiv(tiles, ns) * tile
    return pl.cdiv(v, chunk), chunk


def _lane_argmax(vals, idx, best_v, best_i):
    """Per-lane running (max, argmax): later tiles have higher indices, so strict > keeps the lowest."""
    better = vals > best_v
    return jnp.where(better, vals, best_v), jnp.where(better, idx, best_i)


def _reduce_argmax(best_v, best_i, axis=None):
    """Cross-lane (max, lowest index among the maxima)."""
    top = jnp.max(best_v, axis=axis)
    top_b = top if axis is None else jnp.expand_dims(top, axis)
    return top, jnp.min(jnp.where(best_v == top_b, best_i, _BIG), axis=axis)


def _vocab_pass(lg_ref, b, i, base, *, steps, greedy_int, inv_t, thr, tile, unroll, race=None):
    """One pass over logits[b, i, base : base + steps * unroll * tile] (tail lanes load as -inf, which
    neither an argmax nor the kept sum can pick up). Greedy rows (greedy_int = 1) take the raw-argmax
    loop, stochastic rows the kept (max, sum-exp) loop -- the walk never uses the other pair. With
    race = (seed, pos, excl) the stochastic loop also runs the exponential race (argmax of x + Gumbel
    over kept lanes != excl). Returns per-lane (argmax value, index, m, z, race value, race index)."""
    lanes = jnp.arange(tile, dtype=jnp.int32)

    def tiles(t):
        start = pl.multiple_of(base + t * (unroll * tile), tile)
        v_len = lg_ref.shape[-1]
        raws = [pltriton.load(lg_ref.at[b, i, pl.ds(start + u * tile, tile)], mask=start + u * tile + lanes < v_len,
                              other=NEG_INF) for u in range(unroll)]  # loads issued back to back
        return [(start + u * tile + lanes, r.astype(jnp.float32)) for u, r in enumerate(raws)]

    def greedy_body(t, carry):
        bv, bi = carry
        for idx, raw in tiles(t):
            bv, bi = _lane_argmax(raw, idx, bv, bi)
        return bv, bi

    def sampled_body(t, carry):
        # online softmax with one exp per element: z <- z e^(m - x) + 1 if x > m else z + e^(x - m)
        m, z, rv, ri = carry
        for idx, raw in tiles(t):
            x = raw * inv_t
            if thr is not None:
                x = jnp.where(x >= thr, x, NEG_INF)
            e = jnp.exp(-jnp.abs(x - m))
            up = x > m
            m, z = jnp.where(up, x, m), jnp.where(up, z * e + 1.0, z + e)
            if race is not None:
                seed, pos, excl = race
                rv, ri = _lane_argmax(jnp.where(idx != excl, x + rng.gumbel(seed, pos, idx), NEG_INF), idx, rv, ri)
        return m, z, rv, ri

    neg = jnp.full((tile,), NEG_INF, jnp.float32)
    zero = jnp.zeros((tile,), jnp.int32)
    g = greedy_int  # loop bounds are traced int32 values so both scf.for types match
    bv, bi = jax.lax.fori_loop(g * 0, g * steps, greedy_body, (neg, zero))
    m, z, rv, ri = jax.lax.fori_loop(g * 0, (1 - g) * steps, sampled_body,
                                     (jnp.full((tile,), _FMIN, jnp.float32), jnp.zeros((tile,), jnp.float32), neg,
                                      zero))
    return bv, bi, m, z, rv, ri


def _store_stats(refs, idx, bv, bi, m, z):
    """(argmax value, argmax index, max, sum-exp) of one (row, position, split)."""
    av_ref, ai_ref, m_ref, z_ref = refs
    top, arg = _reduce_argmax(bv, bi)
    mm = jnp.max(m)
    av_ref[idx] = top
    ai_ref[idx] = arg
    m_ref[idx] = mm
    z_ref[idx] = jnp.sum(z * jnp.exp(m - mm))


def _stats_kernel(lg_ref, gr_ref, inv_t_ref, *refs, chunk, tile, unroll, use_thr):
    """Program (b, i, s): statistics of logits[b, i, split s]."""
    thr_ref, refs = (refs[0], refs[1:]) if use_thr else (None, refs)
    b, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    thr = thr_ref[b, i] if use_thr else None
    bv, bi, m, z, _, _ = _vocab_pass(lg_ref, b, i, s * chunk, steps=chunk // (unroll * tile), greedy_int=gr_ref[b],
                                     inv_t=inv_t_ref[b], thr=thr, tile=tile, unroll=unroll)
    _store_stats(refs, (b, i, s), bv, bi, m, z)


def _merged_stats(stat_refs, b, *, k, ns1, kp, nsp, volatile=False):
    """Row b's per-split statistics merged over splits: (amax, m, z) of positions 0..kp-1 (valid <= k)."""
    ii = jnp.arange(kp, dtype=jnp.int32)
    jj = jnp.arange(nsp, dtype=jnp.int32)
    i2 = jnp.broadcast_to(ii[:, None], (kp, nsp))
    j2 = jnp.broadcast_to(jj[None, :], (kp, nsp))
    mk = (i2 <= k) & (j2 < ns1)
    at = (b, jnp.minimum(i2, k), jnp.minimum(j2, ns1 - 1))
    av_ref, ai_ref, ms_ref, zs_ref = stat_refs
    av = pltriton.load(av_ref.at[at], mask=mk, other=NEG_INF, volatile=volatile)
    ai = pltriton.load(ai_ref.at[at], mask=mk, other=0, volatile=volatile)
    ms = pltriton.load(ms_ref.at[at], mask=mk, other=_FMIN, volatile=volatile)
    zs = pltriton.load(zs_ref.at[at], mask=mk, other=0.0, volatile=volatile)
    _, amax = _reduce_argmax(av, ai, axis=1)
    m = jnp.max(ms, axis=1)
    z = jnp.sum(zs * jnp.exp(ms - m[:, None]), axis=1)
    return amax, jnp.where(m == _FMIN, NEG_INF, m), z


def _walk(lg_ref, q_ref, d_ref, thr_ref, b, *, amax, m, z, n, greedy, inv_t, seed, pos0, k, kp, v):
    """The acceptance tests of drafts 0..k-1 (as `reference.accept_walk`) -> (a = first rejected or
    invalid index <= n, drafts [kp] (-1 past k), thr [kp] or None)."""
    ii = jnp.arange(kp, dtype=jnp.int32)
    ic = jnp.minimum(ii, max(k - 1, 0))
    dmask = ii < k
    d = pltriton.load(d_ref.at[b, ic], mask=dmask, other=-1)
    dc = jnp.clip(d, 0, v - 1)
    x_d = pltriton.load(lg_ref.at[b, ic, dc], mask=dmask, other=0.0).astype(jnp.float32) * inv_t
    thr = None if thr_ref is None else pltriton.load(thr_ref.at[b, jnp.minimum(ii, k)], mask=ii <= k, other=NEG_INF)
    p_d = jnp.exp(x_d - m) / z
    if thr is not None:
        p_d = jnp.where(x_d >= thr, p_d, 0.0)
    q_d = 1.0 if q_ref is None else pltriton.load(q_ref.at[b, ic, dc], mask=dmask, other=1.0).astype(jnp.float32)
    u = rng.uniform(seed, pos0 + ii, 0, rng.STREAM_ACCEPT)
    valid = (ii < n) & (d >= 0) & (d < v)
    acc = valid & jnp.where(greedy, d == amax, (q_d > 0) & (u * q_d < p_d))
    return jnp.min(jnp.where(acc, _BIG, ii)), d, thr


def _fused_kernel(lg_ref, gr_ref, inv_t_ref, d_ref, n_ref, seed_ref, pos_ref, *refs, k, v, ns, kp, nsp, chunk, tile,
                  unroll, use_thr):
    """Program (b, i, s): statistics and race of logits[b, i, split s]; the row's last program to finish
    merges them, walks, and writes tokens / num_accepted / next_token."""
    refs = list(refs)
    thr_ref = refs.pop(0) if use_thr else None
    refs.pop(0)  # zeroed arrival counters (aliased to cnt_ref)
    av_ref, ai_ref, ms_ref, zs_ref, rv_ref, ri_ref, tok_ref, na_ref, nt_ref, cnt_ref = refs
    b, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    inv_t, seed, pos0, g_int = inv_t_ref[b], seed_ref[b], pos_ref[b], gr_ref[b]
    n = jnp.clip(n_ref[b], 0, k)
    d_i = pltriton.load(d_ref.at[b, jnp.minimum(i, max(k - 1, 0))], mask=i < k, other=-1) if k > 0 else -1
    excl = jnp.where(i < n, d_i, -1)  # a rejection at i excludes d_i (argmax drafts); i = n is the bonus
    thr = thr_ref[b, i] if use_thr else None
    bv, bi, m, z, rv, ri = _vocab_pass(lg_ref, b, i, s * chunk, steps=chunk // (unroll * tile), greedy_int=g_int,
                                       inv_t=inv_t, thr=thr, tile=tile, unroll=unroll, race=(seed, pos0 + i, excl))
    stat_refs = (av_ref, ai_ref, ms_ref, zs_ref)
    _store_stats(stat_refs, (b, i, s), bv, bi, m, z)
    rv_ref[b, i, s], ri_ref[b, i, s] = _reduce_argmax(rv, ri)

    # publish (CTA barrier, then the acq_rel gpu-scope atomic) and count this program's arrival
    if not interpret():
        pltriton.debug_barrier()
    arrived = pltriton.atomic_add(cnt_ref, (b,), jnp.int32(1))

    @pl.when(arrived == (k + 1) * ns - 1)
    def _():
        if not interpret():
            pltriton.debug_barrier()
        amax, m_all, z_all = _merged_stats(stat_refs, b, k=k, ns1=ns, kp=kp, nsp=nsp, volatile=True)
        greedy = g_int != 0
        a, d, _ = _walk(lg_ref, None, d_ref, thr_ref, b, amax=amax, m=m_all, z=z_all, n=n, greedy=greedy,
                        inv_t=inv_t, seed=seed, pos0=pos0, k=k, kp=kp, v=v)
        jj = jnp.arange(nsp, dtype=jnp.int32)
        rv_a = pltriton.load(rv_ref.at[b, a, jnp.minimum(jj, ns - 1)], mask=jj < ns, other=NEG_INF, volatile=True)
        ri_a = pltriton.load(ri_ref.at[b, a, jnp.minimum(jj, ns - 1)], mask=jj < ns, other=0, volatile=True)
        ii = jnp.arange(kp, dtype=jnp.int32)
        nxt = jnp.where(greedy, jnp.max(jnp.where(ii == a, amax, -1)), _reduce_argmax(rv_a, ri_a)[1])
        pltriton.store(tok_ref.at[b, ii], jnp.where(ii < a, d, jnp.where(ii == a, nxt, -1)))  # [B, kp]
        na_ref[b] = a
        nt_ref[b] = nxt


def _race_kernel(*refs, v, k, ns1, nsp, kp, chunk, tile, unroll, use_thr, has_q):
    """Program (b, s): merge row b's statistics, run the acceptance walk (as `reference.accept_walk`),
    then the exponential race over split s of the row where the next token is drawn."""
    refs = list(refs)
    lg_ref = refs.pop(0)
    q_ref = refs.pop(0) if has_q else None
    d_ref, n_ref, gr_ref, inv_t_ref, seed_ref, pos_ref = refs[:6]
    refs = refs[6:]
    thr_ref = refs.pop(0) if use_thr else None
    stat_refs, (pv_ref, pi_ref, qv_ref, qi_ref, na_ref, ga_ref, uq_ref) = refs[:4], refs[4:]
    b, s = pl.program_id(0), pl.program_id(1)
    inv_t, seed, pos0 = inv_t_ref[b], seed_ref[b], pos_ref[b]
    greedy = gr_ref[b] != 0
    n = jnp.clip(n_ref[b], 0, k)
    amax, m, z = _merged_stats(stat_refs, b, k=k, ns1=ns1, kp=kp, nsp=nsp)
    a, d, thr = _walk(lg_ref, q_ref, d_ref, thr_ref, b, amax=amax, m=m, z=z, n=n, greedy=greedy, inv_t=inv_t,
                      seed=seed, pos0=pos0, k=k, kp=kp, v=v)
    ii = jnp.arange(kp, dtype=jnp.int32)
    at = ii == a
    rejected = a < n
    d_a = jnp.max(jnp.where(at, d, -1))
    excl = jnp.where(rejected & (not has_q), d_a, -1)
    m_a = jnp.max(jnp.where(at, m, NEG_INF))
    z_a = jnp.sum(jnp.where(at, z, 0.0))
    thr_a = jnp.max(jnp.where(at, thr, NEG_INF)) if use_thr else None

    @pl.when(s == 0)
    def _():
        na_ref[b] = a
        ga_ref[b] = jnp.max(jnp.where(at, amax, -1))
        uq_ref[b] = (rejected & has_q).astype(jnp.int32)

    # race over split s of row a
    lanes = jnp.arange(tile, dtype=jnp.int32)
    base = s * chunk
    pos = pos0 + a
    qrow = jnp.minimum(a, max(k - 1, 0))

    def body(t, carry):
        pbv, pbi, qbv, qbi = carry
        start = pl.multiple_of(base + t * (unroll * tile), tile)
        xs, qs, idxs = [], [], []
        for u in range(unroll):  # issue all loads first
            idx = start + u * tile + lanes
            idxs.append(idx)
            xs.append(pltriton.load(lg_ref.at[b, a, pl.ds(start + u * tile, tile)], mask=idx < v, other=NEG_INF))
            if has_q:
                qs.append(pltriton.load(q_ref.at[b, qrow, pl.ds(start + u * tile, tile)], mask=idx < v, other=0.0))
        for u, idx in enumerate(idxs):
            x = xs[u].astype(jnp.float32) * inv_t
            keep = idx < v if not use_thr else (idx < v) & (x >= thr_a)
            g = rng.gumbel(seed, pos, idx)
            pbv, pbi = _lane_argmax(jnp.where(keep & (idx != excl), x + g, NEG_INF), idx, pbv, pbi)
            if has_q:
                p = jnp.where(keep, jnp.exp(x - m_a) / z_a, 0.0)
                res = jnp.maximum(p - qs[u].astype(jnp.float32), 0.0)
                sq = jnp.where(res > 0, jnp.log(jnp.where(res > 0, res, 1.0)) + g, NEG_INF)
                qbv, qbi = _lane_argmax(sq, idx, qbv, qbi)
        return pbv, pbi, qbv, qbi

    neg = jnp.full((tile,), NEG_INF, jnp.float32)
    zero = jnp.zeros((tile,), jnp.int32)
    g_int = gr_ref[b]  # 1 = greedy row: no pass (bounds are traced int32 values so scf.for types match)
    steps = (1 - g_int) * (chunk // (unroll * tile))
    pbv, pbi, qbv, qbi = jax.lax.fori_loop(g_int * 0, steps, body, (neg, zero, neg, zero))
    pv_ref[b, s], pi_ref[b, s] = _reduce_argmax(pbv, pbi)
    if has_q:
        qv_ref[b, s], qi_ref[b, s] = _reduce_argmax(qbv, qbi)
    else:  # untouched carries are forwarded as literals, which the Triton store cannot take
        qv_ref[b, s], qi_ref[b, s] = pv_ref[b, s], pi_ref[b, s]


def _combine_argmax(vals, idxs):
    """Over the last (split) axis: max value, lowest index among the maxima."""
    best = jnp.max(vals, axis=-1)
    return best, jnp.min(jnp.where(vals == best[..., None], idxs, _BIG), axis=-1)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _stats(logits, greedy, inv_t, thr, *, tile, unroll, num_warps, num_stages):
    b, r, v = logits.shape
    ns, chunk = _splits(v, b * r, tile * unroll)
    f32 = jnp.float32
    outs = [jax.ShapeDtypeStruct((b, r, ns), dt) for dt in (f32, jnp.int32, f32, f32)]
    ins = [logits, greedy, inv_t] + ([thr] if thr is not None else [])
    return pl.pallas_call(
        functools.partial(_stats_kernel, chunk=chunk, tile=tile, unroll=unroll, use_thr=thr is not None),
        grid=(b, r, ns), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_stats",
        **call_kwargs(num_warps, num_stages),
    )(*ins)


def _accept_fused(logits, drafts, n, g_int, inv_t, seeds, positions, thr, *, tile, unroll, num_warps, num_stages):
    """The single-launch path (`_fused_kernel`): argmax drafts, small B (K+1) V."""
    b, r, v = logits.shape
    k, kp = r - 1, next_pow2(r)
    ns, chunk = _splits(v, b * r, tile * unroll)
    i32, f32 = jnp.int32, jnp.float32
    ins = [logits, g_int, inv_t, drafts, n, seeds, positions] + ([thr] if thr is not None else [])
    ins.append(jnp.zeros((b,), i32))  # arrival counters, aliased to the last output
    outs = ([jax.ShapeDtypeStruct((b, r, ns), dt) for dt in (f32, i32, f32, f32, f32, i32)]
            + [jax.ShapeDtypeStruct((b, kp), i32), jax.ShapeDtypeStruct((b,), i32), jax.ShapeDtypeStruct((b,), i32),
               jax.ShapeDtypeStruct((b,), i32)])
    res = pl.pallas_call(
        functools.partial(_fused_kernel, k=k, v=v, ns=ns, kp=kp, nsp=next_pow2(ns), chunk=chunk, tile=tile,
                          unroll=unroll, use_thr=thr is not None),
        grid=(b, r, ns), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], input_output_aliases={len(ins) - 1: len(outs) - 1},
        name="pjax_accept_fused", **call_kwargs(num_warps, num_stages),
    )(*ins)
    tokens, na, nt = res[6:9]
    return AcceptResult(tokens[:, :r], na, nt)


def _tile_unroll(v, tile, unroll):
    tile = min(tile or TILE, next_pow2(v))
    return tile, max(1, min(unroll or UNROLL, pl.cdiv(v, tile)))


def accept(logits, draft_ids, draft_probs=None, *, temperature, top_k=None, top_p=None, seeds, positions,
           num_drafts=None, tile: int = None, unroll: int = None, num_warps: int = 4,
           num_stages: int = 1) -> AcceptResult:
    """Same contract and outputs as `pjax.kernels.acceptance.reference.accept`."""
    b, k, v = ref.check_inputs(logits, draft_ids, draft_probs, temperature, seeds, positions, num_drafts, top_k,
                               top_p)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions, jnp.int32)
    greedy, inv_t = ref.inverse_temperature(temperature)
    use_thr = top_k is not None or top_p is not None
    thr = ref.truncation_threshold(ref.scaled(logits, inv_t), top_k, top_p) if use_thr else None
    tile, unroll = _tile_unroll(v, tile, unroll)
    g_int = greedy.astype(jnp.int32)
    n = jnp.full((b,), k, jnp.int32) if num_drafts is None else num_drafts.astype(jnp.int32)
    if draft_probs is None and k > 0 and b * (k + 1) * v <= FUSED_MAX_ELEMENTS:
        return _accept_fused(logits, draft_ids.astype(jnp.int32), n, g_int, inv_t, seeds, positions, thr, tile=tile,
                             unroll=unroll, num_warps=num_warps, num_stages=num_stages)
    av, ai, m_s, z_s = _stats(logits, g_int, inv_t, thr, tile=tile, unroll=unroll, num_warps=num_warps,
                              num_stages=num_stages)
    ns1 = av.shape[-1]
    has_q = draft_probs is not None and k > 0
    ns2, chunk = _splits(v, b, tile * unroll)
    ins = ([logits] + ([draft_probs] if has_q else [])
           + [draft_ids.astype(jnp.int32), n, g_int, inv_t, seeds, positions]
           + ([thr] if use_thr else []) + [av, ai, m_s, z_s])
    i32, f32 = jnp.int32, jnp.float32
    outs = [jax.ShapeDtypeStruct((b, ns2), dt) for dt in (f32, i32, f32, i32)] + [
        jax.ShapeDtypeStruct((b,), i32)] * 3
    pv, pi, qv, qi, a, amax_a, use_q = pl.pallas_call(
        functools.partial(_race_kernel, v=v, k=k, ns1=ns1, nsp=next_pow2(ns1), kp=next_pow2(k + 1), chunk=chunk,
                          tile=tile, unroll=unroll, use_thr=use_thr, has_q=has_q),
        grid=(b, ns2), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_walk_race",
        **call_kwargs(num_warps, num_stages),
    )(*ins)
    _, tok = _combine_argmax(pv, pi)
    if has_q:
        qbest, tok_q = _combine_argmax(qv, qi)
        tok = jnp.where((use_q != 0) & (qbest > NEG_INF), tok_q, tok)
    nxt = jnp.where(greedy, amax_a, tok)
    w = ref.Walk(a, a, None, None, None)
    return ref.assemble(draft_ids, w, nxt)
