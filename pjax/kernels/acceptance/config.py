"""Tuning of the acceptance kernels (tuned on an H200; measurements in docs/performance.md). The grid size scales
with the device's SM count (`pjax.kernels.hardware`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["AcceptanceConfig", "DEFAULT"]


@dataclasses.dataclass(frozen=True)
class AcceptanceConfig:
    tile: int = 1024  # vocabulary lanes per load (a power of two): 4 KB of bf16 logits per load per program
    unroll: int = 4  # loads issued back to back per loop step: the vocabulary loops are latency bound, so more
    #                  bytes in flight per thread beat a longer loop
    programs_per_sm: int = 8  # the vocabulary is split until the grid has this many programs per SM (one wave of
    #                           programs, rounded to a power of two: 1024 on an H200), enough loads in flight
    #                           to stream the logits at bandwidth
    target_programs: Optional[int] = None  # a fixed grid-size target instead of programs_per_sm x SMs (tests)
    warps: int = 4  # per program (both kernels)
    stages: int = 1  # Triton pipelining: the loops issue their own loads ahead (unroll), stages add nothing


DEFAULT = AcceptanceConfig()
