"""Tiles of the flash-attention training kernels (Triton via Pallas). The starting points are the usual FlashAttention-2
Triton settings for Hopper (forward: 128 query rows x 64 keys, 3 stages; backward: the dK/dV kernel holds 128 keys
and streams 32-row query tiles, the dQ kernel holds 128 query rows and streams 32-key tiles; 4 warps up to head dim
64, 8 above); they are not yet tuned on the H200 (examples/benchmarks/bench_train.py compares the kernel with cuDNN
and the reference)."""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "FlashConfig"]


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    block_q: int = 128  # forward: query rows per program
    block_k: int = 64  # forward: keys per streamed tile
    dkv_block_k: int = 128  # dK/dV kernel: keys per program
    dkv_block_q: int = 32  # dK/dV kernel: query rows per streamed tile
    dq_block_q: int = 128  # dQ kernel: query rows per program
    dq_block_k: int = 32  # dQ kernel: keys per streamed tile
    warps: int = 4  # head dims up to narrow_head_dim; wider heads hold [rows, hd] float32 accumulators twice as
    wide_warps: int = 8  # large (dK and dV together in the backward), spread over twice the threads
    narrow_head_dim: int = 64
    stages: int = 3
    bwd_stages: int = 2

    def num_warps(self, head_dim: int) -> int:
        return self.warps if head_dim <= self.narrow_head_dim else self.wide_warps

    def validate(self) -> "FlashConfig":
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if f.name.startswith(("block", "dkv", "dq")) and (x < 16 or x & (x - 1)):
                raise ValueError(f"FlashConfig.{f.name}={x}: tiles must be powers of two >= 16 (Triton dot shapes)")
        return self


DEFAULT = FlashConfig()
