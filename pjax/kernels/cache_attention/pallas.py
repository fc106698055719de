"""Pallas (Triton) flash-decoding attention of a few queries per row over a KV cache.

Why: verify (K+1 queries), parallel drafting (2K queries) and draft-tree verification (root + N nodes) attend over a
long cache with few queries, so the cost is reading K/V once. The XLA reference reads the whole cache capacity S and
materialises [B, nh, T, S] scores; this kernel reads only the visible range [lo, hi) of each row
(hi = min(S, kv_len, max q_pos + 1), lo from the sliding window), each K/V tile once for all T
queries and all g = nh / nkv query heads sharing the KV head (GQA; once per query block past 128 such rows), and
splits that range over `num_splits` programs (flash-decoding) so batch 1 still fills the GPU.
Grid: (B x query blocks, nkv, splits), about one program per SM (`hardware.gpu().wave`). Each program holds a
[M, hd] query tile (rows = (query, head-in-group) pairs; M = next power of two >= T * g up to
`AttentionConfig.max_query_rows`, past that blocks of max_query_rows rows, one program per block: `query_blocks`;
the query blocks of one (row, KV head, split) are neighbours on the fastest launch axis, so they run together and
share their K/V tiles through L2) and streams [BK, hd] K/V tiles (3-stage pipeline) with an online
softmax in base 2 (scale folded into one multiply-add before `ex2.approx`); only the tiles at the edges of the
visible range (causal diagonal, window start, kv_len, cache end) apply a mask, the interior runs mask-free; partial
(o, m, l) per split are merged by a second small kernel (all splits of a [rows, 32 dims] block loaded at once)
that also adds the attention sinks and writes [B, T, nh, hd] directly.
Token trees (`tree_start`, `tree_visible` [B, T, n]): the tree's n tokens sit at cache slots tree_start ..
tree_start + n - 1 (n = T: the queries are the tree's tokens, at positions q_pos = tree_start + depth; n > T: the
queries are some of them), so hi = min(S, tree_start + n); keys below tree_start follow the position rules, the edge
tiles reaching the tree slots also load the [M, BK] ancestor bits of their rows' queries from tree_visible (bool,
one byte per (query, slot) as XLA stores it: no packing pass per call), and the interior tiles stay mask-free.
Without a tree none of this is traced.
Bytes moved: 2 * B * nkv * query blocks * (hi - lo) * hd * itemsize of K/V (each query block's programs read the
K/V again; launched side by side, the repeats should mostly hit L2) + the tiny q, tree mask and partials, written
once and read once (B * splits * nkv * query blocks * M * (hd * itemsize + 8)).
Numerics: scores and the running sums in float32; probabilities are cast to V's dtype before the PV
product (as the reference does); float32 inputs multiply at the precision JAX's default matmul precision asks for
(`_pallas_util.dot_precision`: full float32 under "highest"); the unnormalised partial o is stored in q's dtype when that is 16-bit
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

from pjax.kernels import dispatch, hardware
from pjax.kernels._pallas_util import call_kwargs, dot_precision, exp2, next_pow2
from pjax.kernels.cache_attention.config import DEFAULT, AttentionConfig
from pjax.kernels.cache_attention.mask import TreeMask, check_window
from pjax.kernels.cache_attention.reference import check_inputs

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634


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


def _kernel(q_ref, k_ref, v_ref, qpos_ref, *refs, t, g, s_len, hd, hdp, m_rows, bk, ns, nqb, window, has_len,
            has_tree, tree_slots, scale, precision, interpret):
    len_ref = refs[0] if has_len else None
    start_ref, vis_ref = refs[has_len:has_len + 2] if has_tree else (None, None)
    o_ref, m_ref, l_ref = refs[-3:]
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = jnp.arange(m_rows, dtype=jnp.int32)
    row0 = 0
    if nqb > 1:  # program axis 0 = (row, query block): rows row0 .. row0 + M - 1
        b, row0 = b // nqb, pl.multiple_of(b % nqb * m_rows, m_rows)
        r = row0 + r
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
    if has_tree:  # the committed keys end at the tree's first slot, its tree_slots slots follow whatever q_pos says
        tree_lo = start_ref[b]
        full_hi = jnp.minimum(full_hi, tree_lo)
        n_blocks = jnp.maximum((jnp.minimum(tree_lo + tree_slots, s_len) - lo + bk - 1) // bk, 0)
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

        def visible():  # by position; with a tree, only the committed keys below its first slot
            vis = (kidx[None, :] <= qp[:, None]) & (kmask & (kidx < tree_lo) if has_tree else kmask)[None, :]
            if window is not None:
                vis &= kidx[None, :] > qp[:, None] - window
            if has_len:
                vis &= kidx[None, :] < kv_len
            return vis

        def mask(s_):
            return jnp.where(visible(), s_, NEG_INF)

        def tree_mask(s_):  # committed keys by position | the tree slots of the row's query's ancestors-or-self
            j = kidx - tree_lo
            in_tree = (j >= 0) & (j < tree_slots) & kmask
            anc = pltriton.load(vis_ref.at[b, t_c[:, None], jnp.where(in_tree, j, 0)[None, :]],
                                mask=rmask[:, None] & in_tree[None, :], other=False)
            return jnp.where(visible() | anc, s_, NEG_INF)

        # only blocks at the edges of the visible range (causal diagonal, window start, length, cache end, tree)
        # mask; the interior runs mask-free
        edge = (start < full_lo) | (start + bk > full_hi)
        if has_tree:  # edge tiles reaching the tree slots also load the ancestor bits
            mask = functools.partial(jax.lax.cond, start + bk > tree_lo, tree_mask, mask)
        sc = jax.lax.cond(edge, mask, lambda s_: s_, sc)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        mc = jnp.where(m_new == NEG_INF, 0.0, m_new) * c
        alpha = exp2(m * c - mc, interpret)
        p = exp2(sc * c - mc[:, None], interpret)
        l = l * alpha + jnp.sum(p, axis=1)
        vb = pltriton.load(v_ref.at[b, pl.ds(start, bk), h, pl.ds(0, hdp)], mask=tmask, other=other)
        pv = jax.lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l

    init = (jnp.zeros((m_rows, hdp), jnp.float32), jnp.full((m_rows,), NEG_INF, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(blk0, blk1, body, init)
    pltriton.store(o_ref.at[b, sp, h, pl.ds(row0, m_rows), pl.ds(0, hdp)], acc.astype(o_ref.dtype))
    pltriton.store(m_ref.at[b, sp, h, pl.ds(row0, m_rows)], m * scale)  # the merge works in units of scale * score
    pltriton.store(l_ref.at[b, sp, h, pl.ds(row0, m_rows)], l)


def num_splits(b: int, nkv: int, s: int, bk: int) -> int:
    """KV-length splits: the largest power of two that keeps B x nkv x splits within one wave (one program per SM:
    each fills its SM, a second wave would mostly idle and cost a larger merge)."""
    fit = max(1, hardware.gpu().wave // (b * nkv))
    return max(1, min(pl.cdiv(s, bk), 1 << (fit.bit_length() - 1)))


def default_tiles(b: int, nkv: int, s_len: int, m_rows: int, config: AttentionConfig = DEFAULT) -> tuple:
    """(keys per tile, pipeline stages): block_k x stages (one program fills an SM), except
    - small_block_k x small_stages where the cache's block_k tiles are too few to fill one wave, or where several
      waves of short programs (caches up to short_cache_keys, fewer than max_query_rows rows) run, and two smaller
      programs per SM overlap each other's start and end;
    - rows64_block_k x rows64_stages for 64-row programs (T * g in 33..64)."""
    pairs, wave = b * nkv, hardware.gpu().wave
    if pl.cdiv(s_len, config.block_k) * pairs < wave or (
            pairs > wave and s_len <= config.short_cache_keys and m_rows < config.max_query_rows):
        return config.small_block_k, config.small_stages
    if m_rows == 64:
        return config.rows64_block_k, config.rows64_stages
    return config.block_k, config.stages


def smem_budget(config: AttentionConfig = DEFAULT) -> int:
    """Bytes of shared memory a program's K/V ring and query tile may take on this device."""
    return hardware.gpu().smem_per_block - config.smem_reserve


