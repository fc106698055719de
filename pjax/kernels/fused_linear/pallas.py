"""Pallas (Triton) kernels for the linear layers of a decoder layer at few rows (decode, verify, drafting).

Why: at one to sixteen rows a decoder layer's cost is its weight bytes, but XLA runs it as ~18 kernels of 1-7 us,
each followed by a ~1 us launch gap (a batch-1 445M decode step: 0.2 ms of weights, 1.02 ms of step; H200,
docs/performance.md "Small models are launch-bound"). These kernels fold the small ops around each product into it:

- `norm_qkv`: RMSNorm prologue, the q / k / v products from the three weights as stored (no concatenated copy), the
  optional per-head q/k RMSNorm (Qwen3) and half-split RoPE epilogue; three outputs. Replaces the norm's reduction and
  scaling fusions, the one-row pad, the merged GEMM and the two RoPE fusions.
- `norm_swiglu`: RMSNorm prologue, gate and up products, silu(gate) * up epilogue. Replaces the norm fusions, the
  pad, the merged gate/up GEMM and the activation fusion.
- `linear_residual`: residual + x @ w (the o- and down-projections). Replaces the pad, the GEMM and the add.
- `norm_linear`: the RMSNorm prologue alone (a normed projection without epilogue).

Layout: every program streams a column block of the weight(s) over all of K once ([bk, bn] tiles, `stages` in
flight) and multiplies the M rows (padded in registers to 16, the tensor-core dot's minimum; rows past M are masked
at the store) into float32 accumulators. Column blocks shrink (down to 16) until the grid covers two programs per SM,
since at one row the weight stream is the whole cost. The RMSNorm statistics are recomputed by every program from
the M x K activation rows (a few KiB from L2); the normalised tile is rebuilt per K step before its dot. For q / k a
program owns `bh` columns of the first half of a head and the same `bh` columns of its second half, so each RoPE pair
(i, i + hd/2) is in one program whatever the column block (with q/k-norm a program owns whole heads).

Bytes moved (HBM, M rows, itemsize s): the weights K x N_total x s, plus M x (K + N_total) x s for rows in and out
(+ M x N x s residual, + 2 x M x hd/2 x 4 for cos/sin): at M = 1 the weights are all of it. Roofline at 4.3 TB/s for
the 445M Llama shape of the benchmarks (hidden 1024, 16 heads x 64, intermediate 3840, bf16): norm_qkv 6.3 MB,
1.46 us; norm_swiglu 15.7 MB, 3.66 us; linear_residual o-proj 2.1 MB, 0.49 us, down-proj 7.9 MB, 1.83 us: 7.4 us a
layer (XLA: ~42 us). Llama-3.1-8B shape: 11.7 + 54.6 + 7.8 + 27.3 = 101 us a layer.

Numerics: float32 statistics and accumulation. The norm follows `reference.rms_norm` cast for cast (x * rsqrt in
float32, cast to the dtype, times the weight in the dtype; or the float32 multiply then cast); each product is
rounded to the dtype as XLA's GEMM output is, then the epilogue runs in float32 on those rounded values (and on cos /
sin rounded to the dtype, as `apply_rope` casts them) and rounds once: the residual add is then exact to the
reference's rounding, while silu / RoPE may differ from XLA's elementwise chain by an ulp of the dtype (XLA rounds
after each bf16 op on some backends). float32 inputs multiply at the precision JAX's default matmul precision asks
for (`_pallas_util.dot_precision`). Sums over K are in a different order than XLA's, as any two GEMMs.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch, hardware
from pjax.kernels._pallas_util import call_kwargs, dot_precision, next_pow2
from pjax.kernels.fused_linear.config import DEFAULT, FusedLinearConfig
from pjax.kernels.fused_linear.reference import check_inputs, check_qkv

__all__ = ["linear_residual", "norm_linear", "norm_qkv", "norm_swiglu", "unsupported_reason"]

F32 = jnp.float32
FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def padded_rows(m: int) -> int:
    return max(16, next_pow2(m))  # dot rows: at least 16


def _pow2_divisor(n: int, cap: int) -> int:
    return min(cap, n & -n)


def _target(config: FusedLinearConfig) -> int:
    return config.programs_per_sm * hardware.gpu().wave


def column_block(n: int, config: FusedLinearConfig = DEFAULT) -> int:
    """Output columns per program: the largest power of two <= block_n dividing n, halved (down to min_block_n)
    while n / bn programs are fewer than the grid target."""
    bn = _pow2_divisor(n, config.block_n)
    while bn > config.min_block_n and n // bn < _target(config):
        bn //= 2
    return bn


def half_block(half: int, heads: int, qk_norm: bool, config: FusedLinearConfig = DEFAULT) -> int:
    """Columns per half-head of a q/k/v program (`heads` = nh + 2 nkv): the whole half with q/k-norm (the norm needs
    the head's every column), else the largest power of two <= block_n dividing half, halved like `block_n`."""
    if qk_norm:
        return half
    bh = _pow2_divisor(half, config.block_n)
    while bh > config.min_block_n and heads * (half // bh) < _target(config):
        bh //= 2
    return bh


def block_k(k: int, rows: int, cols: int, itemsize: int, config: FusedLinearConfig = DEFAULT) -> int:
    """Weight rows per pipeline step: the largest power of two <= block_k dividing k, halved until `stages` steps
    of the [rows, bk] activation tile and the [bk, cols] weight tiles fit in a block's shared memory."""
    bk = _pow2_divisor(k, config.block_k)
    budget = hardware.gpu().smem_per_block - config.smem_reserve
    while bk > 16 and config.stages * bk * (rows + cols) * itemsize > budget:
        bk //= 2
    return bk


def unsupported_reason(m: int, k: int, widths, dtypes, *, head_dim: Optional[int] = None, qk_norm: bool = False,
                       config: FusedLinearConfig = DEFAULT) -> Optional[str]:
    """None when the kernels take M rows of K features into outputs of `widths` (and heads of `head_dim`), with
    operands of `dtypes`; else why not (the api runs the reference)."""
    dts = {jnp.dtype(d) for d in dtypes}
    if m > config.max_rows:
        return f"{m} rows: at most {config.max_rows} (more rows are XLA's GEMMs)"
    if len(dts) != 1 or next(iter(dts)) not in FLOATS:
        return f"operand dtypes {sorted(str(d) for d in dts)}: one of bfloat16 / float16 / float32 for all"
    if k % 16 or any(n % 16 for n in widths):
        return f"K={k} and output widths {tuple(widths)}: multiples of 16 only (tensor-core dot tiles)"
    if head_dim is not None:
        half = head_dim // 2
        if half % 16:
            return f"head_dim={head_dim}: head_dim / 2 must be a multiple of 16 (RoPE halves as dot tiles)"
        if qk_norm and (half & (half - 1) or half > 2 * config.block_n):
            return f"head_dim={head_dim} with q/k-norm: head_dim / 2 must be a power of two <= {2 * config.block_n}"
    return None


# ---------------------------------------------------------------------------------------------------- kernel pieces


def _rows(m: int, mp: int):
    """(lanes 0..mp-1, in-bounds row per lane (padding lanes repeat row m - 1), lane < m)."""
    lanes = jnp.arange(mp, dtype=jnp.int32)
    return lanes, jnp.minimum(lanes, m - 1), lanes < m


def _load_rows(ref, row, cols):
    return pltriton.load(ref.at[row[:, None], cols[None, :]])


def _store_rows(ref, lanes, real, cols, value):
    """Rows `lanes` of columns `cols`; padding lanes (past M, out of the output's bounds) are masked off."""
    pltriton.store(ref.at[lanes[:, None], cols[None, :]], value.astype(ref.dtype), mask=real[:, None])


def _rounded(a, dtype):
    """float32 value of `a` rounded to `dtype` (what an XLA op with a `dtype` output would hold)."""
    return a.astype(dtype).astype(F32)


def _scale(xf, w, dtype, fp32_multiply: bool):
    """`reference.rms_norm`'s last step: xf (float32, already times rsqrt) times the weight, in the dtype."""
    if fp32_multiply:
        return (xf * w.astype(F32)[None, :]).astype(dtype)
    return (_rounded(xf, dtype) * w.astype(F32)[None, :]).astype(dtype)


def _inv_rms(x_ref, row, k: int, bk: int, eps: float):
    """[mp] float32 rsqrt(mean(x^2) + eps) of each row, over all K (one pass over the rows)."""
    kk = jnp.arange(bk, dtype=jnp.int32)

    def step(c, ss):
        xt = _load_rows(x_ref, row, c * bk + kk).astype(F32)
        return ss + jnp.sum(xt * xt, axis=1)

    ss = jax.lax.fori_loop(0, k // bk, step, jnp.zeros(row.shape, F32))
    return jax.lax.rsqrt(ss / k + eps)


def _products(x_ref, row, tiles, *, k: int, bk: int, precision, norm=None):
    """float32 [mp, width] x[rows] @ w[:, col0:col0 + width] for each (w_ref, col0, width) of `tiles`, one pass over
    K. norm = (inv_rms [mp], norm weight ref [K], fp32_multiply): each activation tile is RMS-normalised first."""
    kk = jnp.arange(bk, dtype=jnp.int32)
    dtype = x_ref.dtype

    def step(c, accs):
        k0 = pl.multiple_of(c * bk, bk)
        xt = _load_rows(x_ref, row, k0 + kk)
        if norm is not None:
            inv, nw_ref, fp32_multiply = norm
            xt = _scale(xt.astype(F32) * inv[:, None], nw_ref[pl.ds(k0, bk)], dtype, fp32_multiply)
        return tuple(acc + jax.lax.dot(xt, w_ref[pl.ds(k0, bk), pl.ds(c0, width)], precision=precision,
                                       preferred_element_type=F32)
                     for acc, (w_ref, c0, width) in zip(accs, tiles))

    zeros = tuple(jnp.zeros((row.shape[0], width), F32) for _, _, width in tiles)
    return jax.lax.fori_loop(0, k // bk, step, zeros)


# ---------------------------------------------------------------------------------------------------------- kernels


def _linear_kernel(*refs, m, mp, k, bk, bn, eps, fp32_multiply, epilogue, precision):
    """One program: columns [j bn, +bn) of the output. epilogue "none" / "swiglu" (refs: x, norm weight, w_gate,
    w_up) take the norm prologue; "residual" (refs: x, w, residual) does not."""
    j = pl.program_id(0)
    lanes, row, real = _rows(m, mp)
    c0 = pl.multiple_of(j * bn, bn)
    cols = c0 + jnp.arange(bn, dtype=jnp.int32)
    o_ref = refs[-1]
    dtype = o_ref.dtype
    if epilogue == "residual":
        x_ref, w_ref, r_ref, _ = refs
        (acc,) = _products(x_ref, row, [(w_ref, c0, bn)], k=k, bk=bk, precision=precision)
        out = _load_rows(r_ref, row, cols).astype(F32) + _rounded(acc, dtype)
    else:
        x_ref, nw_ref, *w_refs, _ = refs
        norm = (_inv_rms(x_ref, row, k, bk, eps), nw_ref, fp32_multiply)
        accs = _products(x_ref, row, [(w, c0, bn) for w in w_refs], k=k, bk=bk, precision=precision, norm=norm)
        if epilogue == "swiglu":
            g, u = (_rounded(a, dtype) for a in accs)
            out = g * jax.nn.sigmoid(g) * u
        else:
            (out,) = accs
    _store_rows(o_ref, lanes, real, cols, out)


def _qkv_kernel(*refs, m, mp, k, bk, bh, hd, counts, eps, fp32_multiply, qk_norm, precision):
    """One program: `bh` columns of the first half of one head of q, k or v (program ids in that order) and the
    same columns of the head's second half; RoPE (and q/k-norm) for q and k."""
    if qk_norm:
        x_ref, nw_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, qn_ref, kn_ref, q_ref, k_ref, v_ref = refs
    else:
        x_ref, nw_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref = refs
        qn_ref = kn_ref = None
    pid = pl.program_id(0)
    lanes, row, real = _rows(m, mp)
    dtype = q_ref.dtype
    half = hd // 2
    subs = half // bh  # programs per head
    norm = (_inv_rms(x_ref, row, k, bk, eps), nw_ref, fp32_multiply)
    segments = ((wq_ref, q_ref, qn_ref, True), (wk_ref, k_ref, kn_ref, True), (wv_ref, v_ref, None, False))

    def head_block(local, w_ref, o_ref, hn_ref, rope):
        head, j = local // subs, local % subs
        c1 = pl.multiple_of(head * hd + j * bh, bh)
        c2 = pl.multiple_of(c1 + half, bh)
        a1, a2 = (_rounded(a, dtype) for a in _products(x_ref, row, [(w_ref, c1, bh), (w_ref, c2, bh)], k=k, bk=bk,
                                                         precision=precision, norm=norm))
        if hn_ref is not None:  # per-head RMSNorm: this program holds the whole head (bh == half)
            inv = jax.lax.rsqrt((jnp.sum(a1 * a1, axis=1) + jnp.sum(a2 * a2, axis=1)) / hd + eps)[:, None]
            a1 = _rounded(_scale(a1 * inv, hn_ref[pl.ds(0, half)], dtype, fp32_multiply), dtype)
            a2 = _rounded(_scale(a2 * inv, hn_ref[pl.ds(half, half)], dtype, fp32_multiply), dtype)
        if rope:
            hc = j * bh + jnp.arange(bh, dtype=jnp.int32)
            cos, sin = (_rounded(_load_rows(r, row, hc), dtype) for r in (cos_ref, sin_ref))
            a1, a2 = a1 * cos - a2 * sin, a2 * cos + a1 * sin
        arange = jnp.arange(bh, dtype=jnp.int32)
        _store_rows(o_ref, lanes, real, c1 + arange, a1)
        _store_rows(o_ref, lanes, real, c2 + arange, a2)

    start = 0
    for (w_ref, o_ref, hn_ref, rope), count in zip(segments, counts):
        pl.when((pid >= start) & (pid < start + count))(
            functools.partial(head_block, pid - start, w_ref, o_ref, hn_ref, rope))
        start += count


# ---------------------------------------------------------------------------------------------------- entry points


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, args, out_shapes, grid: int, name: str, config: FusedLinearConfig, interpret: Optional[bool]):
    return pl.pallas_call(
        kernel, grid=(grid,), out_shape=out_shapes, in_specs=[_full(a.shape) for a in args],
        out_specs=[_full(o.shape) for o in out_shapes], name=name,
        **call_kwargs(config.warps, config.stages, dispatch.interpret(interpret)),
    )(*args)


def _raise_if_unsupported(op: str, reason: Optional[str]):
    if reason:
        raise ValueError(f"{op} implementation='pallas': {reason}")


def _linear(op, epilogue, x, norm_weight, ws, residual, *, eps, fp32_multiply, config, interpret, block_n=None):
    m, k = x.shape
    n = ws[0].shape[1]
    operands = [x, *ws] + ([norm_weight] if norm_weight is not None else []) + ([residual] if residual is not None
                                                                                  else [])
    _raise_if_unsupported(op, unsupported_reason(m, k, (n,), [a.dtype for a in operands], config=config))
    mp = padded_rows(m)
    bn = column_block(n, config) if block_n is None else block_n
    if bn < 16 or bn & (bn - 1) or n % bn:
        raise ValueError(f"{op}: block_n={bn} must be a power of two >= 16 dividing N={n}")
    bk = block_k(k, mp, len(ws) * bn, x.dtype.itemsize, config)
    kernel = functools.partial(_linear_kernel, m=m, mp=mp, k=k, bk=bk, bn=bn, eps=eps, fp32_multiply=fp32_multiply,
                               epilogue=epilogue, precision=dot_precision(x.dtype))
    args = [x, *ws, residual] if epilogue == "residual" else [x, norm_weight, *ws]
    (out,) = _call(kernel, args, [jax.ShapeDtypeStruct((m, n), x.dtype)], n // bn, f"pjax_{op}", config, interpret)
    return out


def norm_linear(x, norm_weight, w, *, eps: float, fp32_multiply: bool = False, block_n: Optional[int] = None,
                config: FusedLinearConfig = DEFAULT, interpret: Optional[bool] = None):
    """Same contract as `reference.norm_linear`; block_n overrides the column tile (benchmarks); interpret: None =
    interpret mode off GPU."""
    check_inputs("norm_linear", x, {"w": w}, {"norm_weight": (norm_weight, x.shape[1])})
    return _linear("norm_linear", "none", x, norm_weight, [w], None, eps=eps, fp32_multiply=fp32_multiply,
                   config=config, interpret=interpret, block_n=block_n)


def norm_swiglu(x, norm_weight, w_gate, w_up, *, eps: float, fp32_multiply: bool = False,
                block_n: Optional[int] = None, config: FusedLinearConfig = DEFAULT, interpret: Optional[bool] = None):
    """Same contract as `reference.norm_swiglu`; block_n, interpret as `norm_linear`."""
    check_inputs("norm_swiglu", x, {"w_gate": w_gate, "w_up": w_up}, {"norm_weight": (norm_weight, x.shape[1])})
    if w_gate.shape != w_up.shape:
        raise ValueError(f"norm_swiglu: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    return _linear("norm_swiglu", "swiglu", x, norm_weight, [w_gate, w_up], None, eps=eps,
                   fp32_multiply=fp32_multiply, config=config, interpret=interpret, block_n=block_n)


def linear_residual(x, w, residual, *, block_n: Optional[int] = None, config: FusedLinearConfig = DEFAULT,
                    interpret: Optional[bool] = None):
    """Same contract as `reference.linear_residual`; block_n, interpret as `norm_linear`."""
    check_inputs("linear_residual", x, {"w": w}, rows={"residual": (residual, w.shape[1])})
    return _linear("linear_residual", "residual", x, None, [w], residual, eps=0.0, fp32_multiply=False,
                   config=config, interpret=interpret, block_n=block_n)


def norm_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, *, head_dim: int, eps: float, fp32_multiply: bool = False,
             q_norm=None, k_norm=None, block_n: Optional[int] = None, config: FusedLinearConfig = DEFAULT,
             interpret: Optional[bool] = None):
    """Same contract as `reference.norm_qkv`; block_n overrides the columns per half-head program (a power of two
    >= 16 dividing head_dim / 2); interpret as `norm_linear`."""
    check_qkv(x, norm_weight, w_q, w_k, w_v, cos, sin, head_dim, q_norm, k_norm)
    qk_norm = q_norm is not None
    m, k = x.shape
    weights = [x, norm_weight, w_q, w_k, w_v] + ([q_norm, k_norm] if qk_norm else [])
    _raise_if_unsupported("norm_qkv", unsupported_reason(m, k, (w_q.shape[1], w_k.shape[1]),
                                                         [a.dtype for a in weights], head_dim=head_dim,
                                                         qk_norm=qk_norm, config=config))
    half = head_dim // 2
    nh, nkv = w_q.shape[1] // head_dim, w_k.shape[1] // head_dim
    bh = half_block(half, nh + 2 * nkv, qk_norm, config) if block_n is None else block_n
    if bh < 16 or bh & (bh - 1) or half % bh or (qk_norm and bh != half):
        raise ValueError(f"norm_qkv: block_n={bh} must be a power of two >= 16 dividing head_dim / 2 = {half} "
                         f"(equal to it with q/k-norm)")
    mp = padded_rows(m)
    bk = block_k(k, mp, 2 * bh, x.dtype.itemsize, config)
    subs = half // bh
    counts = (nh * subs, nkv * subs, nkv * subs)
    kernel = functools.partial(_qkv_kernel, m=m, mp=mp, k=k, bk=bk, bh=bh, hd=head_dim, counts=counts, eps=eps,
                               fp32_multiply=fp32_multiply, qk_norm=qk_norm, precision=dot_precision(x.dtype))
    args = [x, norm_weight, w_q, w_k, w_v, cos.astype(F32), sin.astype(F32)] + ([q_norm, k_norm] if qk_norm else [])
    outs = [jax.ShapeDtypeStruct((m, w.shape[1]), x.dtype) for w in (w_q, w_k, w_v)]
    return tuple(_call(kernel, args, outs, sum(counts), "pjax_norm_qkv", config, interpret))
