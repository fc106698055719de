"""Tuning of the drafter-input metadata kernel (tuned on an H200; measurements in docs/performance.md)."""
from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT", "MetadataConfig"]


@dataclasses.dataclass(frozen=True)
class MetadataConfig:
    rows_per_program: int = 16  # batch rows per program: one program covers batch 1..16, a few cover 64
    warps: int = 4  # programs of >= 8 rows: the [rows, S] tile's scattered stores want more threads than 1-2 warps
    warps_few_rows: int = 1  # programs of < 8 rows (batch 1..7): one warp covers the tile, launch latency dominates


DEFAULT = MetadataConfig()