def block_size(block_k: int, s_len: int, hdp: int, m_rows: int, itemsize: int, stages: int,
               config: AttentionConfig = DEFAULT) -> int:
    """Keys per tile: block_k, capped by the cache length and halved (down to min_block_k) until the K/V pipeline
    buffers, the query tile and the probabilities tile of the P @ V product ([m_rows, bk], staged in shared memory)
    fit in `smem_budget` (f32 or head_dim 256 tiles are 2x larger). On an H200, 128 rows of head_dim 128 in bf16
    take 128-key tiles 2 stages deep or 64-key tiles 3 deep: 128 x 3 asks Triton for 256 KiB."""
    lo = config.min_block_k
    bk = max(lo, min(block_k, next_pow2(s_len)))
    while bk > lo and ((stages * 2 * bk + m_rows) * hdp + m_rows * bk) * itemsize > smem_budget(config):
        bk //= 2
    return bk


def query_blocks(rows: int, config: AttentionConfig = DEFAULT) -> tuple:
    """(rows per program M, query blocks): all T * g rows of a KV head in one program of M = next power of two
    (at least 16) rows up to config.max_query_rows; past that, blocks of max_query_rows rows, one program each."""
    if rows <= config.max_query_rows:
        return max(16, next_pow2(rows)), 1
    return config.max_query_rows, pl.cdiv(rows, config.max_query_rows)


