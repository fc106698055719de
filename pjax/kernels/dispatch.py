"""Backend selection shared by the kernel `api.py` modules."""
from __future__ import annotations

import functools

import jax

IMPLEMENTATIONS = ("xla", "pallas", "auto")


@functools.lru_cache(maxsize=None)
def pallas_gpu_available() -> bool:
    """True when the default backend is a CUDA GPU and the Pallas Triton lowering imports."""
    try:
        if jax.default_backend() != "gpu":
            return False
        from jax.experimental.pallas import triton  # noqa: F401
        return True
    except Exception:  # pragma: no cover - import failures on exotic installs
        return False


def resolve(implementation: str, *, auto_pallas: bool = True) -> str:
    """'xla' | 'pallas' from the user's choice; `auto_pallas` = the kernel won on GPU for this op/shape."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, found {implementation!r}")
    if implementation == "auto":
        return "pallas" if (auto_pallas and pallas_gpu_available()) else "xla"
    return implementation


_FORCE_COMPILED = [False]  # set by _pallas_util.lower_for_gpu while lowering for CUDA on a CPU host


def interpret() -> bool:
    """Pallas interpret mode everywhere except on a GPU backend."""
    return not _FORCE_COMPILED[0] and jax.default_backend() != "gpu"
