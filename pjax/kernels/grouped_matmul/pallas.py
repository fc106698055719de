"""Pallas (Triton) grouped matmul: megablox-style tiles over rows sorted by group.

Why: `jax.lax.ragged_dot`'s GPU lowering costs what multiplying every row by every group's weight costs; here the
work is the rows' own. The rows are cut into block_m tiles; a tile lying inside one group runs once, a tile
spanning group boundaries runs once per group it touches (rows of other groups masked), so the grid holds at most
ceil(M / block_m) + G + 1 programs per column tile (a static bound; programs past the real tiles exit at once).
Program (t, j) streams x's rows of its tile and w[g]'s column tile j over the contraction and stores its group's
rows. Rows past sum(group_sizes) are written as zeros (ragged_dot's contract).
The weight gradient (`transposed_grouped_matmul`): program (g, i, j) loops over group g's rows only.
Bytes moved (forward): x once per column tile, every non-empty group's weight once per row tile of it, out once.
Numerics: float32 accumulation, the output cast to the input dtype; float32 inputs at JAX's default matmul
precision (`_pallas_util.dot_precision`).
Low-bit weights (`pjax.kernels.quantized.QuantizedWeight`, [G, N, K] packed) are dequantised per tile in registers:
MXFP4 codes and group scales (`quantized.mxfp4_tile`), FP8 tiles cast to x's dtype with their block scale applied to
the product's columns (block_k divides the input block). Bytes moved: the packed weights instead of 2 bytes a weight
(forward only; the backward dequantises, `api.py`).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch
from pjax.kernels._pallas_util import call_kwargs, dot_precision
from pjax.kernels.grouped_matmul.config import DEFAULT, GroupedMatmulConfig, for_shape
from pjax.kernels.grouped_matmul.reference import check_inputs
from pjax.kernels.quantized import MXFP4_BLOCK, is_quantized, mxfp4_tile


def unsupported_reason(x, w, config: Optional[GroupedMatmulConfig] = None):
    """None when the kernels take these inputs, else why not (the caller uses the reference)."""
    if is_quantized(w):
        bk = (config or for_shape(x.shape[0], w.shape[0])).block_k
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return f"x {x.dtype}: floating only"
        if w.format == "mxfp4" and (w.shape[1] % MXFP4_BLOCK or bk % MXFP4_BLOCK):
            return f"MXFP4 K {w.shape[1]}, block_k {bk}: multiples of {MXFP4_BLOCK} only"
        if w.format == "fp8" and w.block[1] % bk:
            return f"FP8 blocks {w.block}: block_k {bk} must divide the input block"
        return None
    if x.dtype != w.dtype:
        return f"x {x.dtype} and w {w.dtype}: one dtype only (the tensor-core dot)"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return f"dtype {x.dtype}: floating inputs only"
    return None


def _cdiv(a, b):
    return -(-a // b)


def tile_schedule(group_sizes, m: int, bm: int):
    """Per program t < ceil(m / bm) + G + 1: (group, row tile, first row, end row) int32 [T] each. Group G is the
    rows past sum(group_sizes) (written as zeros); group G + 1 marks programs with no work."""
    g_count = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.concatenate([starts, ends[-1:]])  # the zero group: rows past the groups
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    tiles = jnp.where(ends > starts, (ends - 1) // bm - starts // bm + 1, 0)
    last = jnp.cumsum(tiles)  # programs of groups <= g
    t = jnp.arange(_cdiv(m, bm) + g_count + 1, dtype=jnp.int32)
    group = jnp.searchsorted(last, t, side="right").astype(jnp.int32)  # G + 1: past the work
    gc = jnp.minimum(group, g_count)
    tile = starts[gc] // bm + t - (last[gc] - tiles[gc])
    return group, tile, starts[gc], ends[gc]


def _indices(start, block, size, clip: bool):
    """(indices, in-bounds mask or None when blocks tile `size` exactly) of the block at `start` along an axis.
    clip (interpret mode, where loads are gathers): out-of-bounds lanes read the last element instead (masked).
    On a GPU the indices stay an arange Triton sees as contiguous; masked lanes touch no memory."""
    idx = start + jnp.arange(block, dtype=jnp.int32)
    ok = None if size % block == 0 else idx < size
    return (jnp.minimum(idx, size - 1) if clip and ok is not None else idx), ok


def _both(a, b):
    """The [len(a), len(b)] mask of two axis masks (None = all in bounds)."""
    if a is None and b is None:
        return None
    if a is None:
        return b[None, :]
    return a[:, None] if b is None else a[:, None] & b[None, :]


def _load(ref, rows, cols, mask, *lead):
    """ref[*lead, rows, cols] (an outer product of index vectors), masked lanes zero (of the ref's dtype: Triton
    casts no integer to float8)."""
    shape = (rows.shape[0], cols.shape[0])
    mask = None if mask is None else jnp.broadcast_to(mask, shape)
    return pltriton.load(ref.at[(*lead, rows[:, None], cols[None, :])], mask=mask,
                         other=None if mask is None else jnp.zeros((), ref.dtype))


def _weight_product(xt, w_refs, ge, k0, ks, k_ok, cols, col_ok, *, k, bk, transpose_rhs, fmt, block, interpret,
                    precision):
    """xt [bm, bk] times the weight tile (contraction ks, columns cols) of group ge: float32 [bm, bn]."""
    if fmt is None:
        (w_ref,) = w_refs
        if transpose_rhs:  # w [G, N, K]
            wt = _load(w_ref, cols, ks, _both(col_ok, k_ok), ge).T
        else:
            wt = _load(w_ref, ks, cols, _both(k_ok, col_ok), ge)
        return jax.lax.dot(xt, wt, precision=precision, preferred_element_type=jnp.float32)
    data_ref, scales_ref = w_refs  # [G, N, K / 2] and [G, N, K / 32] (MXFP4), [G, N, K] and its blocks (FP8)
    if fmt == "mxfp4":
        kp, kp_ok = _indices(k0 // 2, bk // 2, k // 2, interpret)
        kg, kg_ok = _indices(k0 // MXFP4_BLOCK, bk // MXFP4_BLOCK, k // MXFP4_BLOCK, interpret)
        codes = _load(data_ref, cols, kp, _both(col_ok, kp_ok), ge).astype(jnp.int32)
        wt = mxfp4_tile(codes, _load(scales_ref, cols, kg, _both(col_ok, kg_ok), ge), xt.dtype)
        return jax.lax.dot(xt, wt.T, precision=precision, preferred_element_type=jnp.float32)
    wt = _load(data_ref, cols, ks, _both(col_ok, k_ok), ge).astype(xt.dtype)
    rows = jnp.minimum(cols // block[0], scales_ref.shape[1] - 1)  # masked columns: any block (not stored)
    scale = pltriton.load(scales_ref.at[ge, rows, k0 // block[1]]).astype(jnp.float32)
    return jax.lax.dot(xt, wt.T, precision=precision, preferred_element_type=jnp.float32) * scale[None, :]


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, x_ref, *refs, m, k, n, g_count, bm, bk, bn, transpose_rhs,
                fmt, block, interpret, precision):
    *w_refs, o_ref = refs
    t, j = pl.program_id(0), pl.program_id(1)
    group = group_ref[t]
    raw = tile_ref[t] * bm + jnp.arange(bm, dtype=jnp.int32)
    mine = (raw >= lo_ref[t]) & (raw < hi_ref[t])
    x_rows = jnp.minimum(raw, m - 1) if interpret else raw  # masked beyond m
    cols, col_ok = _indices(j * bn, bn, n, interpret)
    ge = jnp.minimum(group, g_count - 1)

    def step(c, acc):
        k0 = pl.multiple_of(c * bk, bk)
        ks, k_ok = _indices(k0, bk, k, interpret)
        xt = _load(x_ref, x_rows, ks, _both(mine, k_ok))
        return acc + _weight_product(xt, w_refs, ge, k0, ks, k_ok, cols, col_ok, k=k, bk=bk,
                                     transpose_rhs=transpose_rhs, fmt=fmt, block=block, interpret=interpret,
                                     precision=precision)

    def store(acc):  # interpret mode: the output is padded to whole tiles, so raw addresses are in bounds
        out_cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
        pltriton.store(o_ref.at[raw[:, None], out_cols[None, :]], acc.astype(o_ref.dtype),
                       mask=jnp.broadcast_to(_both(mine, col_ok), (bm, bn)))

    @pl.when(group < g_count)
    def _():
        store(jax.lax.fori_loop(0, _cdiv(k, bk), step, jnp.zeros((bm, bn), jnp.float32)))

    @pl.when(group == g_count)
    def _():
        store(jnp.zeros((bm, bn), jnp.float32))


def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, config: Optional[GroupedMatmulConfig] = None,
                   interpret: Optional[bool] = None):
    """Same contract as `reference.grouped_matmul` (w may be a `QuantizedWeight` of logical shape [G, K, N], not
    with transpose_rhs); config None: by the mean rows per group (`config.for_shape`); interpret: None = interpret
    mode off GPU."""
    if is_quantized(w) and transpose_rhs:
        raise ValueError("grouped_matmul: a QuantizedWeight is [G, K, N] (packed as [G, N, K]): no transpose_rhs")
    check_inputs(x, w, group_sizes, transpose_rhs)
    reason = unsupported_reason(x, w, config)
    if reason:
        raise ValueError(f"grouped_matmul implementation='pallas': {reason}")
    interpret = dispatch.interpret(interpret)
    m, k = x.shape
    g_count = w.shape[0]
    n = w.shape[1] if transpose_rhs else w.shape[2]
    config = config or for_shape(m, g_count)
    bm, bk, bn = config.block_m, config.block_k, config.block_n
    schedule = tile_schedule(group_sizes, m, bm)
    w_arrays = (w.data, w.scales) if is_quantized(w) else (w,)
    fmt, block = (w.format, w.block) if is_quantized(w) else (None, None)
    # interpret mode: the output padded to whole tiles (masked stores are read-modify-write scatters there)
    out_shape = (_cdiv(m, bm) * bm, _cdiv(n, bn) * bn) if interpret else (m, n)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, m=m, k=k, n=n, g_count=g_count, bm=bm, bk=bk, bn=bn,
                          transpose_rhs=transpose_rhs, fmt=fmt, block=block, interpret=interpret,
                          precision=dot_precision(x.dtype)),
        grid=(schedule[0].shape[0], _cdiv(n, bn)), out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
        in_specs=[full(a.shape) for a in (*schedule, x, *w_arrays)], out_specs=full(out_shape),
        name="pjax_grouped_matmul" + (f"_{fmt}" if fmt else ""), **call_kwargs(config.warps, config.stages, interpret),
    )(*schedule, x, *w_arrays)
    return out[:m, :n] if out_shape != (m, n) else out


def _tgmm_kernel(lo_ref, hi_ref, a_ref, b_ref, o_ref, *, m, da, db, bm, ba, bb, interpret, precision):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[g], hi_ref[g]
    ca, a_ok = _indices(i * ba, ba, da, interpret)
    cb, b_ok = _indices(j * bb, bb, db, interpret)

    def step(c, acc):
        raw = c * bm + jnp.arange(bm, dtype=jnp.int32)
        mine = (raw >= lo) & (raw < hi)
        rows = jnp.minimum(raw, m - 1) if interpret else raw
        at = _load(a_ref, rows, ca, _both(mine, a_ok))
        bt = _load(b_ref, rows, cb, _both(mine, b_ok))
        return acc + jax.lax.dot(at.T, bt, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(lo // bm, jnp.where(hi > lo, _cdiv(hi, bm), lo // bm), step,
                            jnp.zeros((ba, bb), jnp.float32))
    out_a = i * ba + jnp.arange(ba, dtype=jnp.int32)  # interpret mode: the output is padded to whole tiles
    out_b = j * bb + jnp.arange(bb, dtype=jnp.int32)
    mask = _both(a_ok, b_ok)
    pltriton.store(o_ref.at[g, out_a[:, None], out_b[None, :]], acc.astype(o_ref.dtype),
                   mask=None if mask is None else jnp.broadcast_to(mask, (ba, bb)))


def transposed_grouped_matmul(a, b, group_sizes, out_dtype, *, config: GroupedMatmulConfig = DEFAULT,
                              interpret: Optional[bool] = None):
    """Same contract as `reference.transposed_grouped_matmul` (a and b of one dtype)."""
    if a.dtype != b.dtype or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0] or group_sizes.ndim != 1:
        raise ValueError(f"transposed_grouped_matmul: expected a [M, A], b [M, B] of one dtype, group_sizes [G]; "
                         f"found a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, "
                         f"group_sizes {tuple(group_sizes.shape)}")
    interpret = dispatch.interpret(interpret)
    m, da, db, g_count = a.shape[0], a.shape[1], b.shape[1], group_sizes.shape[0]
    bm, ba, bb = config.t_block_m, config.t_block_k, config.t_block_n
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    out_shape = (g_count, _cdiv(da, ba) * ba, _cdiv(db, bb) * bb) if interpret else (g_count, da, db)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, m=m, da=da, db=db, bm=bm, ba=ba, bb=bb, interpret=interpret,
                          precision=dot_precision(a.dtype)),
        grid=(g_count, _cdiv(da, ba), _cdiv(db, bb)), out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        in_specs=[full(starts.shape), full(ends.shape), full(a.shape), full(b.shape)], out_specs=full(out_shape),
        name="pjax_transposed_grouped_matmul", **call_kwargs(config.warps, config.stages, interpret),
    )(starts, ends, a, b)
    return out[:, :da, :db] if out_shape != (g_count, da, db) else out