def check_tree(q, tree_start, tree_visible, window=None):
    """tree_start [B] and tree_visible [B, T, n >= T] bool given together (`mask.check_window` for the window), or an
    error naming the argument."""
    if (tree_start is None) != (tree_visible is None):
        raise ValueError("cache_attention: tree_start and tree_visible must be given together (or neither)")
    if tree_start is None:
        return
    b, t = q.shape[:2]
    if tuple(jnp.shape(tree_start)) != (b,):
        raise ValueError(f"cache_attention: tree_start must have shape {(b,)}, found {tuple(jnp.shape(tree_start))}")
    if (tree_visible.ndim != 3 or tuple(tree_visible.shape[:2]) != (b, t) or tree_visible.shape[2] < t
            or tree_visible.dtype != jnp.bool_):
        raise ValueError(f"cache_attention: tree_visible must be bool {(b, t)} + (n,) with n >= {t}, found "
                         f"{tree_visible.dtype} {tuple(tree_visible.shape)}")
    check_window(TreeMask(tree_start, tree_visible), t, window)


def partials(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, kv_len=None, tree_start=None,
             tree_visible=None, block_k: Optional[int] = None, splits: Optional[int] = None,
             num_warps: Optional[int] = None, num_stages: Optional[int] = None, config: AttentionConfig = DEFAULT,
             interpret: Optional[bool] = None):
    """The kernel alone: unnormalised per-split results (o [B, ns, nkv, R, hdp], m, l [B, ns, nkv, R]; R = M x
    query blocks, `query_blocks`); m in units of scale * score. block_k / splits / num_warps / num_stages force a
    value (else `default_tiles`, `num_splits` and the config); interpret: None = interpret mode off GPU.

    o is stored in q's dtype when that is 16-bit (bf16 / f16; the merge then reads half the bytes), else float32;
    m and l are always float32."""
    b, t, nh, hd = q.shape
    s_len, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    m_rows, nqb = query_blocks(t * g, config)
    hdp = max(16, next_pow2(hd))
    tiles = default_tiles(b, nkv * nqb, s_len, m_rows, config)
    block_k, num_stages = block_k or tiles[0], num_stages or tiles[1]
    bk = block_size(block_k, s_len, hdp, m_rows, jnp.dtype(k.dtype).itemsize, num_stages, config)
    ns = splits or num_splits(b, nkv * nqb, s_len, bk)
    num_warps = num_warps or (config.warps if m_rows < config.max_query_rows else config.warps_full_rows)
    interpret = dispatch.interpret(interpret)
    has_len, has_tree = kv_len is not None, tree_start is not None
    kern = functools.partial(_kernel, t=t, g=g, s_len=s_len, hd=hd, hdp=hdp, m_rows=m_rows, bk=bk, ns=ns, nqb=nqb,
                             window=window, has_len=has_len, has_tree=has_tree,
                             tree_slots=tree_visible.shape[2] if has_tree else 0, scale=float(scale),
                             precision=dot_precision(q.dtype), interpret=interpret)
    f32 = jnp.float32
    o_dtype = q.dtype if jnp.dtype(q.dtype).itemsize == 2 else f32
    rows = nqb * m_rows
    outs = [jax.ShapeDtypeStruct((b, ns, nkv, rows, hdp), o_dtype), jax.ShapeDtypeStruct((b, ns, nkv, rows), f32),
            jax.ShapeDtypeStruct((b, ns, nkv, rows), f32)]
    ins = [q, k, v, q_pos.astype(jnp.int32)] + ([jnp.asarray(kv_len, jnp.int32)] if has_len else [])
    ins += [jnp.asarray(tree_start, jnp.int32), tree_visible] if has_tree else []
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    return pl.pallas_call(
        kern, grid=(b * nqb, nkv, ns), out_shape=outs, in_specs=[full(x.shape) for x in ins],
        out_specs=[full(o.shape) for o in outs], name="pjax_cache_attention",
        **call_kwargs(num_warps, num_stages, interpret),
    )(*ins)


