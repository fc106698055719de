"""Pallas (Triton) FlashAttention-2 for training: forward and backward kernels, differentiable through a custom VJP
whose backward is blockwise too (scores are recomputed per tile; no [T, S] tensor exists in either pass).

Why: the jnp reference writes a [chunk, S] float32 score tile of every head to memory and reads it back several
times (mask, softmax, PV, and again in the backward pass); these kernels keep each [rows, keys] tile on chip.
Bytes moved: the forward reads each query head's visible K/V tiles once per query tile (T / block_q passes over
them) and writes o and the log-sum-exp once; the dQ kernel reads them once more; the dK/dV kernel reads Q, dO, the
log-sum-exp and delta once per key tile and writes dK, dV once. Nothing of size T x S is written.

The mask: each query i sees the keys at indices lo[i] <= j <= hi[i] (`pjax.kernels.flash_attention.mask.
query_bounds`: document starts, causal limit, sliding window), so a program walks only the key tiles its queries
can see (per query tile [min lo, max hi]; the dK/dV kernel per key tile the list of query tiles that reach it), and
only the tiles on an edge of that interval apply the mask. GQA: a program takes one query head; the dK/dV kernel
loops over the g heads of its KV head.

Numerics: scores and softmax statistics in float32, base-2 exponentials with the scale folded in, probabilities
cast to V's dtype before the PV product (as the reference); products at `_pallas_util.dot_precision`. Outputs: o
and the log-sum-exp of each query's scores (natural log, float32), so a caller can merge other keys or sinks
(`reference.merge_partials`); the backward takes the cotangent of both (delta = rowsum(dO * O) - dLSE).
Difference from the reference: a query with no visible key gets o = 0 and lse = MASK_VALUE (the reference averages
all keys).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch
from pjax.kernels._pallas_util import dot_precision, exp2, next_pow2
from pjax.kernels.flash_attention.config import DEFAULT, FlashConfig
from pjax.kernels.flash_attention.reference import MASK_VALUE

__all__ = ["block_tables", "flash_attention", "query_tile_lists"]

NEG = -1e30  # a masked score (base-2 units); finite so that NEG - NEG = 0, never NaN
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def block_tables(lo, hi, bq: int, bk: int, nk: int):
    """Key-tile range of each query tile: lo, hi [Bm, Tp] (Tp = nq * bq; lo > hi = sees nothing) ->
    (first, end) int32 [Bm, nq]: tiles first <= j < end hold every key the tile's queries see (empty: 0, 0)."""
    bm, tp = lo.shape
    live = lo <= hi
    first = jnp.where(live, lo // bk, nk).reshape(bm, tp // bq, bq).min(-1)
    end = jnp.where(live, hi // bk + 1, 0).reshape(bm, tp // bq, bq).max(-1)
    return jnp.minimum(first, end).astype(jnp.int32), end.astype(jnp.int32)


def query_tile_lists(first, end, nk: int):
    """For each key tile j, the query tiles whose range [first, end) holds it: (tiles int32 [Bm, nk, nq], the first
    count[j] entries in ascending order; count int32 [Bm, nk])."""
    kb = jnp.arange(nk, dtype=jnp.int32)[None, :, None]
    hit = (first[:, None, :] <= kb) & (kb < end[:, None, :])
    return jnp.argsort(~hit, axis=-1, stable=True).astype(jnp.int32), jnp.sum(hit, -1, dtype=jnp.int32)


def _scores(q, kt, start, lo, hi, *, c, bk, precision, interior):
    """Base-2 scores [rows, bk] of a query tile against the key tile at `start`; NEG where masked (the mask is
    applied only when the tile is not `interior`: seen whole by every query of the tile)."""
    s = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * c
    cols = start + jnp.arange(bk, dtype=jnp.int32)

    def mask(x):
        return jnp.where((cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None]), x, NEG)

    return jax.lax.cond(interior, lambda x: x, mask, s)


def _interior(start, bk, lo_max, hi_min):
    return (start >= lo_max) & (start + bk - 1 <= hi_min)


def _query_tile(q_ref, lo_ref, hi_ref, *, bq, shared):
    """Program (b, h, i) of a kernel over query tiles: (b, h, i, mask row bm, tile rows, head dims, q [bq, hdp],
    lo, hi [bq])."""
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm = jnp.int32(0) if shared else b
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    dims = pl.ds(0, q_ref.shape[-1])
    q = pltriton.load(q_ref.at[b, rows, h, dims])
    return b, h, i, bm, rows, dims, q, pltriton.load(lo_ref.at[bm, rows]), pltriton.load(hi_ref.at[bm, rows])


def _fwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, first_ref, end_ref, o_ref, lse_ref, *, g, bq, bk, c, shared,
                precision, interpret):
    b, h, i, bm, rows, dims, q, lo, hi = _query_tile(q_ref, lo_ref, hi_ref, bq=bq, shared=shared)
    hdp = q_ref.shape[-1]
    lo_max, hi_min = jnp.max(lo), jnp.min(hi)
    kvh = h // g

    def body(j, carry):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        kt = pltriton.load(k_ref.at[b, pl.ds(start, bk), kvh, dims])
        s = _scores(q, kt, start, lo, hi, c=c, bk=bk, precision=precision,
                    interior=_interior(start, bk, lo_max, hi_min))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = exp2(m - m_new, interpret)
        p = exp2(s - m_new[:, None], interpret)
        vt = pltriton.load(v_ref.at[b, pl.ds(start, bk), kvh, dims])
        pv = jax.lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, hdp), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first_ref[bm, i], end_ref[bm, i], body, init)
    live = m > 0.5 * NEG  # saw a visible key (rows that saw none carry discarded sums of masked tiles)
    o = jnp.where(live[:, None], acc / jnp.where(live, l, 1.0)[:, None], 0.0)
    pltriton.store(o_ref.at[b, rows, h, dims], o.astype(o_ref.dtype))
    lse = jnp.where(live, (m + jnp.log2(jnp.where(live, l, 1.0))) * LN2, MASK_VALUE)
    pltriton.store(lse_ref.at[b, h, rows], lse)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref, first_ref, end_ref, dq_ref, *, g, bq,
               bk, c, scale, shared, precision, interpret):
    b, h, i, bm, rows, dims, q, lo, hi = _query_tile(q_ref, lo_ref, hi_ref, bq=bq, shared=shared)
    hdp = q_ref.shape[-1]
    do = pltriton.load(do_ref.at[b, rows, h, dims])
    lse, delta = pltriton.load(lse_ref.at[b, h, rows]), pltriton.load(delta_ref.at[b, h, rows])
    lo_max, hi_min = jnp.max(lo), jnp.min(hi)
    kvh = h // g

    def body(j, dq):
        start = pl.multiple_of(j * bk, bk)
        kt = pltriton.load(k_ref.at[b, pl.ds(start, bk), kvh, dims])
        vt = pltriton.load(v_ref.at[b, pl.ds(start, bk), kvh, dims])
        s = _scores(q, kt, start, lo, hi, c=c, bk=bk, precision=precision,
                    interior=_interior(start, bk, lo_max, hi_min))
        p = exp2(s - lse[:, None], interpret)
        dp = jax.lax.dot_general(do, vt, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jax.lax.dot_general(ds.astype(kt.dtype), kt, (((1,), (0,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(first_ref[bm, i], end_ref[bm, i], body, jnp.zeros((bq, hdp), jnp.float32))
    pltriton.store(dq_ref.at[b, rows, h, dims], (dq * scale).astype(dq_ref.dtype))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref, tiles_ref, count_ref, dk_ref,
                dv_ref, *, g, bq, bk, c, scale, shared, precision, interpret):
    b, kvh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm = jnp.int32(0) if shared else b
    hdp = k_ref.shape[-1]
    dims = pl.ds(0, hdp)
    start = pl.multiple_of(j * bk, bk)
    keys = pl.ds(start, bk)
    kt = pltriton.load(k_ref.at[b, keys, kvh, dims])
    vt = pltriton.load(v_ref.at[b, keys, kvh, dims])
    n = count_ref[bm, j]

    def head(jh, carry):
        h = kvh * g + jh

        def step(it, carry):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(tiles_ref[bm, j, it] * bq, bq), bq)
            q = pltriton.load(q_ref.at[b, rows, h, dims])
            do = pltriton.load(do_ref.at[b, rows, h, dims])
            lse, delta = pltriton.load(lse_ref.at[b, h, rows]), pltriton.load(delta_ref.at[b, h, rows])
            lo, hi = pltriton.load(lo_ref.at[bm, rows]), pltriton.load(hi_ref.at[bm, rows])
            s = _scores(q, kt, start, lo, hi, c=c, bk=bk, precision=precision,
                        interior=_interior(start, bk, jnp.max(lo), jnp.min(hi)))
            p = exp2(s - lse[:, None], interpret)  # [bq, bk]
            dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())), precision=precision,
                                          preferred_element_type=jnp.float32)
            dp = jax.lax.dot_general(do, vt, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            ds = p * (dp - delta[:, None])
            dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())), precision=precision,
                                          preferred_element_type=jnp.float32)
            return dk, dv

        return jax.lax.fori_loop(0, n, step, carry)

    zeros = jnp.zeros((bk, hdp), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, g, head, (zeros, zeros))
    pltriton.store(dk_ref.at[b, keys, kvh, dims], (dk * scale).astype(dk_ref.dtype))
    pltriton.store(dv_ref.at[b, keys, kvh, dims], dv.astype(dv_ref.dtype))


