"""Pallas (Triton) cache write: K and V of each new token stored in place, invalid tokens masked out.

Why: in a batch-1 decode step XLA turns the cache scatter into a select (keep the old slot for a dropped token)
and an in-place update per cache, four launches a layer with the RoPE of k; a masked store drops a token without
reading the cache, so K and V take one launch.
Grid (B, T): program (b, t) loads token t's [nkv, hd] K and V and stores them at row b, position positions[b, t]
of the caches (aliased inputs -> outputs, updated in place), masked where the token is not kept.
Bytes moved: 2 * B * T * nkv * hd * itemsize read and written.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjax.kernels import dispatch
from pjax.kernels._pallas_util import call_kwargs, next_pow2
from pjax.kernels.cache_write.config import DEFAULT, WriteConfig
from pjax.kernels.cache_write.reference import keep_mask


def _kernel(pos_ref, keep_ref, kn_ref, vn_ref, _k_in, _v_in, k_ref, v_ref, *, nkv, hd, hp, dp):
    b, t = pl.program_id(0), pl.program_id(1)
    ok = keep_ref[b, t] != 0
    at = jnp.clip(pos_ref[b, t], 0, k_ref.shape[1] - 1)
    h, d = jnp.arange(hp, dtype=jnp.int32), jnp.arange(dp, dtype=jnp.int32)
    m = (h < nkv)[:, None] & (d < hd)[None, :]
    # padding lanes (h >= nkv, d >= hd) keep their out-of-range addresses: masked on the GPU, and dropped by
    # interpret mode's read-modify-write scatter (a clamped address would rewrite a real element with its old value)
    for src, dst in ((kn_ref, k_ref), (vn_ref, v_ref)):
        x = pltriton.load(src.at[b, t, h[:, None], d[None, :]], mask=m, other=0)
        pltriton.store(dst.at[b, at, h[:, None], d[None, :]], x.astype(dst.dtype), mask=m & ok)


def cache_write(k, v, k_new, v_new, positions, valid=None, *, config: WriteConfig = DEFAULT,
                interpret: Optional[bool] = None):
    """Same contract as `pjax.kernels.cache_write.reference.cache_write`."""
    b, t, nkv, hd = k_new.shape
    keep = keep_mask(positions, valid, k.shape[1]).astype(jnp.int32)
    ins = [positions.astype(jnp.int32), keep, k_new, v_new, k, v]
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    kern = functools.partial(_kernel, nkv=nkv, hd=hd, hp=next_pow2(nkv), dp=next_pow2(hd))
    return tuple(pl.pallas_call(
        kern, grid=(b, t), out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        in_specs=[full(x.shape) for x in ins], out_specs=[full(k.shape), full(v.shape)],
        input_output_aliases={4: 0, 5: 1}, name="pjax_cache_write",
        **call_kwargs(config.warps, 1, dispatch.interpret(interpret)),
    )(*ins))
