"""Low-bit weights as they ship in checkpoints, kept packed on the device: `QuantizedWeight` and its jnp
dequantisation (the reference every low-bit kernel is tested against).

Layout: the checkpoint's [..., out, in] (the contraction along the last, contiguous axis), exposed with the
logical shape of the unquantised pjax weight [..., in, out].
- "mxfp4": data uint8 [..., out, in / 2], two FP4-E2M1 values a byte (low nibble first), scales uint8
  [..., out, in / 32] (E8M0: 2 ** (s - 127) per 32 values along `in`).
- "fp8": data float8_e4m3fn [..., out, in], scales float32 [..., ceil(out / bo), ceil(in / bi)] for blocks
  (bo, bi) (value = data * scale of its block; DeepSeek-style `weight_scale_inv`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMATS", "FP8_BLOCK", "QuantizedWeight", "dequantize", "is_quantized", "mxfp4_tile", "random_weight",
           "take", "zero_cotangent"]

FORMATS = ("mxfp4", "fp8")
MXFP4_BLOCK = 32
FP8_BLOCK = (128, 128)  # the block-scaled FP8 checkpoints' (out, in) scale blocks


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    data: jax.Array
    scales: jax.Array
    format: str = dataclasses.field(metadata=dict(static=True), default="mxfp4")
    block: tuple = dataclasses.field(metadata=dict(static=True), default=(1, MXFP4_BLOCK))  # (out, in) per scale

    @property
    def shape(self) -> tuple:
        """The logical shape [..., in, out] of the weight it encodes."""
        *lead, out, packed = self.data.shape
        return (*lead, packed * (2 if self.format == "mxfp4" else 1), out)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["data", "scales"], meta_fields=["format", "block"])


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


MXFP4_HALF_SCALE = 2.0 ** 14  # mxfp4_halves(code) * this = the code's value


def mxfp4_halves(nibbles):
    """FP4-E2M1 codes (int32, 0..15) -> float16 values / 2 ** 14: the code's sign and magnitude bits placed in a
    float16's sign, exponent and mantissa (a float16 with exponent e and mantissa bit m is 2 ** (e - 15) * (1 + m / 2),
    denormal m * 2 ** -15). Exact; bit operations only (the same in a Triton kernel)."""
    bits = ((nibbles & 8) << 12) | ((nibbles & 7) << 9)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


def mxfp4_tile(codes, scale_codes, dtype):
    """Packed MXFP4 bytes [n, b / 2] (int32) and their E8M0 scale codes [n, b / 32] -> the values [n, b] in
    `dtype`: codes decoded to exact float16 (`mxfp4_halves`), low / high nibbles interleaved, scaled in float32
    (exact: powers of two). jnp only: the same in a Pallas (Triton) kernel's registers as in XLA."""
    n, half = codes.shape
    vals = jnp.stack([mxfp4_halves(codes & 15), mxfp4_halves(codes >> 4)], axis=-1)  # [n, b / 2, 2]
    vals = vals.reshape(n, scale_codes.shape[1], MXFP4_BLOCK).astype(jnp.float32)
    scale = e8m0_values(scale_codes) * MXFP4_HALF_SCALE
    return (vals * scale[:, :, None]).reshape(n, 2 * half).astype(dtype)


def e8m0_values(codes):
    """E8M0 scale codes (uint8) -> float32 2 ** (code - 127) (code 0 flushes to 0, 255 is inf: neither occurs in
    real checkpoints)."""
    return jax.lax.bitcast_convert_type(codes.astype(jnp.int32) << 23, jnp.float32)


def dequantize(w: QuantizedWeight, dtype=jnp.float32):
    """The weight in `dtype`, logical layout [..., in, out]."""
    if w.format == "mxfp4":
        *lead, rows, half = w.data.shape
        codes = w.data.reshape(-1, half).astype(jnp.int32)
        out = mxfp4_tile(codes, w.scales.reshape(codes.shape[0], -1), jnp.float32).reshape(*lead, rows, 2 * half)
    else:
        bo, bi = w.block
        *_, rows, cols = w.data.shape
        s = jnp.repeat(jnp.repeat(w.scales.astype(jnp.float32), bo, -2), bi, -1)[..., :rows, :cols]
        out = w.data.astype(jnp.float32) * s
    return jnp.swapaxes(out, -1, -2).astype(dtype)


def random_weight(key, shape: tuple, fmt: str, std: float = 0.02) -> QuantizedWeight:
    """Random packed weights of logical shape [..., in, out] whose dequantised values spread about `std` (MXFP4:
    within a factor sqrt(2), one power-of-two scale), generated in packed form (no float copy): MXFP4 uniform random
    codes (rms ~2.9), FP8 bfloat16-normal values in FP8_BLOCK blocks with one scale. For benchmarks and device
    checks."""
    *lead, din, dout = shape
    if fmt == "mxfp4" and din % MXFP4_BLOCK:
        raise ValueError(f"random_weight: MXFP4 needs in % {MXFP4_BLOCK} == 0, found shape {tuple(shape)}")
    if fmt == "mxfp4":
        exponent = round(math.log2(std / 2.9))
        data = jax.random.bits(key, (*lead, dout, din // 2), jnp.uint8)
        return QuantizedWeight(data, jnp.full((*lead, dout, din // MXFP4_BLOCK), 127 + exponent, jnp.uint8))
    if fmt != "fp8":
        raise ValueError(f"random_weight: format {fmt!r}, expected one of {FORMATS}")
    data = (64 * jax.random.normal(key, (*lead, dout, din), jnp.bfloat16)).astype(jnp.float8_e4m3fn)
    blocks = (*lead, -(-dout // FP8_BLOCK[0]), -(-din // FP8_BLOCK[1]))
    return QuantizedWeight(data, jnp.full(blocks, std / 64, jnp.float32), "fp8", FP8_BLOCK)


def zero_cotangent(w: QuantizedWeight) -> QuantizedWeight:
    """The cotangent of a packed weight (a constant): float0 for its integer codes, zeros for float ones."""
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0) if jnp.issubdtype(a.dtype, jnp.integer)
                        else jnp.zeros_like(a), w)


def take(w: QuantizedWeight, ids) -> QuantizedWeight:
    """The experts `ids` of a stacked [E, ...] weight (indexed as `w[ids]`)."""
    return dataclasses.replace(w, data=w.data[ids], scales=w.scales[ids])
