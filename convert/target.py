"""Hugging Face target checkpoints -> `pjax.Target` (strict, shape-checked), and pjax-native orbax copies.

Names are derived from the parameter tree: `layers.{i}.self_attn.q_proj.kernel` <-> HF
`model.layers.{i}.self_attn.q_proj.weight` (transposed), and so on; families with special tensors
(stacked or quantised experts) register a hook in `HOOKS`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from convert.errors import CheckpointError
from convert.safetensors_io import Checkpoint
from pjax.config import ConfigError, ModelConfig
from pjax.models.families import config_from_hf
from pjax.target import Target, abstract_target

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
NATIVE_MARKER = "pjax_target.json"


class TensorSource:
    """Reads HF tensors as float32/int numpy, dequantising FP8 block-scaled weights transparently."""

    def __init__(self, ckpt: Checkpoint, quant: Optional[dict]):
        self.ckpt, self.quant, self.consumed = ckpt, quant or {}, set()
        method = self.quant.get("quant_method")
        if method not in (None, "fp8", "mxfp4"):
            raise CheckpointError(f"{ckpt.dir / 'config.json'}: quantization_config.quant_method {method!r} "
                                  "is not supported (supported: fp8 block-scaled, mxfp4)")
        self.block = tuple(self.quant.get("weight_block_size") or (128, 128))
        if method == "fp8" and self.quant.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(f"{ckpt.dir / 'config.json'}: fp8 activation_scheme "
                                  f"{self.quant.get('activation_scheme')!r} is not supported (expected 'dynamic')")

    def has(self, name) -> bool:
        return name in self.ckpt

    def shape(self, name):
        return self.ckpt.shape(name)

    def raw(self, name) -> np.ndarray:
        if name not in self.ckpt:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name!r} is missing")
        self.consumed.add(name)
        return self.ckpt.get(name)

    def read(self, name, expected_shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as float32 (dequantised if it has an FP8 `weight_scale_inv`), shape-checked."""
        if name not in self.ckpt:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name!r} is missing (expected shape "
                                  f"{list(expected_shape)})")
        found = self.ckpt.shape(name)
        if tuple(found) != tuple(expected_shape):
            raise CheckpointError(f"{self.ckpt.file_of(name)}: tensor {name!r} has shape {list(found)}, "
                                  f"expected {list(expected_shape)}")
        arr = self.raw(name)
        scale_name = name + "_scale_inv"
        if scale_name in self.ckpt:
            arr = dequant_fp8_block(arr, self.raw(scale_name), self.block, name)
        elif arr.dtype.itemsize == 1 and arr.dtype.kind not in "iub":
            raise CheckpointError(f"{self.ckpt.file_of(name)}: FP8 tensor {name!r} has no {scale_name!r}")
        return arr if arr.dtype.kind in "iub" else np.asarray(arr, np.float32)


