"""Tiling of the grouped-matmul kernels (first values for an H200; measurements in docs/performance.md)."""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "GroupedMatmulConfig"]


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
