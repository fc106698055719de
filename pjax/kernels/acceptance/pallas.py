"""Pallas (Triton) speculative acceptance: two vocabulary-streaming kernels around tiny XLA glue.

Why: the XLA reference reads the [B, K+1, V] logits once per reduction it cannot fuse (argmax, max,
sum-exp) and launches several fusions; here
1. `stats` reads every logit exactly once (grid B x (K+1) x vocab splits, online max / sum-exp / raw
   argmax over vocabulary tiles, greedy and stochastic rows in the same launch) and writes 4 floats per
   (row, position, split);
2. the walk (acceptance tests, accepted prefix) is [B, K] arithmetic shared with the reference
   (`reference.accept_walk`), p(d_i) from one gathered logit per draft;
3. `race` reads only the row where each stochastic request draws its next token (B x V logits, plus
   the same row of draft_probs when given), computing the counter-hash Gumbel noise in-kernel (same
   `pjax.kernels.rng` code as the reference, so the noise is bit-identical); greedy rows skip the
   pass.
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import rng
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.acceptance import reference as ref
from pjax.kernels.acceptance.reference import AcceptResult

TILE = 2048  # vocabulary lanes per loop step (power of two)
TARGET_PROGRAMS = 264  # ~2 programs per H200 SM: split the vocabulary until the grid is this large
NEG_INF = float("-inf")
_BIG = np.int32(2 ** 31 - 1)
_FMIN = np.float32(np.finfo(np.float32).min)


def _splits(v: int, rows: int, tile: int):
    """(num_splits, chunk): chunk is a multiple of tile, num_splits * chunk >= v."""
    tiles = pl.cdiv(v, tile)
    ns = max(1, min(tiles, pl.cdiv(TARGET_PROGRAMS, rows)))
    chunk = pl.cdiv(tiles, ns) * tile
    return pl.cdiv(v, chunk), chunk


def _tile_argmax(vals, idx, best_v, best_i):
    """Fold one tile into a running (max, lowest argmax); ties keep the lower index."""
    tmax = jnp.max(vals)
    targ = jnp.min(jnp.where(vals == tmax, idx, _BIG))
    better = tmax > best_v
    return jnp.where(better, tmax, best_v), jnp.where(better, targ, best_i)


def _stats_kernel(lg_ref, inv_t_ref, thr_ref, av_ref, ai_ref, m_ref, z_ref, *, v, chunk, tile, use_thr):
    b, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    inv_t = inv_t_ref[b]
    thr = thr_ref[b, i] if use_thr else None
    lanes = jnp.arange(tile, dtype=jnp.int32)
    base = s * chunk

    def body(t, carry):
        bv, bi, m, z = carry
        off = base + t * tile
        idx = off + lanes
        valid = idx < v
        raw = pltriton.load(lg_ref.at[b, i, pl.ds(off, tile)], mask=valid, other=NEG_INF).astype(jnp.float32)
        bv, bi = _tile_argmax(raw, idx, bv, bi)
        x = raw * inv_t
        keep = valid if thr is None else valid & (x >= thr)
        xm = jnp.where(keep, x, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(xm))
        z = z * jnp.exp(m - m_new) + jnp.sum(jnp.exp(xm - m_new))
        return bv, bi, m_new, z

    init = (jnp.float32(NEG_INF), jnp.int32(0), jnp.float32(_FMIN), jnp.float32(0.0))
    bv, bi, m, z = jax.lax.fori_loop(0, chunk // tile, body, init)
    av_ref[b, i, s] = bv
    ai_ref[b, i, s] = bi
    m_ref[b, i, s] = m
    z_ref[b, i, s] = z


def _race_kernel(*refs, v, k, chunk, tile, use_thr, has_q):
    if has_q:
        lg_ref, q_ref, *refs = refs
    else:
        (lg_ref, *refs), q_ref = refs, None
    (row_ref, excl_ref, act_ref, inv_t_ref, thr_ref, m_ref, z_ref, seed_ref, pos_ref,
     pv_ref, pi_ref, qv_ref, qi_ref) = refs
    b, s = pl.program_id(0), pl.program_id(1)
    row, excl = row_ref[b], excl_ref[b]
    inv_t, thr, m, z = inv_t_ref[b], thr_ref[b], m_ref[b], z_ref[b]
    seed, pos = seed_ref[b], pos_ref[b]
    lanes = jnp.arange(tile, dtype=jnp.int32)
    base = s * chunk
    qrow = jnp.minimum(row, max(k - 1, 0))

    def body(t, carry):
        pbv, pbi, qbv, qbi = carry
        off = base + t * tile
        idx = off + lanes
        valid = idx < v
        x = pltriton.load(lg_ref.at[b, row, pl.ds(off, tile)], mask=valid, other=NEG_INF).astype(jnp.float32)
        x = x * inv_t
        keep = valid if not use_thr else valid & (x >= thr)
        g = rng.gumbel(seed, pos, idx)
        pbv, pbi = _tile_argmax(jnp.where(keep & (idx != excl), x + g, NEG_INF), idx, pbv, pbi)
        if has_q:
            q = pltriton.load(q_ref.at[b, qrow, pl.ds(off, tile)], mask=valid, other=0.0).astype(jnp.float32)
            p = jnp.where(keep, jnp.exp(x - m) / z, 0.0)
            res = jnp.maximum(p - q, 0.0)
            sq = jnp.where(res > 0, jnp.log(jnp.where(res > 0, res, 1.0)) + g, NEG_INF)
            qbv, qbi = _tile_argmax(sq, idx, qbv, qbi)
        return pbv, pbi, qbv, qbi

    init = (jnp.float32(NEG_INF), jnp.int32(0), jnp.float32(NEG_INF), jnp.int32(0))
    steps = jnp.where(act_ref[b] != 0, chunk // tile, 0)  # greedy rows: no pass
    pbv, pbi, qbv, qbi = jax.lax.fori_loop(0, steps, body, init)
    if not has_q:  # untouched carries are forwarded as literals, which the Triton store cannot take
        qbv, qbi = pbv, pbi
    pv_ref[b, s], pi_ref[b, s], qv_ref[b, s], qi_ref[b, s] = pbv, pbi, qbv, qbi


def _combine_argmax(vals, idxs):
    """Over the last (split) axis: max value, lowest index among the maxima."""
    best = jnp.max(vals, axis=-1)
    return best, jnp.min(jnp.where(vals == best[..., None], idxs, _BIG), axis=-1)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def position_stats(logits, inv_t, thr, *, use_thr: bool, tile: int = TILE, num_warps: int = 4,
                   num_stages: int = 2):
    """Kernel version of `reference.position_stats`: (amax [B, R] i32, m [B, R], z [B, R])."""
    b, r, v = logits.shape
    tile = min(tile, next_pow2(v))
    ns, chunk = _splits(v, b * r, tile)
    f32 = jnp.float32
    outs = [jax.ShapeDtypeStruct((b, r, ns), d) for d in (f32, jnp.int32, f32, f32)]
    av, ai, m_s, z_s = pl.pallas_call(
        functools.partial(_stats_kernel, v=v, chunk=chunk, tile=tile, use_thr=use_thr),
        grid=(b, r, ns), out_shape=outs,
        in_specs=[_full(logits.shape), _full((b,)), _full((b, r))],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_stats",
        **call_kwargs(num_warps, num_stages),
    )(logits, inv_t, thr)
    _, amax = _combine_argmax(av, ai)
    m = jnp.max(m_s, axis=-1)
    z = jnp.sum(z_s * jnp.exp(m_s - m[..., None]), axis=-1)
    m = jnp.where(m == _FMIN, NEG_INF, m)  # no kept lane: same as the reference
    return amax, m, z


def race(logits, draft_probs, w: ref.Walk, *, active, inv_t, thr, m, z, seeds, positions, use_thr: bool,
         tile: int = TILE, num_warps: int = 4, num_stages: int = 2):
    """Kernel version of `reference.race` for rows where `active` (stochastic); others return garbage."""
    b, r, v = logits.shape
    k = r - 1
    has_q = draft_probs is not None and k > 0
    tile = min(tile, next_pow2(v))
    ns, chunk = _splits(v, b, tile)
    g = ref.gather_rows
    row_args = [w.row, w.excl, active.astype(jnp.int32), inv_t, g(thr, w.row), g(m, w.row), g(z, w.row),
                seeds, positions + w.row]
    ins = [logits] + ([draft_probs] if has_q else []) + row_args
    outs = [jax.ShapeDtypeStruct((b, ns), d) for d in (jnp.float32, jnp.int32, jnp.float32, jnp.int32)]
    pv, pi, qv, qi = pl.pallas_call(
        functools.partial(_race_kernel, v=v, k=k, chunk=chunk, tile=tile, use_thr=use_thr, has_q=has_q),
        grid=(b, ns), out_shape=outs, in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full(o.shape) for o in outs], name="pjax_accept_race",
        **call_kwargs(num_warps, num_stages),
    )(*ins)
    _, tok = _combine_argmax(pv, pi)
    if has_q:
        qbest, tok_q = _combine_argmax(qv, qi)
        tok = jnp.where(w.use_q & (qbest > NEG_INF), tok_q, tok)
    return tok.astype(jnp.int32)


def accept(logits, draft_ids, draft_probs=None, *, temperature, top_k=None, top_p=None, seeds, positions,
           num_drafts=None) -> AcceptResult:
    """Same contract and outputs as `pjax.kernels.acceptance.reference.accept`."""
    ref.check_inputs(logits, draft_ids, draft_probs, temperature, seeds, positions, num_drafts, top_k, top_p)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions, jnp.int32)
    greedy, inv_t = ref.inverse_temperature(temperature)
    use_thr = top_k is not None or top_p is not None
    thr = ref.truncation_threshold(ref.scaled(logits, inv_t), top_k, top_p)
    amax, m, z = position_stats(logits, inv_t, thr, use_thr=use_thr)
    w = ref.accept_walk(logits, draft_ids, draft_probs, greedy=greedy, inv_t=inv_t, thr=thr, amax=amax, m=m, z=z,
                        seeds=seeds, positions=positions, num_drafts=num_drafts)
    tok = race(logits, draft_probs, w, active=~greedy, inv_t=inv_t, thr=thr, m=m, z=z, seeds=seeds,
               positions=positions, use_thr=use_thr)
    nxt = jnp.where(greedy, ref.gather_rows(amax, w.row), tok)
    return ref.assemble(draft_ids, w, nxt)
