"""The grouped matmul on Hopper: JAX's Mosaic GPU `ragged_dot` kernel (`jax.experimental.pallas.ops.gpu.
ragged_dot_mgpu`: TMA loads, wgmma, a persistent grid of one program per SM walking (row tile, column tile) pairs).

Measured on an H200 against pjax's Triton kernel (`pallas.py`) and XLA's `ragged_dot` (docs/performance.md,
"Grouped matmul"): 1.3-2.7x faster than the Triton kernel at every measured MoE shape from 256 to 32,768 pairs, and
faster than `ragged_dot` from 8 mean rows per expert. It takes bf16 / f16 inputs of one dtype with plain (not
packed) weights; packed MXFP4 / FP8 weights stay on the Triton kernel, which dequantises per tile.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

import pjax._compat as _compat
from pjax.kernels import dispatch, hardware
from pjax.kernels.batching import loop_vmap
from pjax.kernels.quantized import is_quantized

# Tiles measured fastest of 64 / 128 rows x 128 / 256 columns x grid_block_n 1 / 4 on the GPT-OSS-20B and
# Qwen3-30B-A3B expert shapes (256 columns gave wrong results where they do not divide the output width)
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GRID_BLOCK_N = 128, 128, 64, 4, 4
# "auto" takes it from this many mean rows per group (the fewest measured: 256 GPT-OSS-20B pairs over 32 experts,
# 1.3x ragged_dot, 1.9x the Triton kernel)
MIN_ROWS_PER_GROUP = 8
ROW_TILE = 8  # its TMA row tiling: more rows than this must be a multiple of it (the wrapper pads)


def available() -> bool:
    """True on a Hopper (sm_90) GPU whose JAX ships `ragged_dot_mgpu`."""
    return (dispatch.on_gpu() and hardware.gpu().compute_capability == (9, 0)
            and _compat.ragged_dot_mgpu() is not None)


def unsupported_reason(x, w, transpose_rhs: bool = False) -> Optional[str]:
    """None when the kernel takes these inputs, else why not."""
    if transpose_rhs:
        return "w [G, N, K] (transpose_rhs: the backward's dx, measured on the Triton kernel only)"
    if is_quantized(w):
        return "packed weights (the Triton kernel dequantises them per tile)"
    if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
        return f"x {x.dtype} and w {w.dtype}: one 16-bit dtype only"
    k, n = w.shape[1:]
    if k % BLOCK_K:
        return f"contraction {k}: a multiple of {BLOCK_K} only"
    if n % 64:
        return f"output width {n}: a multiple of 64 only"
    return None


def grouped_matmul(x, w, group_sizes):
    """out [M, N] = each group's rows of x [M, K] times w[g] ([G, K, N]); rows past sum(group_sizes) are zero (the
    kernel leaves them unwritten). Hopper only (`available`); ValueError for inputs it does not take. Under `jax.vmap`
    one kernel per batch member, in a loop (the kernel has no batching rule of its own)."""
    reason = unsupported_reason(x, w)
    if reason is not None:
        raise ValueError(f"grouped_matmul (mosaic): {reason}")
    return _kernel(x, w, group_sizes)


def _one_kernel(x, w, group_sizes):
    m = x.shape[0]
    pad = -m % ROW_TILE if m > ROW_TILE else 0  # zero rows past every group; sliced off below
    out = _compat.ragged_dot_mgpu().ragged_dot(
        jnp.pad(x, ((0, pad), (0, 0))), w, group_sizes=group_sizes.astype(jnp.int32), block_m=BLOCK_M,
        block_n=BLOCK_N, block_k=BLOCK_K, max_concurrent_steps=STAGES, grid_block_n=GRID_BLOCK_N)[:m]
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


_kernel = loop_vmap(_one_kernel)  # the kernel has no batching rule of its own
