"""Pallas (Triton) speculative acceptance: two vocabulary-streaming kernels around tiny XLA glue.

Why: the XLA reference reads the [B, K+1, V] logits once per reduction it cannot fuse (argmax, max,
sum-exp) and launches several fusions; here
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
3. small XLA glue merges the race splits and writes the -1 padded tokens.
Both kernels read the per-row temperature themselves (greedy flag; 1 / t with the same f32 division as
the reference's XLA code on the same backend), so nothing runs before them when top-k / top-p are off.
Bytes moved: B (K+2) V logit elements (+ B V draft probabilities), vs >= 3 B (K+1) V for XLA.
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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch, hardware, rng
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.acceptance import reference as ref
from pjax.kernels.acceptance.config import DEFAULT, AcceptanceConfig
from pjax.kernels.acceptance.reference import AcceptResult

NEG_INF = float("-inf")
_BIG = np.int32(2 ** 31 - 1)
_FMIN = np.float32(np.finfo(np.float32).min)


def _splits(v: int, rows: int, tile: int, config: AcceptanceConfig):
    """(num_splits, chunk): chunk is a multiple of tile, num_splits * chunk >= v; rows x num_splits programs come
    close to the config's grid-size target."""
    target = config.target_programs or config.programs_per_sm * hardware.gpu().wave
    tiles = pl.cdiv(v, tile)
    ns = max(1, min(tiles, pl.cdiv(target, rows)))
    chunk = pl.cdiv(tiles, ns) * tile
    return pl.cdiv(v, chunk), chunk


def _row_temperature(t_ref, b):
    """(greedy as int32 0/1, inv_t) of row b from temperature[b], in-kernel so that no XLA fusion runs
    before the kernels. inv_t has the bits of `reference.inverse_temperature` on the same backend: on the GPU
    both Triton's and XLA's f32 division are the approximate `div.full.f32` (not correctly rounded: 87% of
    random t give the IEEE result), in interpret mode both are the CPU's IEEE division. Checked on the
    device by `bench_kernels.py --only acc-mixed` (4096 random t, bit for bit)."""
    t = t_ref[b]
    return (t <= 0).astype(jnp.int32), jnp.where(t <= 0, 1.0, 1.0 / jnp.where(t <= 0, 1.0, t))


def _lane_argmax(vals, idx, best_v, best_i):
    """Per-lane running (max, argmax): later tiles have higher indices, so strict > keeps the lowest."""
    better = vals > best_v
    return jnp.where(better, vals, best_v), jnp.where(better, idx, best_i)


def _reduce_argmax(best_v, best_i, axis=None):
    """Cross-lane (max, lowest index among the maxima)."""
    top = jnp.max(best_v, axis=axis)
    top_b = top if axis is None else jnp.expand_dims(top, axis)
    return top, jnp.min(jnp.where(best_v == top_b, best_i, _BIG), axis=axis)


def _stats_kernel(lg_ref, t_ref, *refs, chunk, tile, unroll, use_thr):
    """Program (b, i, s) over logits[b, i, split s]: greedy rows the raw argmax only, stochastic rows the
    kept (max, sum-exp) only -- the walk never uses the other pair, so each row pays for one of them."""
    if use_thr:
        thr_ref, av_ref, ai_ref, m_ref, z_ref = refs
    else:
        av_ref, ai_ref, m_ref, z_ref = refs
    b, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, inv_t = _row_temperature(t_ref, b)  # g = 1: greedy row
    thr = thr_ref[b, i] if use_thr else None
    lanes = jnp.arange(tile, dtype=jnp.int32)
    base = s * chunk
    v_len = lg_ref.shape[-1]

    def tiles(t):
        """The unroll tiles of loop step t, loads issued back to back: [(first index, raw f32)]. The
        vocabulary tail loads as -inf, which neither argmax nor the kept sum can pick up."""
        start = pl.multiple_of(base + t * (unroll * tile), tile)
        raws = [pltriton.load(lg_ref.at[b, i, pl.ds(start + u * tile, tile)], mask=start + u * tile + lanes < v_len,
                              other=NEG_INF) for u in range(unroll)]
        return [(start + u * tile, r.astype(jnp.float32)) for u, r in enumerate(raws)]

    def greedy_body(t, carry):
        bv, bi = carry
        for first, raw in tiles(t):
            bv, bi = _lane_argmax(raw, first + lanes, bv, bi)
        return bv, bi

    def sampled_body(t, carry):
        # per-lane online softmax with one exp per element: z <- z e^(m - x) + 1 if x > m else z + e^(x - m)
        m, z = carry
        for _, raw in tiles(t):
            x = raw * inv_t
            if use_thr:
                x = jnp.where(x >= thr, x, NEG_INF)
            e = jnp.exp(-jnp.abs(x - m))
            up = x > m
            m, z = jnp.where(up, x, m), jnp.where(up, z * e + 1.0, z + e)
        return m, z

    steps = chunk // (unroll * tile)
    # loop bounds are traced int32 values so both scf.for types match
    bv, bi = jax.lax.fori_loop(g * 0, g * steps, greedy_body,
                               (jnp.full((tile,), NEG_INF, jnp.float32), jnp.zeros((tile,), jnp.int32)))
    m, z = jax.lax.fori_loop(g * 0, (1 - g) * steps, sampled_body,
                             (jnp.full((tile,), _FMIN, jnp.float32), jnp.zeros((tile,), jnp.float32)))
    top, arg = _reduce_argmax(bv, bi)
    mm = jnp.max(m)
    av_ref[b, i, s] = top
    ai_ref[b, i, s] = arg
    m_ref[b, i, s] = mm
    z_ref[b, i, s] = jnp.sum(z * jnp.exp(m - mm))


