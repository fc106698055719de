"""Integrity of loaded weights, checked on device in one jitted pass over all tensors.

- `check_finite`: every floating tensor is free of NaN / inf (all loaders, by default). One program reduces
  every leaf to a flag; only the [n] flags come back to the host.
- `checksums`: per-tensor checksums of pjax-native copies, written at conversion and compared at load.
  Algorithm `CHECKSUM`: a tensor's bits as unsigned words w_i (8 / 16 / 32-bit words widened to 32 bits;
  64-bit values as two words; bool as 0 / 1), two lanes k of sum_i fmix(w_i xor (i * 0x9E3779B1 + seed_k))
  modulo 2**32, with fmix the murmur3 32-bit finaliser; 16 hex digits. Integer arithmetic only, so every backend
  gives the same value for the same bits (the summation order does not matter modulo 2**32). Changing one
  word always changes it (fmix is a bijection); random damage to several words goes unnoticed with
  probability about 2**-64. It detects corruption, not deliberate tampering.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pjax.checkpoint.errors import CheckpointError

__all__ = ["CHECKSUM", "check_finite", "checksums", "finite_flags", "nonfinite_counts"]

CHECKSUM = "fmix32x2-v1"  # the name written to pjax_target.json; change it with the algorithm
_SEEDS = (0x243F6A88, 0x85A308D3)
_GOLDEN = 0x9E3779B1  # odd: i -> i * _GOLDEN + seed is a bijection of the word index
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fmix(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x) -> jax.Array:
    """uint32 [n]: the bits of `x` as 32-bit words."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(x, _UINT[size]).astype(jnp.uint32).reshape(-1)


@jax.jit
def _checksum_words(leaves):
    """uint32 [n, 2]: both checksum lanes of every leaf."""
    rows = []
    for x in leaves:
        w = _words(x)
        i = jnp.arange(w.shape[0], dtype=jnp.uint32)
        rows.append(jnp.stack([jnp.sum(_fmix(w ^ (i * jnp.uint32(_GOLDEN) + jnp.uint32(s))), dtype=jnp.uint32)
                               for s in _SEEDS]))
    return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.uint32)


def checksums(leaves: Sequence) -> list[str]:
    """The `CHECKSUM` of each array in `leaves` (jax or numpy), as 16 hex digits; one device pass."""
    words = np.asarray(_checksum_words(list(leaves)))
    return [f"{int(a):08x}{int(b):08x}" for a, b in words]


@jax.jit
def finite_flags(leaves):
    """bool [n]: whether each leaf is free of NaN / inf (True for integer, bool and empty leaves). Every element
    is tested (`all(isfinite(x))`): a float reduction such as max |x| may drop a NaN (XLA's CPU backend returns
    0.0 for the max of float32 arrays of a few thousand elements holding one)."""
    flags = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
             for x in leaves]
    return jnp.stack(flags) if flags else jnp.zeros((0,), bool)


@jax.jit
def nonfinite_counts(leaves):
    """int32 [n]: how many NaN / inf values each floating leaf holds (0 for integer and bool leaves)."""
    counts = [jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) if jnp.issubdtype(x.dtype, jnp.inexact)
              else jnp.int32(0) for x in leaves]
    return jnp.stack(counts) if counts else jnp.zeros((0,), jnp.int32)


def check_finite(leaves: Sequence, describe: Callable[[int], str],
                 hint: str = "pass check_finite=False / --no-finite-check to load it anyway") -> None:
    """Raise CheckpointError when a leaf holds NaN / inf; `describe(i)` names leaf i ("FILE: tensor 'NAME'"), `hint`
    ends the message. One device pass (`finite_flags`) over all leaves; the failing ones are then counted."""
    leaves = list(leaves)
    bad = np.flatnonzero(~np.asarray(finite_flags(leaves)))
    if bad.size:
        i = int(bad[0])
        count = int(np.asarray(nonfinite_counts([leaves[i]]))[0])
        others = [describe(int(j)).rpartition(": ")[2] for j in bad[1:4]]
        more = f"; also {', '.join(others)}{' ...' if bad.size > 4 else ''}" if others else ""
        raise CheckpointError(f"{describe(i)} has {count} non-finite value(s) (NaN / inf) as "
                              f"{jnp.dtype(leaves[i].dtype).name}{more} ({hint})")
