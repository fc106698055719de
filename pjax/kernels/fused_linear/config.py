"""Tuning of the fused small-M linear kernels (norm + projection + epilogue; projection + residual).

Measured on an H200 (2026-11-25, `examples/benchmarks/bench_generate.py fused --sweep`, docs/performance.md
"Fused few-row layer kernels"): at the 445M shape the kernels stream their weights at 0.6-1.2 TB/s, slower than the
XLA ops they replace for the gate/up and down products, so "auto" keeps XLA's ops (`auto_max_rows` 0). Of the tile
variants swept, `min_block_n` 32 was the fastest at 1, 8 and 16 rows (the default below); the other values are
sized from the H200's facts (132 SMs, 227 KiB of shared memory per block, ~4.3 TB/s HBM). The grid size scales with
the device's SM count (`pjax.kernels.hardware`).
"""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "FusedLinearConfig"]


@dataclasses.dataclass(frozen=True)
class FusedLinearConfig:
    max_rows: int = 16  # rows (B x T) the kernels take: one [16, bk] x [bk, bn] tensor-core dot per tile (Triton's
    #                     dot needs 16 rows; fewer rows are padded in registers, never in memory). More rows (prefill,
    #                     large verify batches) are compute-heavy enough for XLA's cuBLAS GEMMs: the reference
    auto_max_rows: int = 0  # "auto" on a GPU takes the kernels up to this many rows: 0, measured slower than XLA's
    #                         ops at 1-16 rows ("pallas" takes them)
    block_k: int = 256  # weight rows per pipeline step (the largest power of two <= this dividing K): a [256, 16]
    #                     bf16 tile is 8 KiB, so `stages` of them keep ~24-48 KiB of weights in flight per program,
    #                     about what one SM must have outstanding for its share of HBM bandwidth (Little's law:
    #                     4.3 TB/s x ~0.8 us latency / 132 SMs ~ 26 KiB)
    block_n: int = 64  # output columns per program at most (128 contiguous bytes of a bf16 weight row)
    min_block_n: int = 32  # ... halved down to this while the grid is under its target: at one row the weight is
    #                        the whole cost, so the grid must cover every SM (column tiles are the only split that
    #                        needs no second pass; split-K would need a reduction). 32 measured fastest: a layer's
    #                        four kernels 32.4 us at one row against 39.6 us with 16-column tiles
    programs_per_sm: int = 2  # grid target (x SMs, a power-of-two wave: 256 on an H200): two small programs per SM
    #                           overlap one's epilogue and launch with the other's weight stream
    warps: int = 4  # a [16, bk] activation tile and [bk, <= 64] weight tiles: 4 warps hold them without spilling
    stages: int = 4  # weight tiles in flight per program (Triton's software pipeline)
    smem_reserve: int = 8 * 1024  # shared memory per block left to Triton's scratch (layout conversions); the
    #                               pipeline's tiles get the rest (block_k is halved until they fit)


DEFAULT = FusedLinearConfig()
