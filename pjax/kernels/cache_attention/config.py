"""Tuning of the cache-attention kernels: the "auto" thresholds, the Triton split kernel's tiles and pipeline, the
merge kernel, the Mosaic GPU kernel's ring. Tuned on an H200 (JAX 0.11); the measurements behind each value are in
docs/performance.md. Hardware sizes (SM count, shared memory per block) come from the device
(`pjax.kernels.hardware`)."""
from __future__ import annotations

import dataclasses

__all__ = ["AttentionConfig", "DEFAULT"]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    # --- which kernel ("auto"), and what the Triton kernel takes
    max_query_rows: int = 128  # T x g query rows one Triton program holds (registers); past them the kernel runs
    #                            blocks of this many rows, one program each (draft trees); the dispatch sends
    #                            prefill-sized shapes to the reference, also for implementation="pallas"
    max_head_dim: int = 256  # the Triton kernel's [rows, head_dim] tiles beyond this spill
    mosaic_min_tiles: int = 8  # "auto" takes the Mosaic kernel (65..128 rows, Hopper) where each program streams at
    #                            least this many 128-key tiles; shorter programs lose to Triton (~2 us more fixed
    #                            cost per program)

    # --- Triton split kernel: (keys per tile, pipeline stages) by shape, see `pallas.default_tiles`
    block_k: int = 128  # with 3 stages a program keeps 192 KiB of bf16 K/V in flight: one program fills an SM,
    stages: int = 3  # so splits target one wave (one program per SM) and no second, mostly idle wave
    small_block_k: int = 64  # 64 x 3 where 128-key blocks are too few to fill a wave, or where several waves of
    small_stages: int = 3  # short programs (< max_query_rows rows, caches up to short_cache_keys) overlap two per SM
    short_cache_keys: int = 4096
    rows64_block_k: int = 64  # 64-row programs (T x g in 33..64): 64 x 4 (more tiles in flight at the same bytes)
    rows64_stages: int = 4
    min_block_k: int = 16  # tiles are halved down to this until the ring and q fit in shared memory
    warps: int = 4  # warps per program below max_query_rows rows
    warps_full_rows: int = 8  # warps per program of max_query_rows (128) rows
    smem_reserve: int = 3 * 1024  # shared memory per block left to Triton's own scratch (reductions, layout
    #                               conversions): 224 KiB of the H200's 227 KiB for the K/V ring and q

    # --- merge kernel (the splits' partial results -> [B, T, nh, hd])
    merge_tile: int = 8192  # partial-o elements one merge program loads at once ([splits, rows, dims])
    merge_dims: int = 64  # head dims per merge program: 128 contiguous bytes of a bf16 partial row per split
    merge_warps: int = 4  # fewer starve the batch-8 merge, more cost at batch 1

    # --- Mosaic GPU kernel (warp-specialised, Hopper)
    mosaic_block_k: int = 128  # keys per TMA tile: 64-key tiles are slower at every measured shape
    mosaic_stages: int = 2  # ring depth: 2 beats 3 at every measured 16K shape (less shared memory per program)
    swap_max_tiles: int = 16  # the swapped second consumer (rows past 64 as wgmma columns) for programs shorter
    #                           than this many tiles; longer programs amortise the padded rows better


DEFAULT = AttentionConfig()
