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
    lowbit_block_n: int = 64  # low-bit weights: output columns per program at most (FP8 at 64 pairs x 128 columns
    #                           overflowed the 227 KiB of shared memory)
    mxfp4_block_k: int = 256  # MXFP4 inputs per step (8 scale groups): 1.1x 128 inputs, 1.5x 512
    mxfp4_stages: int = 2  # MXFP4 tiles in flight: 2 ran 1.02-1.09x 3 (decode in registers, not loads, bounds it)
    lowbit_steps: int = 4  # FP8 weights: k tiles per loop iteration at most at 16 padded pairs (fewer above, see
    #                        pallas.k_steps): FP8 at 4 x 128 ran 1.2x faster than at 16 x 128


DEFAULT = ExpertMatmulConfig()
