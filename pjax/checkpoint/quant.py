"""Dequantisation of quantised checkpoints: FP8 block-scaled weights (e4m3 + `weight_scale_inv`) and MXFP4 experts
(FP4-E2M1 blocks + E8M0 scales), and transformers' `modules_to_not_convert` rule."""
from __future__ import annotations

import re

import numpy as np

from pjax.checkpoint.errors import CheckpointError

__all__ = ["FP4_E2M1", "dequant_fp8_block", "dequant_mxfp4", "fp8_block_scales", "should_convert_module"]

FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)


def should_convert_module(module: str, patterns) -> bool:
    """transformers' rule for `modules_to_not_convert`: a pattern excludes a module when it matches as a
    prefix (regex `re.match`, with or without a following '.') or is a suffix of the module name."""
    return not any(re.match(f"{p}\\.", module) or re.match(p, module) or module.endswith(p) for p in patterns or ())


def dequant_mxfp4(blocks, scales) -> np.ndarray:
    """blocks uint8 [..., G, 16] (low nibble = even element), scales uint8 [..., G] (E8M0, bias 127)
    -> float32 [..., G * 32]: FP4-E2M1 value * 2 ** (scale - 127)."""
    blocks = np.asarray(blocks, np.uint8)
    vals = np.stack([FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]], axis=-1)  # [..., G, 16, 2]
    vals = vals.reshape(*blocks.shape[:-1], 32)
    vals = np.ldexp(vals, np.asarray(scales, np.int32)[..., None] - 127)
    return vals.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def _scale_values(scale_inv) -> np.ndarray:
    """Block scales as float32: float tensors as-is, uint8 as E8M0 exponents (2 ** (b - 127))."""
    s = np.asarray(scale_inv)
    if s.dtype == np.uint8:
        return np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)
    return s.astype(np.float32)


def fp8_block_scales(w, scale_inv, block, name="") -> np.ndarray:
    """The float32 block scales [..., ceil(out/bo), ceil(in/bi)] of an FP8 weight [..., out, in], shape-checked
    (a single per-tensor scale of a one-block weight is reshaped)."""
    bo, bi = block
    *lead, out_dim, in_dim = w.shape
    want = (*lead, -(-out_dim // bo), -(-in_dim // bi))
    s = _scale_values(scale_inv)
    if s.size == 1 and want[-2:] == (1, 1):
        s = s.reshape(want)
    if tuple(s.shape) != want:
        raise CheckpointError(f"tensor {name + '_scale_inv'!r} has shape {list(s.shape)}, expected "
                              f"{list(want)} for a {list(w.shape)} weight with {bo}x{bi} blocks")
    return s


def dequant_fp8_block(w, scale_inv, block, name=""):
    """FP8 weight [..., out, in] x per-block scale [..., ceil(out/bo), ceil(in/bi)] -> float32 [..., out, in].

    Element (r, c) is multiplied by scale[r // bo, c // bi] (the FP8 kernels' convention; equals
    transformers' dequantisation whenever the block divides the weight)."""
    bo, bi = block
    *_, out_dim, in_dim = w.shape
    s = fp8_block_scales(w, scale_inv, block, name)
    s = np.repeat(np.repeat(s, bo, -2), bi, -1)[..., :out_dim, :in_dim]
    return np.asarray(w, np.float32) * s
