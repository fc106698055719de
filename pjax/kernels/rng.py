"""Counter-hash random numbers shared by the jnp references and the Pallas kernels.

No PRNG state and no `jax.random` inside kernels: every number is a pure function of
(request seed, absolute position, vocabulary lane, stream id), so a request's randomness does not
depend on which other requests share the batch, and a kernel recomputing a number gets the same
bits as the reference. Only uint32 multiply / xor / shift are used (no int64), which lower on the
XLA, Triton and Mosaic GPU backends alike.

The mixer is the "lowbias32" integer finaliser (two multiply-xorshift rounds); the three inputs are
absorbed one after the other, each through a full mixing round.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Stream ids: independent noise families at the same (seed, position).
STREAM_ACCEPT = 1  # u_i of the acceptance test at emitted index i (lane 0)
STREAM_RACE = 2  # per-lane noise of the exponential race (recovered / bonus token)

_GOLDEN = np.uint32(0x9E3779B9)
_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)


def mix32(x):
    """lowbias32 bijection on uint32 arrays."""
    x = x ^ (x >> np.uint32(16))
    x = x * _M1
    x = x ^ (x >> np.uint32(15))
    x = x * _M2
    return x ^ (x >> np.uint32(16))


def _u32(x):
    x = jnp.asarray(x)
    return x if x.dtype == jnp.uint32 else x.astype(jnp.int32).astype(jnp.uint32)


def row_key(seed, pos, stream: int):
    """uint32 key of (seed, position, stream); broadcasts."""
    h = mix32(_u32(seed) ^ np.uint32((stream * 0x85EBCA6B + 0x27D4EB2F) & 0xFFFFFFFF))
    return mix32(h + _u32(pos) * _GOLDEN)


def bits(seed, pos, lane, stream: int):
    """uint32 hash of (seed, position, lane, stream); broadcasts."""
    return mix32(row_key(seed, pos, stream) ^ (_u32(lane) * _GOLDEN))


def to_uniform(h):
    """uint32 -> float32 (2k+1) * 2^-24 with k the top 23 bits: exactly representable, in (0, 1)."""
    k = (h >> np.uint32(9)).astype(jnp.int32)
    return (k * 2 + 1).astype(jnp.float32) * np.float32(2.0 ** -24)


def uniform(seed, pos, lane, stream: int):
    """float32 uniform in the open interval (0, 1) keyed on (seed u32, pos i32, lane i32, stream)."""
    return to_uniform(bits(seed, pos, lane, stream))


def gumbel(seed, pos, lane, stream: int = STREAM_RACE):
    """-log(-log(u)): argmax(x + gumbel) samples softmax(x) (the exponential race in log space)."""
    return -jnp.log(-jnp.log(uniform(seed, pos, lane, stream)))