def _merge_kernel(o_ref, m_ref, l_ref, *refs, t, g, hd, ns, nsp, rb, db, has_sinks, interpret):
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
    t_out = jnp.where(rmask, t_idx, t if interpret else 0)
    pltriton.store(out_ref.at[b, t_out[:, None], (h * g + j_idx)[:, None], dims[None, :]], o.astype(out_ref.dtype),
                   mask=rmask[:, None] & (dims < hd)[None, :])


def merge(o_s, m_s, l_s, *, t: int, nh: int, hd: int, sinks=None, dtype=jnp.bfloat16,
          config: AttentionConfig = DEFAULT, interpret: Optional[bool] = None):
    """Merge the splits (and the sinks) in float32 -> [B, T, nh, hd] in one launch; rows r = (query t, head j)."""
    b, ns, nkv, m_rows, hdp = o_s.shape
    nsp = next_pow2(ns)
    db = min(config.merge_dims, hdp)
    # rows per program: a power of two (Triton blocks) dividing the rows (the Mosaic kernel's swapped partials: 96)
    rb = math.gcd(m_rows, 1 << (max(1, min(m_rows, config.merge_tile // (nsp * db))).bit_length() - 1))
    interpret = dispatch.interpret(interpret)
    spare = 1 if interpret else 0  # see the final store in _merge_kernel; the result is [B, T, nh, hd] either way
    ins = [o_s, m_s, l_s] + ([sinks.astype(jnp.float32)] if sinks is not None else [])
    out = pl.pallas_call(
        functools.partial(_merge_kernel, t=t, g=nh // nkv, hd=hd, ns=ns, nsp=nsp, rb=rb, db=db,
                          has_sinks=sinks is not None, interpret=interpret),
        grid=(b, nkv, (m_rows // rb) * (hdp // db)), out_shape=jax.ShapeDtypeStruct((b, t + spare, nh, hd), dtype),
        in_specs=[pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in ins],
        out_specs=pl.BlockSpec((b, t + spare, nh, hd), lambda *_: (0, 0, 0, 0)), name="pjax_cache_attention_merge",
        **call_kwargs(config.merge_warps, 1, interpret),
    )(*ins)
    return out[:, :t] if spare else out


def cache_attention(q, k, v, q_pos, *, scale: float, window: Optional[int] = None, sinks=None, kv_len=None,
                    tree_start=None, tree_visible=None, block_k: Optional[int] = None, splits: Optional[int] = None,
                    num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                    config: AttentionConfig = DEFAULT, interpret: Optional[bool] = None):
    """Same contract as `pjax.kernels.cache_attention.reference.cache_attention` (`partials` for the other
    arguments), plus a token tree: tree_start [B] int32 (the tree's first cache slot) and tree_visible [B, T, n]
    bool, n >= T (query i sees tree slot tree_start + j iff tree_visible[b, i, j]), or both None. With a tree, query
    i sees the keys at slot < tree_start by the position rules vs q_pos (window, kv_len), the tree slots by
    tree_visible alone, nothing from tree_start + n on."""
    check_inputs(q, k, v, q_pos, kv_len, sinks)
    check_tree(q, tree_start, tree_visible, window)
    parts = partials(q, k, v, q_pos, scale=scale, window=window, kv_len=kv_len, tree_start=tree_start,
                     tree_visible=tree_visible, block_k=block_k, splits=splits, num_warps=num_warps,
                     num_stages=num_stages, config=config, interpret=interpret)
    _, t, nh, hd = q.shape
    return merge(*parts, t=t, nh=nh, hd=hd, sinks=sinks, dtype=q.dtype, config=config, interpret=interpret)
