"""Tuning of the fused small-M linear kernels (norm + projection + epilogue; projection + residual).

Not yet tuned on a GPU: the values below are sized from the H200's facts (132 SMs, 227 KiB of shared memory per
block, ~4.3 TB/s measured HBM bandwidth) and must be confirmed with `examples/benchmarks/bench_generate.py fused`,
which times each kernel against the XLA ops it replaces and sweeps the tile values. The grid size scales with the
device's SM count (`pjax.kernels.hardware`).
"""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "FusedLinearConfig"]


@dataclasses.dataclass(frozen=True)
class FusedLinearConfig:
    max_rows: int = 16  # rows (B x T) the kernels take: one [16, bk] x [bk, bn] tensor-core dot per tile (Triton's
    #                     dot needs 16 rows; fewer rows are padded in registers, never in memory). More rows (prefill,
    #                     large verify batches) are compute-heavy enough for XLA's cuBLAS GEMMs: the reference
    auto_max_rows: int = 0  # "auto" on a GPU takes the kernels up to this many rows: 0 until they are measured on a
    #                         GPU ("pallas" takes them); set from `bench_generate.py fused`
    block_k: int = 256  # weight rows per pipeline step (the largest power of two <= this dividing K): a [256, 16]
    #                     bf16 tile is 8 KiB, so `stages` of them keep ~24-48 KiB of weights in flight per program,
    #                     about what one SM must have outstanding for its share of HBM bandwidth (Little's law:
    #                     4.3 TB/s x ~0.8 us latency / 132 SMs ~ 26 KiB)
    block_n: int = 64  # output columns per program at most (128 contiguous bytes of a bf16 weight row)
    min_block_n: int = 16  # ... halved down to this (the dot's minimum) while the grid is under its target: at one
    #                        row the weight is the whole cost, so the grid must cover every SM; narrower column
    #                        tiles are the only split that needs no second pass (split-K would need a reduction)
    programs_per_sm: int = 2  # grid target (x SMs, a power-of-two wave: 256 on an H200): two small programs per SM
    #                           overlap one's epilogue and launch with the other's weight stream
    warps: int = 4  # a [16, bk] activation tile and [bk, <= 64] weight tiles: 4 warps hold them without spilling
    stages: int = 4  # weight tiles in flight per program (Triton's software pipeline)
    smem_reserve: int = 8 * 1024  # shared memory per block left to Triton's scratch (layout conversions); the
    #                               pipeline's tiles get the rest (block_k is halved until they fit)


DEFAULT = FusedLinearConfig()
