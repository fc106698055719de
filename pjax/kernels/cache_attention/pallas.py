"""Pallas (Triton) flash-decoding attention of a few queries per row over a KV cache.

Why: verify (K+1 queries) and parallel drafting (2K queries) attend over a long cache with few
queries, so the cost is reading K/V once. The XLA reference reads the whole cache capacity S and
materialises [B, nh, T, S] scores; this kernel reads only the visible range [lo, hi) of each row
(hi = min(S, kv_len, max q_pos + 1), lo from the sliding window), each K/V tile once for all T
queries and all g = nh / nkv query heads sharing the KV head (GQA), and splits that range over
`num_splits` programs (flash-decoding) so batch 1 still fills the GPU.
Grid: (B, nkv, splits), about one program per SM. Each program holds a [M, hd] query tile (M = next power of
two >= T * g, rows = (query, head-in-group)) and streams [BK, hd] K/V tiles (3-stage pipeline) with an online
softmax in base 2 (scale folded into one multiply-add before `ex2.approx`); only the tiles at the edges of the
visible range (causal diagonal, window start, kv_len, cache end) apply a mask, the interior runs mask-free; partial
(o, m, l) per split are merged by a second small kernel (all splits of a [rows, 32 dims] block loaded at once)
that also adds the attention sinks and writes [B, T, nh, hd] directly.
Bytes moved: 2 * B * nkv * (hi - lo) * hd * itemsize of K/V + the tiny q and partials, written once and
read once (B * splits * nkv * M * (hd * itemsize + 8)).
Numerics: scores and the running sums in float32; probabilities are cast to V's dtype before the PV
product (as the reference does); the unnormalised partial o is stored in q's dtype when that is 16-bit
(as FlashInfer's merge_state takes it) and merged in float32; masked keys are -inf. Difference from the
reference: a query with no visible key gets 0 here (the reference, with a finite mask value, averages all S
values).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels._dispatch import interpret
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.cache_attention.reference import check_inputs

# K/V pipeline buffers (stages x 2 x block_k x head_dim) plus the query tile must fit in the H200's 227 KB of shared
# memory per program; block_k is halved until stages x 2 x block_k x hd x itemsize + rows x hd x itemsize <= this.
SMEM_BUDGET = 224 * 1024
# Programs per launch: one per H200 SM (132). With 128-key blocks and 3 stages a program holds 192 KB of K/V in
# flight, so one program fills an SM; more splits only add a second, mostly idle wave and a costlier merge.
# (B=1 16K, H200 2026-11-22: T=8 16 splits x 128 keys 21.3 us vs 32 x 64 22.2 us; T=12 22.1 vs 23.4 us; B=8 T=22
# 2 x 128 154.6 vs 4 x 64 174.6 us.)
TARGET_PROGRAMS = 128
NEG_INF = float("-inf")
LOG2E = 1.4426950408889634


def _exp2(x):
    """2 ** x as one MUFU `ex2.approx.ftz` instruction per element (what Triton's own exp2 emits; Pallas lowers
    jnp.exp2 to libdevice's slower exp2f: B=8 16K T=22 179 vs 184 us). Interpret mode uses jnp.exp2."""
    if interpret():
        return jnp.exp2(x)
    return pltriton.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


def key_range(qmin, qmax, kv_hi, *, bk, window):
    """Keys that queries at positions qmin..qmax of one row may see below kv_hi (scalars):
    (lo, full_lo, full_hi, n_blocks): tiles [lo + i * bk, ...) for i < n_blocks cover them; keys in
    [full_lo, full_hi) are visible to every query (inside each causal limit and window)."""
    hi, full_hi = jnp.minimum(qmax + 1, kv_hi), jnp.minimum(qmin + 1, kv_hi)
    if window is None:
        lo = full_lo = jnp.int32(0)
    else:
        lo = (jnp.maximum(qmin - window + 1, 0) // bk) * bk
        full_lo = qmax - window + 1
    return lo, full_lo, full_hi, jnp.maximum((hi - lo + bk - 1) // bk, 0)


def _kernel(q_ref, k_ref, v_ref, qpos_ref, *refs, t, g, s_len, hd, hdp, m_rows, bk, ns, window, has_len, scale,
            precision):
    if has_len:
        len_ref, o_ref, m_ref, l_ref = refs
    else:
        (o_ref, m_ref, l_ref), len_ref = refs, None
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = jnp.arange(m_rows, dtype=jnp.int32)
    t_idx, j_idx = r // g, r % g
    rmask = t_idx < t
    t_c = jnp.where(rmask, t_idx, 0)
    d = jnp.arange(hdp, dtype=jnp.int32)
    dmask = d < hd
    q = pltriton.load(q_ref.at[b, t_c[:, None], (h * g + j_idx)[:, None], d[None, :]],
                      mask=rmask[:, None] & dmask[None, :], other=0)
    qp = pltriton.load(qpos_ref.at[b, t_c], mask=rmask, other=-1)
    kv_len = len_ref[b] if has_len else None
    lo, full_lo, full_hi, n_blocks = key_range(jnp.min(jnp.where(rmask, qp, 2 ** 30)), jnp.max(qp),
                                               s_len if kv_len is None else jnp.minimum(kv_len, s_len), bk=bk,
                                               window=window)
    per = (n_blocks + ns - 1) // ns
    blk0 = sp * per
    blk1 = jnp.minimum(n_blocks, blk0 + per)
    kk = jnp.arange(bk, dtype=jnp.int32)
    c = scale * LOG2E  # p = 2 ** (score * c - m * c) = exp(scale * (score - m)); m tracks raw scores
    # unmasked tile loads when every tile lies inside the cache and head_dim is a power of two
    tile_mask = bool(s_len % bk) or hd != hdp

    def body(blk, carry):
        acc, m, l = carry
        start = pl.multiple_of(lo + blk * bk, bk)
        kidx = start + kk
        kmask = kidx < s_len
        tmask = kmask[:, None] & dmask[None, :] if tile_mask else None
        other = 0 if tile_mask else None
        kb = pltriton.load(k_ref.at[b, pl.ds(start, bk), h, pl.ds(0, hdp)], mask=tmask, other=other)
        sc = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)  # raw q k^T [M, BK]

        def mask(s_):
            vis = (kidx[None, :] <= qp[:, None]) & kmask[None, :]
            if window is not None:
                vis &= kidx[None, :] > qp[:, None] - window
            if has_len:
                vis &= kidx[None, :] < kv_len
            return jnp.where(vis, s_, NEG_INF)

        # only blocks at the edges of the visible range (causal diagonal, window start, length, cache end) mask
        sc = jax.lax.cond((start < full_lo) | (start + bk > full_hi), mask, lambda s_: s_, sc)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        mc = jnp.where(m_new == NEG_INF, 0.0, m_new) * c
        alpha = _exp2(m * c - mc)
        p = _exp2(sc * c - mc[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        vb = pltriton.load(v_ref.at[b, pl.ds(start, bk), h, pl.ds(0, hdp)], mask=tmask, other=other)
        pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l

    init = (jnp.zeros((m_rows, hdp), jnp.float32), jnp.full((m_rows,), NEG_INF, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(blk0, blk1, body, init)
    pltriton.store(o_ref.at[b, sp, h, pl.ds(0, m_rows), pl.ds(0, hdp)], acc.astype(o_ref.dtype))
    pltriton.store(m_ref.at[b, sp, h, pl.ds(0, m_rows)], m * scale)  # the merge works in units of scale * score
    pltriton.store(l_ref.at[b, sp, h, pl.ds(0, m_rows)], l)


def num_splits(b: int, nkv: int, s: int, bk: int) -> int:
    """KV-length splits: the largest power of two that keeps B x nkv x splits within one wave."""
    fit = max(1, TARGET_PROGRAMS // (b * nkv))
    return max(1, min(pl.cdiv(s, bk), 1 << (fit.bit_length() - 1)))


def default_tiles(b: int, nkv: int, s_len: int, m_rows: int) -> tuple:
    """(keys per tile, pipeline stages): 128 x 3 (one program fills an SM), except where other shapes measured
    faster on the H200 (2026-11-22, same-run medians):
    - 64-row programs (T * g in 33..64): 64 x 4 (B=1 16K T=12 / 14: 21.6 vs 22.1 us, B=8: 122.7 vs 123.4 us; with
      32 rows it loses: T=6 22.4 vs 21.5 us);
    - short caches whose 128-key blocks are too few to spread over TARGET_PROGRAMS: 64 x 3 (B=1 1K: 64 vs 128
      programs; T=8 6.2 vs 6.6 us, T=22 8.1 vs 8.9 us);
    - several waves of short programs with fewer than 128 rows, where two 64-key programs per SM overlap each
      other's start and end: 64 x 3 (B=64 1K T=8: 74.2 vs 81.8 us; at 16K 128 keys win, T=4 977 vs 1125 us)."""
    pairs = b * nkv
    if pl.cdiv(s_len, 128) * pairs < TARGET_PROGRAMS or (pairs > TARGET_PROGRAMS and s_len <= 4096 and m_rows < 128):
        return 64, 3
    if m_rows == 64:
        return 64, 4
    return 128, 3


def block_size(block_k: int, s_len: int, hdp: int, m_rows: int, itemsize: int, stages: int) -> int:
    """Keys per tile: block_k, capped by the cache length and halved (down to 16) until the K/V pipeline buffers
    and the query tile fit in SMEM_BUDGET (f32 or head_dim 256 tiles are 2x larger)."""
    bk = max(16, min(block_k, next_pow2(s_len)))
    while bk > 16 and (stages * 2 * bk + m_rows) * hdp * itemsize > SMEM_BUDGET:
        bk //= 2
    return bk


def partials(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, kv_len=None,
             block_k: Optional[int] = None, splits: Optional[int] = None, num_warps: Optional[int] = None,
             num_stages: Optional[int] = None):
    """The kernel alone: unnormalised per-split results (o [B, ns, nkv, M, hdp], m, l [B, ns, nkv, M]); m in
    units of scale * score.

    o is stored in q's dtype when that is 16-bit (bf16 / f16; the merge then reads half the bytes -- B=1 16K
    T=12: 26.1 -> 24.3 us on the H200), else float32; m and l are always float32."""
    b, t, nh, hd = q.shape
    s_len, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    m_rows = max(16, next_pow2(t * g))
    hdp = max(16, next_pow2(hd))
    tiles = default_tiles(b, nkv, s_len, m_rows)
    block_k, num_stages = block_k or tiles[0], num_stages or tiles[1]
    bk = block_size(block_k, s_len, hdp, m_rows, jnp.dtype(k.dtype).itemsize, num_stages)
    ns = splits or num_splits(b, nkv, s_len, bk)
    num_warps = num_warps or (4 if m_rows < 128 else 8)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    has_len = kv_len is not None
    kern = functools.partial(_kernel, t=t, g=g, s_len=s_len, hd=hd, hdp=hdp, m_rows=m_rows, bk=bk, ns=ns,
                             window=window, has_len=has_len, scale=float(scale), precision=precision)
    f32 = jnp.float32
    o_dtype = q.dtype if jnp.dtype(q.dtype).itemsize == 2 else f32
    outs = [jax.ShapeDtypeStruct((b, ns, nkv, m_rows, hdp), o_dtype), jax.ShapeDtypeStruct((b, ns, nkv, m_rows), f32),
            jax.ShapeDtypeStruct((b, ns, nkv, m_rows), f32)]
    ins = [q, k, v, q_pos.astype(jnp.int32)] + ([jnp.asarray(kv_len, jnp.int32)] if has_len else [])
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    return pl.pallas_call(
        kern, grid=(b, nkv, ns), out_shape=outs, in_specs=[full(x.shape) for x in ins],
        out_specs=[full(o.shape) for o in outs], name="pjax_cache_attention",
        **call_kwargs(num_warps, num_stages),
    )(*ins)


MERGE_TILE = 8192  # elements of partial o one merge program loads at once ([splits, rows, dims])
# head dims per merge program: 128 contiguous bytes of a bf16 partial row per split. H200, 16K, same runs
# (`bench_kernels.py --only attn-merge`): the B=1 T=22 merge kernel takes 2.37-2.46 us vs 2.62-2.69 at 32 dims;
# the other shapes measured stay within run-to-run spread
MERGE_DIMS = 64
# warps per merge program. H200, 16K, merge kernel us (`bench_kernels.py --only attn-merge`, 2026-11-23): 4 warps
# 2.37-2.43 / 2.08-2.11 / 2.43 at B=1 T=22, GPT-OSS B=1 T=12, B=8 T=22; 2 warps 2.34 / 2.11 / 2.98-3.04; 8 warps
# 2.88-2.91 / 2.27-2.37 / 2.46; 1 warp (scratch run) 3.10 at B=1 T=22
MERGE_WARPS = 4


def _merge_kernel(o_ref, m_ref, l_ref, *refs, t, g, hd, ns, nsp, rb, db, has_sinks):
    """Program (b, h, c): rows block c // (hdp / db), dims block c % (hdp / db) of one (row, KV head)."""
    sink_ref, out_ref = refs if has_sinks else (None, refs[0])
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_dblk = o_ref.shape[-1] // db
    rows = (c // n_dblk) * rb + jnp.arange(rb, dtype=jnp.int32)
    dims = (c % n_dblk) * db + jnp.arange(db, dtype=jnp.int32)
    t_idx, j_idx = rows // g, rows % g
    rmask = t_idx < t
    sp = jnp.arange(nsp, dtype=jnp.int32)
    spc, smask = jnp.minimum(sp, ns - 1), sp < ns
    o_s = pltriton.load(o_ref.at[b, spc[:, None, None], h, rows[None, :, None], dims[None, None, :]],
                        mask=smask[:, None, None], other=0.0).astype(jnp.float32)  # [nsp, rb, db], issued first
    m_s = pltriton.load(m_ref.at[b, spc[:, None], h, rows[None, :]], mask=smask[:, None], other=NEG_INF)  # [nsp, rb]
    l_s = pltriton.load(l_ref.at[b, spc[:, None], h, rows[None, :]], mask=smask[:, None], other=0.0)
    m_all = jnp.max(m_s, axis=0)
    if has_sinks:
        sk = pltriton.load(sink_ref.at[h * g + j_idx], mask=rmask, other=NEG_INF).astype(jnp.float32)
        m_all = jnp.maximum(m_all, sk)
    m_safe = jnp.where(m_all == NEG_INF, 0.0, m_all)
    w = jnp.exp(m_s - m_safe[None, :])
    denom = jnp.sum(w * l_s, axis=0)
    if has_sinks:
        denom = denom + jnp.exp(sk - m_safe)
    o = jnp.sum(w[:, :, None] * o_s, axis=0) / jnp.where(denom == 0, 1.0, denom)[:, None]
    # padding rows are masked; interpret mode applies a masked store as a read-modify-write scatter, so there
    # they get their own spare query row t instead of aliasing a real one
    t_out = jnp.where(rmask, t_idx, t if interpret() else 0)
    pltriton.store(out_ref.at[b, t_out[:, None], (h * g + j_idx)[:, None], dims[None, :]], o.astype(out_ref.dtype),
                   mask=rmask[:, None] & (dims < hd)[None, :])


def merge(o_s, m_s, l_s, *, t: int, nh: int, hd: int, sinks=None, dtype=jnp.bfloat16):
    """Merge the splits (and the sinks) in float32 -> [B, T, nh, hd] in one launch; rows r = (query t, head j)."""
    b, ns, nkv, m_rows, hdp = o_s.shape
    nsp = next_pow2(ns)
    db = min(MERGE_DIMS, hdp)
    # rows per program: a power of two (Triton blocks) dividing the rows (the Mosaic kernel's swapped partials: 96)
    rb = math.gcd(m_rows, 1 << (max(1, min(m_rows, MERGE_TILE // (nsp * db))).bit_length() - 1))
    spare = 1 if interpret() else 0  # see the final store in _merge_kernel
    ins = [o_s, m_s, l_s] + ([sinks.astype(jnp.float32)] if sinks is not None else [])
    out = pl.pallas_call(
        functools.partial(_merge_kernel, t=t, g=nh // nkv, hd=hd, ns=ns, nsp=nsp, rb=rb, db=db,
                          has_sinks=sinks is not None),
        grid=(b, nkv, (m_rows // rb) * (hdp // db)), out_shape=jax.ShapeDtypeStruct((b, t + spare, nh, hd), dtype),
        in_specs=[pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in ins],
        out_specs=pl.BlockSpec((b, t + spare, nh, hd), lambda *_: (0, 0, 0, 0)), name="pjax_cache_attention_merge",
        **call_kwargs(MERGE_WARPS, 1),
    )(*ins)
    return out[:, :t] if spare else out


def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    block_k: Optional[int] = None, splits: Optional[int] = None, num_warps: Optional[int] = None,
                    num_stages: Optional[int] = None):
    """Same contract as `pjax.kernels.cache_attention.reference.cache_attention`."""
    check_inputs(q, k, v, q_pos, kv_len, sinks)
    parts = partials(q, k, v, q_pos, scale=scale, window=window, kv_len=kv_len, block_k=block_k, splits=splits,
                     num_warps=num_warps, num_stages=num_stages)
    _, t, nh, hd = q.shape
    return merge(*parts, t=t, nh=nh, hd=hd, sinks=sinks, dtype=q.dtype)
