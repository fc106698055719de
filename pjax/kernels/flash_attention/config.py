"""Tiles of the flash-attention training kernels (Triton via Pallas). The starting points are the usual FlashAttention-2
Triton settings for Hopper (forward: 128 query rows x 64 keys, 4 warps, 3 stages; backward: the dK/dV kernel holds
128 keys and streams 32-row query tiles, the dQ kernel holds 128 query rows and streams 32-key tiles); they are not
yet tuned on the H200 (examples/benchmarks/bench_train.py compares the kernel with cuDNN and the reference)."""
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
    warps: int = 4
    stages: int = 3
    bwd_warps: int = 4
    bwd_stages: int = 2

    def validate(self) -> "FlashConfig":
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if f.name.startswith(("block", "dkv", "dq")) and (x < 16 or x & (x - 1)):
                raise ValueError(f"FlashConfig.{f.name}={x}: tiles must be powers of two >= 16 (Triton dot shapes)")
        return self


DEFAULT = FlashConfig()
