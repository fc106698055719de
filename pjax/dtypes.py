"""The one dtype parser of every entry point (API keyword, CLI flag, config value): the same spellings everywhere,
unsupported dtypes rejected by name.

Spellings: "bfloat16" / "bf16", "float32" / "f32" / "fp32", "float16" / "f16" / "fp16", or a numpy / jnp dtype or
scalar type. float64 is refused (JAX runs with 64-bit types off unless `jax_enable_x64` is set; pjax computes in
float32 at most) and so are integer / bool / fp8 dtypes where a floating compute dtype is meant.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

__all__ = ["FLOAT_DTYPES", "dtype_name", "parse_dtype"]

SPELLINGS = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "f32": "float32", "fp32": "float32",
    "float16": "float16", "f16": "float16", "fp16": "float16",
}
FLOAT_DTYPES = ("bfloat16", "float32", "float16")  # compute / parameter / KV-cache dtypes pjax supports


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def parse_dtype(value, *, what: str = "dtype", allowed: Sequence[str] = FLOAT_DTYPES):
    """`value` (a spelling above, or a dtype) -> jnp.dtype, or ValueError naming `what`, the value and `allowed`.

    what: the argument / flag / field being parsed, e.g. "cache_dtype" or "--dtype" (it leads the message)."""
    choices = ", ".join(allowed)
    if isinstance(value, str):
        name = SPELLINGS.get(value.strip().lower())
        if name is None:
            try:
                name = np.dtype(value.strip().lower()).name  # a real dtype name pjax does not take (int8, float64)
            except TypeError:
                raise ValueError(f"{what}={value!r} is not a supported dtype (expected one of {choices}; spellings: "
                                 f"{', '.join(sorted(SPELLINGS))})") from None
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            raise ValueError(f"{what}={value!r} is not a dtype (expected one of {choices})") from None
    if name not in allowed:
        hint = " (64-bit floats are not supported: use float32)" if name == "float64" else ""
        raise ValueError(f"{what}={name} is not supported here{hint}; expected one of {choices}")
    return jnp.dtype(name)