def dequant_fp8_block(w, scale_inv, block, name=""):
    """FP8 weight [out, in] x per-block scale [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    bo, bi = block
    out_dim, in_dim = w.shape
    want = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"tensor {name + '_scale_inv'!r} has shape {list(scale_inv.shape)}, expected "
                              f"{list(want)} for a {list(w.shape)} weight with {bo}x{bi} blocks")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, 0), bi, 1)[:out_dim, :in_dim]
    return np.asarray(w, np.float32) * s


# A hook returns (array in pjax layout) for a parameter path it owns, or None to fall back to the rules.
Hook = Callable[[tuple, tuple, TensorSource, str, ModelConfig], Optional[np.ndarray]]
HOOKS: dict[str, Hook] = {}


def _qwen3_moe_hook(path, shape, src: TensorSource, prefix, cfg):
    if len(path) != 4 or path[0] != "layers" or path[2] != "mlp":
        return None
    layer, name = path[1], path[3]
    base = f"{prefix}layers.{layer}.mlp"
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    if name == "gate_up":  # per expert gate/up [I, H] -> stacked [E, H, 2I]
        return np.stack([np.concatenate([src.read(f"{base}.experts.{x}.gate_proj.weight", (i, h)).T,
                                         src.read(f"{base}.experts.{x}.up_proj.weight", (i, h)).T], axis=1)
                         for x in range(e)])
    if name == "down":
        return np.stack([src.read(f"{base}.experts.{x}.down_proj.weight", (h, i)).T for x in range(e)])
    return None


HOOKS["qwen3_moe"] = _qwen3_moe_hook

# Module-name exceptions per family: pjax path fragment -> HF fragment.
RENAMES = {"qwen3_moe": {"mlp.router": "mlp.gate"}, "gpt_oss": {}}


def hf_name(path: tuple, prefix: str, family: str) -> tuple[str, bool]:
    """pjax param path -> (HF tensor name, transpose?)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[:2] == ["embed_tokens", "embedding"]:
        return f"{prefix}embed_tokens.weight", False
    if parts[0] == "lm_head":
        return "lm_head.weight", True
    mod = ".".join(parts[:-1])
    for a, b in RENAMES.get(family, {}).items():
        mod = mod.replace(a, b)
    if leaf == "kernel":
        return f"{prefix}{mod}.weight", True
    if leaf == "layer_scalar" or leaf == "sinks":
        return f"{prefix}{'.'.join(parts)}", False
    return f"{prefix}{mod + '.' if mod else ''}{leaf}", False


def detect_prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.", "model.language_model.", ""):
        if f"{prefix}embed_tokens.weight" in ckpt:
            return prefix
    raise CheckpointError(f"{ckpt.dir}: no embed_tokens.weight found (tried prefixes 'model.', "
                          "'model.language_model.', '')")


def read_hf_config(path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path}: not found")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


def load_hf_params(path, cfg: ModelConfig, hf: dict, dtype) -> Target:
    ckpt = Checkpoint(path)
    src = TensorSource(ckpt, hf.get("quantization_config"))
    prefix = detect_prefix(ckpt)
    abstract = abstract_target(cfg, dtype)
    hook = HOOKS.get(cfg.model_type)
    leaves, treedef = jax.tree.flatten_with_path(abstract.params)
    out = []
    for kpath, leaf in leaves:
        path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kpath)
        arr = hook(path, leaf.shape, src, prefix, cfg) if hook else None
        if arr is None:
            name, transpose = hf_name(path, prefix, cfg.model_type)
            want = tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape)
            arr = src.read(name, want)
            arr = arr.T if transpose else arr
        if tuple(arr.shape) != tuple(leaf.shape):
            raise CheckpointError(f"{path}: produced shape {list(arr.shape)}, expected {list(leaf.shape)}")
        out.append(jnp.asarray(arr, dtype))
    if cfg.tie_word_embeddings and "lm_head.weight" in ckpt:
        emb = src.raw(f"{prefix}embed_tokens.weight")
        if not np.array_equal(np.asarray(src.raw("lm_head.weight"), np.float32), np.asarray(emb, np.float32)):
            raise CheckpointError(f"{ckpt.file_of('lm_head.weight')}: tie_word_embeddings is true but "
                                  "lm_head.weight differs from embed_tokens.weight")
    extra = sorted(k for k in ckpt.keys() if k not in src.consumed and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(f"{ckpt.dir}: {len(extra)} unexpected tensor(s) for model_type "
                              f"{cfg.model_type!r}: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return Target(cfg, abstract.graphdef, jax.tree.unflatten(treedef, out))


def load_target(path, dtype=jnp.bfloat16) -> Target:
    """Load a Hugging Face model directory (config.json + model.safetensors or a sharded index), or a
    pjax-native directory written by `python -m convert target`."""
    path = Path(path)
    if (path / NATIVE_MARKER).exists():
        from convert.native import load_native_target
        return load_native_target(path, dtype)
    hf = read_hf_config(path)
    try:
        cfg = config_from_hf(hf, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return load_hf_params(path, cfg, hf, dtype)
