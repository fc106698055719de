"""Tiling of the grouped-matmul kernels (measured on an H200: docs/performance.md)."""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "LARGE", "MIN_ROWS_PER_GROUP", "GroupedMatmulConfig", "for_shape"]


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    block_m: int = 64  # rows per tile (a tile spanning a group boundary runs once per group, rows masked)
    block_k: int = 64  # contraction per pipeline step
    block_n: int = 128  # output columns per program
    warps: int = 4
    stages: int = 3
    # weight gradient (rows of one group contracted): a [block_k, block_n] tile of dw per program
    t_block_m: int = 64
    t_block_k: int = 64
    t_block_n: int = 64


DEFAULT = GroupedMatmulConfig()
# many rows per group (prefill: 32,768 GPT-OSS-20B pairs over 32 experts): 128 x 256 tiles, 8 warps (1.3x DEFAULT)
LARGE = GroupedMatmulConfig(block_m=128, block_n=256, warps=8)
LARGE_ROWS_PER_GROUP = 256  # mean rows per group from which LARGE is used
# "auto" runs the kernel from this many mean rows per group: at 8 it lost to ragged_dot (0.5-0.7x, GPT-OSS-20B, 256
# pairs), at 32 it won 2.1-2.8x (1,024 pairs); the crossover between was not measured
MIN_ROWS_PER_GROUP = 16


def for_shape(rows: int, groups: int) -> GroupedMatmulConfig:
    return LARGE if rows >= LARGE_ROWS_PER_GROUP * groups else DEFAULT
