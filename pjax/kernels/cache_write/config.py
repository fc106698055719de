"""Tuning of the cache-write kernel."""
from __future__ import annotations

import dataclasses

__all__ = ["WriteConfig", "DEFAULT"]


@dataclasses.dataclass(frozen=True)
class WriteConfig:
    warps: int = 4  # one program moves one token's [nkv, hd] K and V slabs
    max_auto_tokens: int = 128  # "auto" takes the kernel up to this many new tokens per row (decode, verify and
    #                             drafting shapes, where XLA's scatter costs two extra launches a layer); prefill
    #                             keeps XLA's scatter


DEFAULT = WriteConfig()
