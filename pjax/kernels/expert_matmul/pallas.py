"""Pallas (Triton) expert matmul for the few token-expert pairs of a MoE decode / verify step.

Why: the XLA path gathers the selected experts' weights `w[ids]` into a new [P, din, dout] array before the product
(read, write, read again: three passes over the bytes that matter) and, for one token, XLA turns the batched
vector-matrix product into a column reduction that streams several times slower. Here program (s, j) owns pair
slot s and output columns [j * bn, +bn): if s is the first pair of its expert it streams that expert's [din, bn]
weight tile from HBM once and multiplies it into every pair routed to the same expert (a [pp, bk] x [bk, bn]
`dot` per step, rows of other experts masked to zero); other slots exit at once. Every selected expert is read
exactly once, nothing is materialised.
Bytes moved: distinct selected experts x din x dout x itemsize + P x (din + dout) x itemsize.
Numerics: float32 accumulation, output cast to x's dtype (as the reference); float32 inputs multiply at the
precision JAX's default matmul precision asks for (`_pallas_util.dot_precision`).
Low-bit weights (`pjax.kernels.quantized.QuantizedWeight`, the checkpoint's [E, out, in] layout) are dequantised
in registers: MXFP4 tiles of `mxfp4_block_k` inputs a step (the last steps smaller when it does not divide din),
codes decoded with bit operations to exact float16 and interleaved, their E8M0 group scales applied to the tile
(exact: powers of two), one dot a step (a step per 32-input group, or even / odd inputs in two dots, measured
1.1-2.4x slower); FP8 tiles cast to the activation dtype, several per loop iteration (`k_steps`), their block
scale applied to each product. Bytes moved: the packed data and scales of the selected experts instead of 2 bytes
a weight.
Measured against the XLA path at the Qwen3-30B-A3B and GPT-OSS-20B expert shapes: docs/performance.md.
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
from pjax.kernels._pallas_util import call_kwargs, dot_precision, next_pow2
from pjax.kernels.expert_matmul.config import DEFAULT, ExpertMatmulConfig
from pjax.kernels.expert_matmul.reference import check_inputs
from pjax.kernels.quantized import MXFP4_BLOCK, is_quantized, mxfp4_tile


def _pow2_divisor(n: int, cap: int) -> int:
    return min(cap, n & -n)


def padded_rows(p: int) -> int:
    return max(16, next_pow2(p))  # dot rows: at least 16


def tiles(p: int, din: int, dout: int, config: ExpertMatmulConfig = DEFAULT) -> tuple[int, int]:
    """(bk, bn): power-of-two tiles dividing din / dout (no masked weight loads), bn at most acc_elements / pp and
    halved (down to min_block_n) while the grid would have fewer than programs_per_sm x SMs programs."""
    bk = _pow2_divisor(din, config.block_k)
    bn = _pow2_divisor(dout, min(config.block_n, config.acc_elements // padded_rows(p)))
    target = config.programs_per_sm * hardware.gpu().wave
    while bn > config.min_block_n and p * (dout // bn) < target:
        bn //= 2
    return bk, bn


def k_tile(din: int, w, config: ExpertMatmulConfig = DEFAULT) -> int:
    """The contraction tile: a power of two <= block_k dividing din (and an FP8 weight's input block); MXFP4: the
    largest power of two <= mxfp4_block_k and din (the remainder of din runs as smaller tail tiles, `k_plan`)."""
    if is_quantized(w) and w.format == "mxfp4":
        return max(MXFP4_BLOCK, min(config.mxfp4_block_k, 1 << (din.bit_length() - 1)))
    if is_quantized(w) and w.format == "fp8":
        return _pow2_divisor(math.gcd(din, w.block[1]), config.block_k)
    return _pow2_divisor(din, config.block_k)


def k_steps(din: int, w, pp: int, config: ExpertMatmulConfig = DEFAULT) -> int:
    """k tiles per loop iteration: 1 for plain and MXFP4 weights; for FP8 the largest divisor of their count up to
    lowbit_steps x 16 / pp (the pipelined tiles grow with the padded pairs pp: FP8 at 64 pairs and 4 steps overflowed
    the shared memory, at 1 step it ran)."""
    if not is_quantized(w) or w.format == "mxfp4":
        return 1
    n = din // k_tile(din, w, config)
    cap = max(1, config.lowbit_steps * 16 // pp)
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def k_plan(din: int, w, pp: int, config: ExpertMatmulConfig = DEFAULT) -> tuple[int, int, int, tuple]:
    """(bk, steps, iterations, tail): a loop of `iterations` x `steps` k tiles of bk, then the static tail tiles
    ((offset, size), ...): the binary decomposition of din mod bk (MXFP4 only; multiples of 32)."""
    bk, steps = k_tile(din, w, config), k_steps(din, w, pp, config)
    iterations = din // (bk * steps)
    tail, k0 = [], iterations * bk * steps
    for size in (1 << b for b in reversed(range(bk.bit_length()))):
        if k0 + size <= din and size >= MXFP4_BLOCK:
            tail.append((k0, size))
            k0 += size
    return bk, steps, iterations, tuple(tail)


def measured_faster(w) -> bool:
    """Whether the kernel beat the reference on an H200 for this weight (docs/performance.md): plain and MXFP4
    weights at every measured shape (MXFP4: 2.4-4.5x the dequantise-then-multiply reference); FP8 tied (0.9-0.95x
    at 1 token), so the reference."""
    return not is_quantized(w) or w.format == "mxfp4"


def unsupported_reason(x, w, repeat: int = 1, config: ExpertMatmulConfig = DEFAULT):
    """None when the kernel takes these shapes, else why not (the caller uses the reference)."""
    p, din = x.shape[0] * repeat, x.shape[1]
    dout = w.shape[2]
    if is_quantized(w):
        if w.format == "mxfp4" and din % MXFP4_BLOCK:
            return f"MXFP4 din {din}: multiples of {MXFP4_BLOCK} only"
        if w.format == "fp8" and k_tile(din, w, config) < 16:
            return f"FP8 blocks {w.block} with din {din}: a k tile of 16 must divide both"
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return f"x {x.dtype}: floating only"
    elif x.dtype != w.dtype:
        return f"x {x.dtype} and w {w.dtype}: one dtype only (the tensor-core dot)"
    if p > config.max_rows:
        return f"{p} rows: at most {config.max_rows}"
    if din % 16 or dout % 16:
        return f"din {din} / dout {dout}: multiples of 16 only"
    return None


def _expert(ids, e_count):
    """`w[ids]` indexing in the kernel: negative ids wrap, too large ones clamp (as the reference)."""
    return jnp.clip(jnp.where(ids < 0, ids + e_count, ids), 0, e_count - 1)


def _dense_product(x_tile, w_refs, e, k0, j, bk, bn, precision):
    (w_ref,) = w_refs
    xt = x_tile(k0 + jnp.arange(bk, dtype=jnp.int32))
    wt = w_ref[e, pl.ds(k0, bk), pl.ds(j * bn, bn)]
    return jax.lax.dot(xt, wt, precision=precision, preferred_element_type=jnp.float32)


def _fp8_product(x_tile, w_refs, e, k0, j, bk, bn, precision, block):
    """FP8 data [E, N, K] in the activation dtype (exact), its block scale (bk divides the input block) applied
    per output column to the product."""
    data_ref, scales_ref = w_refs
    xt = x_tile(k0 + jnp.arange(bk, dtype=jnp.int32))
    wt = data_ref[e, pl.ds(j * bn, bn), pl.ds(k0, bk)].astype(xt.dtype)
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    scale = pltriton.load(scales_ref.at[e, cols // block[0], k0 // block[1]]).astype(jnp.float32)
    return jax.lax.dot(xt, wt.T, precision=precision, preferred_element_type=jnp.float32) * scale[None, :]


def _mxfp4_product(x_tile, w_refs, e, k0, j, bk, bn, precision):
    """MXFP4 data [E, N, K / 2], bk inputs (bk / 32 scale groups) a step: the tile decoded and scaled in registers
    (`quantized.mxfp4_tile`), one dot."""
    data_ref, scales_ref = w_refs
    codes = data_ref[e, pl.ds(j * bn, bn), pl.ds(k0 // 2, bk // 2)].astype(jnp.int32)  # [bn, bk / 2]
    xt = x_tile(k0 + jnp.arange(bk, dtype=jnp.int32))
    wt = mxfp4_tile(codes, scales_ref[e, pl.ds(j * bn, bn), pl.ds(k0 // MXFP4_BLOCK, bk // MXFP4_BLOCK)], xt.dtype)
    return jax.lax.dot(xt, wt.T, precision=precision, preferred_element_type=jnp.float32)


def _kernel(ids_ref, x_ref, *refs, p, pp, plan, bn, e_count, repeat, product):
    *w_refs, o_ref = refs
    s, j = pl.program_id(0), pl.program_id(1)
    pairs = jnp.arange(pp, dtype=jnp.int32)
    real = pairs < p
    row = jnp.minimum(pairs, p - 1)  # in-bounds addresses for the padding lanes (masked)
    ids = jnp.where(real, _expert(pltriton.load(ids_ref.at[row]), e_count), -1)
    e = _expert(ids_ref[s], e_count)
    mine = ids == e
    first = jnp.min(jnp.where(mine, pairs, pp)) == s  # the lowest slot of each expert does its work

    @pl.when(first)
    def _():
        def x_tile(cols):  # the rows of this expert's pairs (others zero) at input columns `cols`
            return pltriton.load(x_ref.at[(row // repeat)[:, None], cols[None, :]], mask=mine[:, None], other=0)

        bk, steps, iterations, tail = plan

        def step(c, acc):  # `steps` k tiles, unrolled
            for s_ in range(steps):
                acc = acc + product(x_tile, w_refs, e, pl.multiple_of((c * steps + s_) * bk, bk), j, bk, bn)
            return acc

        acc = jax.lax.fori_loop(0, iterations, step, jnp.zeros((pp, bn), jnp.float32))
        for k0, size in tail:
            acc = acc + product(x_tile, w_refs, e, k0, j, size, bn)
        # interpret mode stores masked lanes as a read-modify-write scatter: there every lane has its own row
        out_row = pairs if o_ref.shape[0] == pp else row
        cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
        pltriton.store(o_ref.at[out_row[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=mine[:, None])


def expert_matmul(x, expert_ids, w, *, repeat: int = 1, block_n=None, config: ExpertMatmulConfig = DEFAULT,
                  interpret: Optional[bool] = None):
    """Same contract as `reference.expert_matmul`; `block_n` overrides the column tile (benchmarks); interpret:
    None = interpret mode off GPU. One launch: ids, rows and the output are read and written in place (no padding
    or slicing ops around it on a GPU)."""
    check_inputs(x, expert_ids, w, repeat)
    reason = unsupported_reason(x, w, repeat, config)
    if reason:
        raise ValueError(f"expert_matmul implementation='pallas': {reason}")
    interpret = dispatch.interpret(interpret)
    p, din = expert_ids.shape[0], x.shape[1]
    dout = w.shape[2]
    pp = padded_rows(p)
    _, bn = tiles(p, din, dout, config)
    if is_quantized(w):
        bn = min(bn, config.lowbit_block_n)
    if block_n is not None:
        if block_n < 16 or block_n & (block_n - 1) or dout % block_n or pp * block_n > config.acc_elements:
            raise ValueError(f"expert_matmul: block_n={block_n} must be a power of two >= 16 dividing dout={dout}, "
                             f"at most {config.acc_elements // pp} for {p} rows")
        bn = block_n
    out_rows = pp if interpret else p  # interpret mode: every padding lane its own row (see the store in _kernel)
    ids = expert_ids.astype(jnp.int32)
    precision = dot_precision(x.dtype)
    stages = config.stages
    if not is_quantized(w):
        w_arrays, product, name = (w,), functools.partial(_dense_product, precision=precision), "pjax_expert_matmul"
    elif w.format == "fp8":
        w_arrays, name = (w.data, w.scales), "pjax_expert_matmul_fp8"
        product = functools.partial(_fp8_product, precision=precision, block=w.block)
    else:
        w_arrays, name, stages = (w.data, w.scales), "pjax_expert_matmul_mxfp4", config.mxfp4_stages
        product = functools.partial(_mxfp4_product, precision=precision)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_kernel, p=p, pp=pp, plan=k_plan(din, w, pp, config), bn=bn, e_count=w.shape[0],
                          repeat=repeat, product=product),
        grid=(p, dout // bn), out_shape=jax.ShapeDtypeStruct((out_rows, dout), x.dtype),
        in_specs=[full(a.shape) for a in (ids, x, *w_arrays)], out_specs=full((out_rows, dout)),
        name=name, **call_kwargs(config.warps, stages, interpret),
    )(ids, x, *w_arrays)
    return out[:p] if out_rows != p else out