def _race_kernel(*refs, v, k, ns1, nsp, kp, chunk, tile, unroll, use_thr, has_q, has_n):
    """Program (b, s): merge row b's statistics, run the acceptance walk (as `reference.accept_walk`),
    then the exponential race over split s of the row where the next token is drawn."""
    refs = list(refs)
    lg_ref = refs.pop(0)
    q_ref = refs.pop(0) if has_q else None
    d_ref = refs.pop(0)
    n_ref = refs.pop(0) if has_n else None
    t_ref, seed_ref, pos_ref = refs[:3]
    refs = refs[3:]
    thr_ref = refs.pop(0) if use_thr else None
    av_ref, ai_ref, ms_ref, zs_ref, pv_ref, pi_ref, qv_ref, qi_ref, na_ref, ga_ref, uq_ref = refs
    b, s = pl.program_id(0), pl.program_id(1)
    g_int, inv_t = _row_temperature(t_ref, b)
    seed, pos0 = seed_ref[b], pos_ref[b]
    greedy = g_int != 0
    n = jnp.clip(n_ref[b], 0, k) if has_n else k

    # the drafts first: the gather of their logits depends on them
    ii = jnp.arange(kp, dtype=jnp.int32)
    ic = jnp.minimum(ii, max(k - 1, 0))
    dmask = ii < k
    d = pltriton.load(d_ref.at[b, ic], mask=dmask, other=-1)

    # merge the per-split statistics of positions 0..k: [kp, nsp] tiles
    jj = jnp.arange(nsp, dtype=jnp.int32)
    i2 = jnp.broadcast_to(ii[:, None], (kp, nsp))
    j2 = jnp.broadcast_to(jj[None, :], (kp, nsp))
    mk = (i2 <= k) & (j2 < ns1)
    i2c, j2c = jnp.minimum(i2, k), jnp.minimum(j2, ns1 - 1)
    av = pltriton.load(av_ref.at[b, i2c, j2c], mask=mk, other=NEG_INF)
    ai = pltriton.load(ai_ref.at[b, i2c, j2c], mask=mk, other=0)
    ms = pltriton.load(ms_ref.at[b, i2c, j2c], mask=mk, other=_FMIN)
    zs = pltriton.load(zs_ref.at[b, i2c, j2c], mask=mk, other=0.0)
    _, amax = _reduce_argmax(av, ai, axis=1)
    m = jnp.max(ms, axis=1)
    z = jnp.sum(zs * jnp.exp(ms - m[:, None]), axis=1)
    m = jnp.where(m == _FMIN, NEG_INF, m)

    # acceptance tests of drafts 0..k-1
    dc = jnp.clip(d, 0, v - 1)
    x_d = pltriton.load(lg_ref.at[b, ic, dc], mask=dmask, other=0.0).astype(jnp.float32) * inv_t
    thr = pltriton.load(thr_ref.at[b, jnp.minimum(ii, k)], mask=ii <= k, other=NEG_INF) if use_thr else None
    p_d = jnp.exp(x_d - m) / z
    if use_thr:
        p_d = jnp.where(x_d >= thr, p_d, 0.0)
    q_d = pltriton.load(q_ref.at[b, ic, dc], mask=dmask, other=1.0).astype(jnp.float32) if has_q else 1.0
    u = rng.uniform(seed, pos0 + ii, 0, rng.STREAM_ACCEPT)
    valid = (ii < n) & (d >= 0) & (d < v)
    acc = valid & jnp.where(greedy, d == amax, (q_d > 0) & (u * q_d < p_d))
    a = jnp.min(jnp.where(acc, _BIG, ii))  # first rejected (or invalid) index; <= n
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
    # greedy rows: no pass (bounds are traced int32 values so scf.for types match)
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