def _full(x):
    return pl.BlockSpec(x.shape, lambda *_, n=len(x.shape): (0,) * n)


def _call(kernel, grid, ins, outs, name, warps, stages, interpret):
    return pl.pallas_call(kernel, grid=grid, out_shape=outs, in_specs=[_full(x) for x in ins],
                          out_specs=[_full(o) for o in outs], name=name, interpret=interpret,
                          compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))(*ins)


def _tiles(t: int, s: int, cfg: FlashConfig) -> dict:
    """Tile sizes for these lengths: the config's, shrunk to the padded length for short rows."""
    tq, tk = max(16, next_pow2(t)), max(16, next_pow2(s))
    return dict(bq=min(cfg.block_q, tq), bk=min(cfg.block_k, tk), dkv_q=min(cfg.dkv_block_q, tq),
                dkv_k=min(cfg.dkv_block_k, tk), dq_q=min(cfg.dq_block_q, tq), dq_k=min(cfg.dq_block_k, tk))


def _forward(q, k, v, lo, hi, *, scale, tiles, cfg, interpret):
    b, tp, nh, hdp = q.shape
    sp, nkv = k.shape[1], k.shape[2]
    bq, bk = tiles["bq"], tiles["bk"]
    first, end = block_tables(lo, hi, bq, bk, sp // bk)
    kern = functools.partial(_fwd_kernel, g=nh // nkv, bq=bq, bk=bk, c=scale * LOG2E, shared=lo.shape[0] == 1,
                             precision=dot_precision(q.dtype), interpret=interpret)
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nh, tp), jnp.float32)]
    return _call(kern, (b, nh, tp // bq), [q, k, v, lo, hi, first, end], outs, "pjax_flash_attention_fwd",
                 cfg.num_warps(hdp), cfg.stages, interpret)


def _backward(q, k, v, lo, hi, o, lse, do, dlse, *, scale, tiles, cfg, interpret):
    b, tp, nh, hdp = q.shape
    sp, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1) - jnp.moveaxis(dlse, 1, 2)  # [B, Tp, nh]
    delta = jnp.moveaxis(delta, 1, 2)
    lse2 = jnp.where(lse == MASK_VALUE, -NEG, lse * LOG2E)  # rows that saw no key: p = 2^(s - huge) = 0
    common = dict(g=g, c=scale * LOG2E, scale=scale, shared=lo.shape[0] == 1, precision=dot_precision(q.dtype),
                  interpret=interpret)
    bq, bk = tiles["dq_q"], tiles["dq_k"]
    first, end = block_tables(lo, hi, bq, bk, sp // bk)
    (dq,) = _call(functools.partial(_dq_kernel, bq=bq, bk=bk, **common), (b, nh, tp // bq),
                  [q, k, v, do, lse2, delta, lo, hi, first, end], [jax.ShapeDtypeStruct(q.shape, q.dtype)],
                  "pjax_flash_attention_dq", cfg.num_warps(hdp), cfg.bwd_stages, interpret)
    bq, bk = tiles["dkv_q"], tiles["dkv_k"]
    nk = sp // bk
    tl, count = query_tile_lists(*block_tables(lo, hi, bq, bk, nk), nk)
    dk, dv = _call(functools.partial(_dkv_kernel, bq=bq, bk=bk, **common), (b, nkv, nk),
                   [q, k, v, do, lse2, delta, lo, hi, tl, count],
                   [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                   "pjax_flash_attention_dkv", cfg.num_warps(hdp), cfg.bwd_stages, interpret)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, lo, hi, scale, tiles, cfg, interpret):
    o, lse = _forward(q, k, v, lo, hi, scale=scale, tiles=dict(tiles), cfg=cfg, interpret=interpret)
    return o, lse


def _flash_fwd(q, k, v, lo, hi, scale, tiles, cfg, interpret):
    o, lse = _forward(q, k, v, lo, hi, scale=scale, tiles=dict(tiles), cfg=cfg, interpret=interpret)
    return (o, lse), (q, k, v, lo, hi, o, lse)


def _flash_bwd(scale, tiles, cfg, interpret, res, cts):
    q, k, v, lo, hi, o, lse = res
    do, dlse = cts
    dq, dk, dv = _backward(q, k, v, lo, hi, o, lse, do.astype(q.dtype), dlse, scale=scale, tiles=dict(tiles),
                           cfg=cfg, interpret=interpret)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, lo, hi, *, scale: float, config: FlashConfig = DEFAULT,
                    interpret: Optional[bool] = None):
    """(o [B, T, nh, hd] in q's dtype, lse float32 [B, T, nh]) of attention where query i sees keys lo[i] <= j <=
    hi[i]: q [B, T, nh, hd]; k, v [B, S, nkv, hd]; lo, hi int32 [Bm, T] (Bm = B or 1; `mask.query_bounds` of a mask
    whose keys sit at their index). Differentiable in q, k, v (and through lse). interpret: None = interpret mode off
    a GPU."""
    b, t, nh, hd = q.shape
    s = k.shape[1]
    tiles = _tiles(t, s, config.validate())
    mq = max(tiles["bq"], tiles["dkv_q"], tiles["dq_q"])
    mk = max(tiles["bk"], tiles["dkv_k"], tiles["dq_k"])
    tp, sp, hdp = -(-t // mq) * mq, -(-s // mk) * mk, max(16, next_pow2(hd))
    lo, hi = jnp.broadcast_arrays(jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32))
    lo = jnp.pad(jnp.maximum(lo, 0), ((0, 0), (0, tp - t)), constant_values=1)
    hi = jnp.pad(jnp.minimum(hi, s - 1), ((0, 0), (0, tp - t)), constant_values=0)
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, hdp - hd)))  # noqa: E731
    o, lse = _flash(pad(q, tp), pad(k, sp), pad(v, sp), lo, hi, float(scale), tuple(sorted(tiles.items())), config,
                    dispatch.interpret(interpret))
    return o[:, :t, :, :hd], jnp.moveaxis(lse, 1, 2)[:, :t]

