"""Small helpers shared by the Pallas (Triton) kernels: compiler params, power-of-two padding, dot precision, exp2."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def call_kwargs(num_warps: int, num_stages: int, interpret: bool) -> dict:
    """pallas_call keyword arguments: explicit Triton params (never backend defaults) and the interpret flag."""
    return dict(compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                interpret=interpret)


def dot_precision(dtype) -> jax.lax.Precision:
    """Precision of a kernel's dot with inputs of `dtype`, from JAX's default matmul precision at trace time
    (`jax.default_matmul_precision`, the one switch for product precision): float32 inputs get full float32
    products (Precision.HIGHEST: Triton's IEEE input precision) under "highest" / "float32" / "F32_F32_F32", TF32
    (DEFAULT / HIGH) otherwise, as XLA's own float32 dots on the same GPU; 16-bit inputs: DEFAULT (the tensor cores
    take them as they are)."""
    if jnp.dtype(dtype) != jnp.float32:
        return jax.lax.Precision.DEFAULT
    setting = jax.config.jax_default_matmul_precision
    if setting is None:
        return jax.lax.Precision.DEFAULT
    if setting in ("F32_F32_F32", "F64_F64_F64"):
        return jax.lax.Precision.HIGHEST
    try:
        return jax.lax.Precision(setting)
    except ValueError:  # another dot algorithm preset (bf16 / tf32 passes): not full float32
        return jax.lax.Precision.DEFAULT


def exp2(x, interpret: bool):
    """2 ** x as one MUFU `ex2.approx.ftz` instruction per element (what Triton's own exp2 emits; Pallas lowers
    jnp.exp2 to libdevice's slower exp2f). Interpret mode uses jnp.exp2."""
    if interpret:
        return jnp.exp2(x)
    return pltriton.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
