"""Tuning of the expert-matmul kernel (tuned on an H200; measurements in docs/performance.md). The grid size scales
with the device's SM count (`pjax.kernels.hardware`)."""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "ExpertMatmulConfig"]


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    max_rows: int = 128  # token-expert pairs one program holds in its [pairs, block_n] accumulator; more (prefill,
    #                      training) are the grouped matmul's job, so the kernel does not take them
    acc_elements: int = 64 * 128  # float32 accumulators per program at most: 64 registers a thread at 4 warps
    block_k: int = 128  # din per pipeline step (the largest power of two <= this dividing din)
    block_n: int = 128  # output columns per program at most (<= acc_elements / padded pairs)
    min_block_n: int = 32  # block_n is halved down to this while the grid is under its target
    programs_per_sm: int = 2  # grid target (x SMs, a power-of-two wave: 256 on an H200): a program streams only
    #                           ~30 GB/s, so the launch needs every SM busy with two of them
    warps: int = 4
    stages: int = 3  # weight tiles in flight per program


DEFAULT = ExpertMatmulConfig()
