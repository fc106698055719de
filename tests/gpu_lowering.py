"""Test harness: lower Pallas kernels for CUDA on a host without a GPU.

`lower_for_gpu(fn, *args)` exports `jax.jit(fn)` for the "cuda" platform, which runs the whole Pallas -> Triton IR
lowering (power-of-two shapes, supported primitives) and, for Mosaic GPU kernels, the lowering to Mosaic's MLIR with
its layout inference and shared-memory check. Compilation to PTX only happens on a GPU. The kernels must be called
with `interpret=False` inside `fn` (their default is interpret mode off GPU).

Each Triton module is also verified (the checks Triton runs when it parses the module on a GPU) and its text kept,
so tests can read attributes of the kernel IR (e.g. a dot's input precision). This needs JAX's private Triton
lowering module: a test-only dependency, never imported by the library.
"""
from __future__ import annotations

import contextlib

import jax

# JAX >= 0.11 reads the Triton target from the device, or from an abstract one when there is none: the GPU the
# kernels are tuned for (`pjax.kernels.hardware.REFERENCE`)
from pjax.kernels.hardware import REFERENCE

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu_v2"


@contextlib.contextmanager
def _verified_triton_modules(out: list):
    from jax._src.pallas.triton import lowering as tl  # private: test harness only

    orig = tl.lower_jaxpr_to_triton_module

    def lower_and_verify(*a, **k):
        res = orig(*a, **k)
        if not res.module.operation.verify():
            raise AssertionError("Triton module failed MLIR verification")
        out.append(str(res.module))
        return res

    tl.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield out
    finally:
        tl.lower_jaxpr_to_triton_module = orig


def export_for_gpu(fn, *args):
    """(StableHLO text of `jax.jit(fn)(*args)` lowered for CUDA, [text of each Triton module it contains])."""
    target = jax.sharding.AbstractDevice(device_kind=REFERENCE.name, num_cores=REFERENCE.sm_count, platform="gpu")
    modules: list[str] = []
    with _verified_triton_modules(modules), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=target)):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(c) for c in (TRITON_CALL, MOSAIC_CALL)])(*args)
    return exp.mlir_module(), modules


def lower_for_gpu(fn, *args) -> str:
    """StableHLO text of `fn(*args)` (ShapeDtypeStructs or arrays) lowered for CUDA; fails unless it holds a Triton
    kernel (every pjax kernel has one: the Mosaic attention's merge is Triton)."""
    text, _ = export_for_gpu(fn, *args)
    if TRITON_CALL not in text:
        raise AssertionError("lower_for_gpu: no Triton custom call in the lowered module")
    return text


def triton_modules(fn, *args) -> list[str]:
    """The Triton IR text of every Pallas Triton kernel in `fn(*args)` lowered for CUDA (at least one)."""
    _, modules = export_for_gpu(fn, *args)
    if not modules:
        raise AssertionError("triton_modules: no Triton kernel in the lowered module")
    return modules
