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
Measured against the XLA path at the Qwen3-30B-A3B and GPT-OSS-20B expert shapes: docs/performance.md.
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
from pjax.kernels.expert_matmul.config import DEFAULT, ExpertMatmulConfig
from pjax.kernels.expert_matmul.reference import check_inputs


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


def unsupported_reason(x, w, repeat: int = 1, config: ExpertMatmulConfig = DEFAULT):
    """None when the kernel takes these shapes, else why not (the caller uses the reference)."""
    p, din = x.shape[0] * repeat, x.shape[1]
    dout = w.shape[2]
    if x.dtype != w.dtype:
        return f"x {x.dtype} and w {w.dtype}: one dtype only (the tensor-core dot)"
    if p > config.max_rows:
        return f"{p} rows: at most {config.max_rows}"
    if din % 16 or dout % 16:
        return f"din {din} / dout {dout}: multiples of 16 only"
    return None


def _expert(ids, e_count):
    """`w[ids]` indexing in the kernel: negative ids wrap, too large ones clamp (as the reference)."""
    return jnp.clip(jnp.where(ids < 0, ids + e_count, ids), 0, e_count - 1)


def _kernel(ids_ref, x_ref, w_ref, o_ref, *, p, pp, din, bk, bn, e_count, repeat, precision):
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
        kk = jnp.arange(bk, dtype=jnp.int32)

        def step(c, acc):
            k0 = pl.multiple_of(c * bk, bk)
            xt = pltriton.load(x_ref.at[(row // repeat)[:, None], (k0 + kk)[None, :]], mask=mine[:, None], other=0)
            wt = w_ref[e, pl.ds(k0, bk), pl.ds(j * bn, bn)]
            return acc + jax.lax.dot(xt, wt, precision=precision, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, din // bk, step, jnp.zeros((pp, bn), jnp.float32))
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
    bk, bn = tiles(p, din, dout, config)
    if block_n is not None:
        if block_n < 16 or block_n & (block_n - 1) or dout % block_n or pp * block_n > config.acc_elements:
            raise ValueError(f"expert_matmul: block_n={block_n} must be a power of two >= 16 dividing dout={dout}, "
                             f"at most {config.acc_elements // pp} for {p} rows")
        bn = block_n
    out_rows = pp if interpret else p  # interpret mode: every padding lane its own row (see the store in _kernel)
    ids = expert_ids.astype(jnp.int32)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    out = pl.pallas_call(
        functools.partial(_kernel, p=p, pp=pp, din=din, bk=bk, bn=bn, e_count=w.shape[0], repeat=repeat,
                          precision=dot_precision(x.dtype)),
        grid=(p, dout // bn), out_shape=jax.ShapeDtypeStruct((out_rows, dout), x.dtype),
        in_specs=[full(ids.shape), full(x.shape), full(w.shape)], out_specs=full((out_rows, dout)),
        name="pjax_expert_matmul", **call_kwargs(config.warps, config.stages, interpret),
    )(ids, x, w)
    return out[:p] if out_rows != p else out
