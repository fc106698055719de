"""Small helpers for the Pallas (Triton) kernels: compiler params, power-of-two padding, lowering check."""
from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import _dispatch
from pjax.kernels._dispatch import interpret


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def triton_params(num_warps: int = 4, num_stages: int = 1):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def call_kwargs(num_warps: int = 4, num_stages: int = 1) -> dict:
    """pallas_call keyword arguments: explicit Triton params (never backend defaults) and interpret mode
    off GPU."""
    return dict(compiler_params=triton_params(num_warps, num_stages), interpret=interpret())


def lower_for_gpu(fn, *args):
    """Lower `fn(*args)` (ShapeDtypeStructs or arrays) for CUDA on any host and return the StableHLO text:
    runs the whole Pallas -> Triton IR lowering (power-of-two shapes, unsupported primitives) without a GPU, and
    for Mosaic GPU kernels the lowering to Mosaic's MLIR with its layout inference and shared-memory check (sm_90a
    is assumed when no GPU is present). Compilation to PTX still only happens on a GPU."""
    from jax._src.pallas.triton import lowering as tl  # private: only for this offline check

    orig = tl.lower_jaxpr_to_triton_module

    def lower_and_verify(*a, **k):
        res = orig(*a, **k)
        if not res.module.operation.verify():  # the checks Triton runs when it parses the module on a GPU
            raise AssertionError("Triton module failed MLIR verification")
        return res

    _dispatch._FORCE_COMPILED[0] = True
    tl.lower_jaxpr_to_triton_module = lower_and_verify
    # JAX >= 0.11 reads the Triton target from the device, or from an abstract one when there is no GPU
    target = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=target)):
            exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(c) for c in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")])(
                *args)
    finally:
        _dispatch._FORCE_COMPILED[0] = False
        tl.lower_jaxpr_to_triton_module = orig
    text = exp.mlir_module()
    if "__gpu$xla.gpu.triton" not in text:
        raise AssertionError("lower_for_gpu: no Triton custom call in the lowered module")
    return text