def _stats(logits, temperature, thr, *, tile, unroll, config, interpret):
    b, r, v = logits.shape
    ns, chunk = _splits(v, b * r, tile * unroll, config)
    f32 = jnp.float32
    outs = [jax.ShapeDtypeStruct((b, r, ns), dt) for dt in (f32, jnp.int32, f32, f32)]
    ins = [logits, temperature] + ([thr] if thr is not None else [])
    return pl.pallas_call(
        functools.partial(_stats_kernel, chunk=chunk, tile=tile, unroll=unroll, use_thr=thr is not None),
        grid=(b, r, ns), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_stats",
        **call_kwargs(config.warps, config.stages, interpret),
    )(*ins)


def _tile_unroll(v, config: AcceptanceConfig):
    tile = min(config.tile, next_pow2(v))
    return tile, max(1, min(config.unroll, pl.cdiv(v, tile)))


def accept(logits, draft_ids, draft_probs=None, *, temperature, top_k=None, top_p=None, seeds, positions,
           num_drafts=None, config: AcceptanceConfig = DEFAULT, interpret: Optional[bool] = None) -> AcceptResult:
    """Same contract and outputs as `pjax.kernels.acceptance.reference.accept`. interpret: None =
    interpret mode off GPU."""
    b, k, v = ref.check_inputs(logits, draft_ids, draft_probs, temperature, seeds, positions, num_drafts, top_k,
                               top_p)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions, jnp.int32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0
    use_thr = top_k is not None or top_p is not None
    if use_thr:
        thr = ref.truncation_threshold(ref.scaled(logits, ref.inverse_temperature(temperature)[1]), top_k, top_p)
    else:
        thr = None
    interpret = dispatch.interpret(interpret)
    tile, unroll = _tile_unroll(v, config)
    av, ai, m_s, z_s = _stats(logits, temperature, thr, tile=tile, unroll=unroll, config=config, interpret=interpret)
    ns1 = av.shape[-1]
    has_q = draft_probs is not None and k > 0
    ns2, chunk = _splits(v, b, tile * unroll, config)
    has_n = num_drafts is not None
    ins = ([logits] + ([draft_probs] if has_q else []) + [draft_ids.astype(jnp.int32)]
           + ([num_drafts.astype(jnp.int32)] if has_n else []) + [temperature, seeds, positions]
           + ([thr] if use_thr else []) + [av, ai, m_s, z_s])
    i32, f32 = jnp.int32, jnp.float32
    outs = [jax.ShapeDtypeStruct((b, ns2), dt) for dt in (f32, i32, f32, i32)] + [
        jax.ShapeDtypeStruct((b,), i32)] * 3
    pv, pi, qv, qi, a, amax_a, use_q = pl.pallas_call(
        functools.partial(_race_kernel, v=v, k=k, ns1=ns1, nsp=next_pow2(ns1), kp=next_pow2(k + 1), chunk=chunk,
                          tile=tile, unroll=unroll, use_thr=use_thr, has_q=has_q, has_n=has_n),
        grid=(b, ns2), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_walk_race",
        **call_kwargs(config.warps, config.stages, interpret),
    )(*ins)
    _, tok = _combine_argmax(pv, pi)
    if has_q:
        qbest, tok_q = _combine_argmax(qv, qi)
        tok = jnp.where((use_q != 0) & (qbest > NEG_INF), tok_q, tok)
    nxt = jnp.where(greedy, amax_a, tok)
    w = ref.Walk(a, a, None, None, None)
    return ref.assemble(draft_ids, w, nxt)
