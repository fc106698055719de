"""GPU facts the kernels size themselves by: SM count and shared memory per thread block, read from the device.

Off a GPU (interpret mode on a CPU, or lowering for CUDA on a CPU host) the kernels are sized for `REFERENCE`,
the GPU they were tuned on, so a CPU run exercises the same tiles, splits and grids as that GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

__all__ = ["Gpu", "REFERENCE", "gpu", "smem_per_block"]

KIB = 1024
# Largest dynamic shared memory one thread block may opt into, by compute capability (CUDA programming guide,
# "Technical Specifications per Compute Capability").
SMEM_PER_BLOCK = {(7, 0): 96 * KIB, (7, 2): 96 * KIB, (7, 5): 64 * KIB, (8, 0): 163 * KIB, (8, 6): 99 * KIB,
                  (8, 7): 163 * KIB, (8, 9): 99 * KIB, (9, 0): 227 * KIB, (10, 0): 227 * KIB, (10, 3): 227 * KIB,
                  (12, 0): 99 * KIB, (12, 1): 99 * KIB}
SMEM_DEFAULT = 48 * KIB  # what every CUDA GPU grants a block without opting in (unknown compute capabilities)


@dataclasses.dataclass(frozen=True)
class Gpu:
    """name: device kind; sm_count: streaming multiprocessors; compute_capability: (major, minor);
    smem_per_block: bytes of shared memory one thread block may use."""
    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    smem_per_block: int

    @property
    def wave(self) -> int:
        """Programs in one wave at one program per SM, rounded down to a power of two (the kernels split work in
        powers of two): 128 on a 132-SM H200."""
        return 1 << (max(1, self.sm_count).bit_length() - 1)


REFERENCE = Gpu("NVIDIA H200", 132, (9, 0), 227 * KIB)


def smem_per_block(compute_capability: tuple[int, int]) -> int:
    return SMEM_PER_BLOCK.get(tuple(compute_capability), SMEM_DEFAULT)


def _capability(dev) -> tuple[int, int] | None:
    try:
        major, minor = str(dev.compute_capability).split(".")
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def gpu() -> Gpu:
    """The default device's facts on a GPU backend; `REFERENCE` elsewhere. A GPU that does not report its SM count
    (core_count) or a CUDA compute capability gets the reference's SM count and the no-opt-in shared memory."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return REFERENCE
    cc = _capability(dev) or (0, 0)
    sm = getattr(dev, "core_count", None) or REFERENCE.sm_count
    return Gpu(dev.device_kind, int(sm), cc, smem_per_block(cc))
