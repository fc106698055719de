"""Every switch on the installed JAX version, in one place.

pjax runs on JAX 0.10.x (CPU CI) and 0.11.x (the GPU machine). Where their APIs differ, code calls the small
functions here instead of testing versions or attributes itself, so the list of differences stays in one file.
"""
from __future__ import annotations

import functools
import inspect

import jax

__all__ = ["JAX_VERSION", "mosaic_gpu", "mosaic_gpu_interpret_params", "mosaic_gpu_interpret_runs",
           "mosaic_gpu_load", "mosaic_gpu_warp_specialization", "pallas_call_name", "ragged_dot_mgpu"]

JAX_VERSION: tuple[int, int] = tuple(int(x) for x in jax.__version__.split(".")[:2])


def mosaic_gpu():
    """The Pallas Mosaic GPU module (`jax.experimental.pallas.mosaic_gpu`), or None where it does not import."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:  # pragma: no cover - JAX builds without Mosaic GPU
        return None
    return plgpu


def ragged_dot_mgpu():
    """JAX's Hopper grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, in 0.10 and 0.11), or None
    where it does not import."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError:  # pragma: no cover - JAX builds without Mosaic GPU
        return None
    return ragged_dot_mgpu


def mosaic_gpu_warp_specialization() -> bool:
    """True when Mosaic GPU has what the warp-specialised attention kernel uses: `plgpu.kernel` with named thread
    axes and `set_max_registers` (present in 0.10 and 0.11)."""
    plgpu = mosaic_gpu()
    return plgpu is not None and hasattr(plgpu, "kernel") and hasattr(plgpu, "set_max_registers")


def mosaic_gpu_interpret_runs() -> bool:
    """True when Mosaic GPU kernels run in interpret mode on a CPU: JAX >= 0.11 (0.10's interpreter has no CPU rule
    for `plgpu.layout_cast`)."""
    return JAX_VERSION >= (0, 11)


def mosaic_gpu_interpret_params():
    """The interpret-mode parameters of `plgpu.kernel` (simulated threads, barriers, TMA): public in JAX 0.11,
    private in 0.10."""
    plgpu = mosaic_gpu()
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


@functools.lru_cache(maxsize=None)
def _load_takes_index() -> bool:
    return inspect.signature(mosaic_gpu().load).parameters["idx"].default is inspect.Parameter.empty


def mosaic_gpu_load(ref, layout):
    """`plgpu.load` of a whole ref with an explicit register layout (JAX 0.10 requires the index argument, 0.11
    deprecates it)."""
    plgpu = mosaic_gpu()
    if _load_takes_index():
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def pallas_call_name(params) -> str:
    """The kernel name of a `pallas_call` equation's params (`name` in JAX 0.10, `name_and_src_info` in others)."""
    name = params.get("name")
    if name is None and params.get("name_and_src_info") is not None:
        name = params["name_and_src_info"].name
    return name or ""
