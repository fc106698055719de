"""Hugging Face target checkpoints -> `pjax.Target` (strict, shape-checked).

Names are derived from the parameter tree: `layers.{i}.self_attn.q_proj.kernel` <-> HF
`model.layers.{i}.self_attn.q_proj.weight` (transposed), and so on; families with special tensors
(stacked or quantised experts) register a hook in `HOOKS`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from pjax.checkpoint import integrity
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import read_hf_config
from pjax.checkpoint.quant import dequant_fp8_block, dequant_mxfp4, fp8_block_scales, should_convert_module
from pjax.checkpoint.safetensors import Checkpoint
from pjax.config import ConfigError, ModelConfig
from pjax.kernels.quantized import QuantizedWeight, is_quantized
from pjax.models.families import config_from_hf
from pjax.models.paths import param_path
from pjax.models.sharding import MODEL_AXIS, axis_size, leaf_spec, put
from pjax.models.target import Target, abstract_target

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


class TensorSource:
    """Reads HF tensors, dequantising FP8 block-scaled weights and MXFP4 experts transparently.

    Unquantised float tensors keep their stored dtype (float32 / float16 / bfloat16); dequantised ones
    come back as float32. `consumed` records every tensor name read, for the strict unused-key check.
    native: the expert hooks keep MXFP4 / FP8 experts packed (`QuantizedWeight`, numpy arrays) instead.
    """

    def __init__(self, ckpt: Checkpoint, quant: Optional[dict], native: bool = False):
        self.ckpt, self.quant, self.consumed, self.native = ckpt, dict(quant or {}), set(), native
        self.where = ckpt.dir / "config.json"
        self.method = self.quant.get("quant_method")
        if self.method not in (None, "fp8", "mxfp4"):
            raise CheckpointError(f"{self.where}: quantization_config.quant_method {self.method!r} "
                                  "is not supported (supported: fp8 block-scaled, mxfp4)")
        block = self.quant.get("weight_block_size", (128, 128) if self.method == "fp8" else None)
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise CheckpointError(f"{self.where}: quantization_config.weight_block_size {block!r} must be two "
                                  "positive integers")
        self.block = None if block is None else tuple(int(x) for x in block)
        if self.method == "fp8" and self.quant.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError(f"{self.where}: fp8 activation_scheme "
                                  f"{self.quant.get('activation_scheme')!r} is not supported (expected 'dynamic')")
        self.not_convert = list(self.quant.get("modules_to_not_convert") or [])
        self.out_dtype = np.dtype(np.float32)  # the target dtype: hooks build big dequantised tensors in it

    def has(self, name) -> bool:
        return name in self.ckpt

    def shape(self, name):
        return self.ckpt.shape(name)

    def raw(self, name) -> np.ndarray:
        if name not in self.ckpt:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name!r} is missing")
        self.consumed.add(name)
        return self.ckpt.get(name)

    def _check(self, name, expected_shape):
        if name not in self.ckpt:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name!r} is missing (expected shape "
                                  f"{list(expected_shape)})")
        found = self.ckpt.shape(name)
        if tuple(found) != tuple(expected_shape):
            raise CheckpointError(f"{self.ckpt.file_of(name)}: tensor {name!r} has shape {list(found)}, "
                                  f"expected {list(expected_shape)}")

    def read(self, name, expected_shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name`, shape-checked; FP8 weights with a `<name>_scale_inv` sibling are dequantised to
        float32 (block size from quantization_config.weight_block_size, per-tensor when it is null)."""
        self._check(name, expected_shape)
        arr = self.raw(name)
        scale_name = name + "_scale_inv"
        block = self._fp8_block(name, arr)
        if block is not None:
            try:
                return dequant_fp8_block(arr, self.raw(scale_name), block, name)
            except CheckpointError as e:
                raise CheckpointError(f"{self.ckpt.file_of(scale_name)}: {e}") from None
        if arr.dtype.itemsize == 1 and arr.dtype.kind not in "iub":
            raise CheckpointError(f"{self.ckpt.file_of(name)}: FP8 tensor {name!r} has no {scale_name!r}")
        if arr.dtype.kind in "iub" or arr.dtype in _NATIVE_FLOATS:
            return arr
        return np.asarray(arr, np.float32)

    def _fp8_block(self, name, arr):
        """The (out, in) scale block of `name` when it is stored FP8 with a `<name>_scale_inv` sibling, else None;
        CheckpointError when such a scale contradicts the quantization config."""
        scale_name = name + "_scale_inv"
        if scale_name not in self.ckpt:
            return None
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        if self.method != "fp8":
            raise CheckpointError(f"{self.ckpt.file_of(name)}: tensor {name!r} has a block scale "
                                  f"{scale_name!r} but {self.where} quant_method is {self.method!r} "
                                  "(expected 'fp8')")
        if not should_convert_module(module, self.not_convert):
            raise CheckpointError(f"{self.ckpt.file_of(name)}: {module!r} is listed in "
                                  "quantization_config.modules_to_not_convert but is stored FP8-quantised")
        return self.block or tuple(arr.shape[-2:])

    def read_fp8_packed(self, name, expected_shape):
        """(float8_e4m3fn data [..., out, in], float32 block scales, block) of an FP8 weight stored with a
        `<name>_scale_inv`, shape- and dtype-checked; None for a weight not stored FP8 (read it with `read`)."""
        self._check(name, expected_shape)
        if name + "_scale_inv" not in self.ckpt:
            return None
        arr = self.raw(name)
        block = self._fp8_block(name, arr)
        if arr.dtype != ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"{self.ckpt.file_of(name)}: FP8 tensor {name!r} has dtype {arr.dtype}, "
                                  "expected float8_e4m3fn")
        scale_name = name + "_scale_inv"
        try:
            scales = fp8_block_scales(arr, self.raw(scale_name), block, name)
        except CheckpointError as e:
            raise CheckpointError(f"{self.ckpt.file_of(scale_name)}: {e}") from None
        return arr, scales, block

    def read_mxfp4(self, name, runtime_shape: tuple[int, int, int], out_dtype=np.float32):
        """MXFP4 experts `<name>_blocks` uint8 [E, out, in/32, 16] + `<name>_scales` uint8 [E, out, in/32]
        -> runtime layout [E, in, out] (transformers' `x @ W` layout) in `out_dtype`; with `native`, a
        `QuantizedWeight` of that logical shape holding the packed bytes."""
        if self.method != "mxfp4":
            raise CheckpointError(f"{self.ckpt.file_of(name + '_blocks')}: tensor {name + '_blocks'!r} is MXFP4 but "
                                  f"{self.where} quant_method is {self.method!r} (expected 'mxfp4')")
        e, din, dout = runtime_shape
        if din % 32:
            raise CheckpointError(f"{self.ckpt.file_of(name + '_blocks')}: {name!r} input dim {din} is not a "
                                  "multiple of the MXFP4 block (32)")
        self._check(name + "_blocks", (e, dout, din // 32, 16))
        self._check(name + "_scales", (e, dout, din // 32))
        blocks, scales = self.raw(name + "_blocks"), self.raw(name + "_scales")
        for tname, t in ((name + "_blocks", blocks), (name + "_scales", scales)):
            if t.dtype != np.uint8:
                raise CheckpointError(f"{self.ckpt.file_of(tname)}: tensor {tname!r} has dtype {t.dtype}, "
                                      "expected uint8")
        if self.native:
            return QuantizedWeight(blocks.reshape(e, dout, din // 2), scales)
        out = np.empty((e, din, dout), out_dtype)
        for x in range(e):  # one expert at a time bounds the float32 temporary
            out[x] = dequant_mxfp4(blocks[x], scales[x]).T
        return out


# A hook returns (array in pjax layout) for a parameter path it owns, or None to fall back to the rules.
Hook = Callable[[tuple, tuple, TensorSource, str, ModelConfig], Optional[np.ndarray]]
HOOKS: dict[str, Hook] = {}


def _moe_param(path):
    """('layers', i, 'mlp', name) -> (i, name) for stacked-expert params, else None."""
    if len(path) == 4 and path[0] == "layers" and path[2] == "mlp":
        return path[1], path[3]
    return None


def _qwen3_moe_hook(path, shape, src: TensorSource, prefix, cfg):
    """Experts from per-expert `experts.{e}.{gate,up,down}_proj.weight` (what save_pretrained writes) or
    the fused runtime layout `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`."""
    hit = _moe_param(path)
    if hit is None or hit[1] not in ("gate_up", "down"):
        return None
    base = f"{prefix}layers.{hit[0]}.mlp.experts"
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    packed = _qwen3_fp8_experts(src, base, hit[1], e, h, i) if src.native else None
    if packed is not None:
        return packed
    if hit[1] == "gate_up":  # pjax [E, H, 2I]: gate half, then up half
        if src.has(f"{base}.gate_up_proj"):
            return src.read(f"{base}.gate_up_proj", (e, 2 * i, h)).transpose(0, 2, 1)
        return np.stack([np.concatenate([src.read(f"{base}.{x}.gate_proj.weight", (i, h)).T,
                                         src.read(f"{base}.{x}.up_proj.weight", (i, h)).T], axis=1)
                         for x in range(e)])
    if src.has(f"{base}.down_proj"):
        return src.read(f"{base}.down_proj", (e, h, i)).transpose(0, 2, 1)
    return np.stack([src.read(f"{base}.{x}.down_proj.weight", (h, i)).T for x in range(e)])


def _qwen3_fp8_experts(src: TensorSource, base, which, e, h, i):
    """FP8 experts kept packed (`QuantizedWeight` [E, out, in]), or None where they are not stored FP8 or the gate
    and up blocks do not meet at a block boundary (those are dequantised)."""
    fused = f"{base}.gate_up_proj" if which == "gate_up" else f"{base}.down_proj"
    if src.has(fused):
        got = src.read_fp8_packed(fused, (e, 2 * i, h) if which == "gate_up" else (e, h, i))
        return None if got is None else QuantizedWeight(got[0], got[1], "fp8", got[2])
    parts = [("gate_proj", (i, h)), ("up_proj", (i, h))] if which == "gate_up" else [("down_proj", (h, i))]
    names = [f"{base}.{x}.{p}.weight" for x in range(e) for p, _ in parts]
    if not src.has(names[0] + "_scale_inv") or (len(parts) == 2 and i % (src.block or (i, h))[0]):
        return None
    got = [src.read_fp8_packed(f"{base}.{x}.{p}.weight", shape) for x in range(e) for p, shape in parts]
    for name, g in zip(names, got):
        if g is None:
            raise CheckpointError(f"{src.ckpt.file_of(name)}: tensor {name!r} has no {name + '_scale_inv'!r} "
                                  "while its sibling experts are FP8-quantised")
    experts = [got[x:x + len(parts)] for x in range(0, len(got), len(parts))]  # [gate, up] or [down] per expert
    data = np.stack([np.concatenate([g[0] for g in ex]) for ex in experts])  # gate rows, then up rows
    scales = np.stack([np.concatenate([g[1] for g in ex]) for ex in experts])
    return QuantizedWeight(data, scales, "fp8", got[0][2])


def _deinterleave(x):
    """[..., 2I] with gate at even and up at odd columns -> [..., 2I] = [gate | up]; a packed weight's output
    rows ([E, 2I, in]) likewise."""
    if is_quantized(x):
        perm = np.concatenate([np.arange(0, x.data.shape[-2], 2), np.arange(1, x.data.shape[-2], 2)])
        return QuantizedWeight(x.data[..., perm, :], x.scales[..., perm, :], x.format, x.block)
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _gpt_oss_hook(path, shape, src: TensorSource, prefix, cfg):
    """Experts in the runtime layout `experts.gate_up_proj [E, H, 2I]` (interleaved gate/up),
    `experts.down_proj [E, I, H]`, or MXFP4 `*_blocks`/`*_scales`; biases `*_proj_bias`. The router
    (`mlp.router.{weight,bias}`) follows the default rules."""
    hit = _moe_param(path)
    if hit is None:
        return None
    base = f"{prefix}layers.{hit[0]}.mlp.experts"
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size

    def experts(name, rshape):
        if src.has(name + "_blocks") or src.has(name + "_scales"):
            return src.read_mxfp4(name, rshape, src.out_dtype)  # exact in bf16 too (FP4 * 2**k)
        return src.read(name, rshape)

    if hit[1] == "gate_up":
        return _deinterleave(experts(f"{base}.gate_up_proj", (e, h, 2 * i)))
    if hit[1] == "gate_up_bias":
        return _deinterleave(src.read(f"{base}.gate_up_proj_bias", (e, 2 * i)))
    if hit[1] == "down":
        return experts(f"{base}.down_proj", (e, i, h))
    if hit[1] == "down_bias":
        return src.read(f"{base}.down_proj_bias", (e, h))
    return None


HOOKS["qwen3_moe"] = _qwen3_moe_hook
HOOKS["gpt_oss"] = _gpt_oss_hook

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


def _other_tower(name: str, prefix: str) -> bool:
    """Multimodal checkpoints (text stack under `model.language_model.`): vision/audio towers are not ours."""
    return prefix == "model.language_model." and not name.startswith(prefix) and name != "lm_head.weight"


def _describe(ckpt: Checkpoint, names: list, path: tuple) -> str:
    """'FILE: tensor NAME' for the tensor(s) a parameter was read from (several for stacked experts)."""
    if not names:
        return f"{ckpt.dir}: parameter {'.'.join(map(str, path))}"
    if len(names) == 1:
        return f"{ckpt.file_of(names[0])}: tensor {names[0]!r}"
    return (f"{ckpt.file_of(names[0])}: tensors {names[0]!r} ... ({len(names)} tensors of parameter "
            f"{'.'.join(map(str, path))})")


WEIGHTS = ("native", "dequantized")


def load_hf_params(path, cfg: ModelConfig, hf: dict, dtype, *, materialize: bool = True,
                   check_finite: bool = True, weights: str = "dequantized", mesh=None,
                   experts: str = "expert") -> Target:
    """Read every parameter of `cfg` from the HF directory `path` (strict: missing, misshapen, non-floating or
    unused tensors raise CheckpointError). check_finite: NaN / inf in any parameter (after the cast to `dtype`)
    raise CheckpointError naming the tensor; checked on device in one pass over all parameters.
    materialize=False validates only (params become ShapeDtypeStructs; the finite check then runs one tensor at
    a time, so memory stays bounded by the largest tensor). weights="native": MXFP4 / FP8 experts stay packed
    (`pjax.kernels.quantized.QuantizedWeight` params, never dequantised); "dequantized": every weight in `dtype`.
    mesh: place each tensor on this `jax.sharding.Mesh` by the plan of `pjax.models.sharding` (experts: its MoE
    mode) as it is read, each device receiving only its slice; None: the default device."""
    if weights not in WEIGHTS:
        raise CheckpointError(f"{path}: weights must be one of {WEIGHTS}, found {weights!r}")
    ckpt = Checkpoint(path)
    src = TensorSource(ckpt, hf.get("quantization_config"), native=weights == "native")
    src.out_dtype = jnp.dtype(dtype)
    prefix = detect_prefix(ckpt)
    abstract = abstract_target(cfg, dtype)
    hook = HOOKS.get(cfg.model_type)
    leaves, treedef = jax.tree.flatten_with_path(abstract.params)
    model = axis_size(mesh, MODEL_AXIS)
    out, finite, described = [], [], []  # finite: (array, index into described) pairs to check
    for kpath, leaf in leaves:
        path = param_path(kpath)
        before = set(src.consumed)
        arr = hook(path, leaf.shape, src, prefix, cfg) if hook else None
        if arr is None:
            name, transpose = hf_name(path, prefix, cfg.model_type)
            want = tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape)
            arr = src.read(name, want)
            arr = arr.T if transpose else arr
        names = sorted(src.consumed - before)
        where = _describe(ckpt, names, path)
        if tuple(arr.shape) != tuple(leaf.shape):
            raise CheckpointError(f"{where}: produced shape {list(arr.shape)}, expected {list(leaf.shape)}")
        packed = is_quantized(arr)
        if not packed and jnp.issubdtype(leaf.dtype, jnp.floating) and not jnp.issubdtype(arr.dtype, jnp.floating):
            raise CheckpointError(f"{where} has dtype {arr.dtype}, expected a floating dtype")
        # packed weights keep their dtypes; their floating parts (FP8 data, scales) are checked as stored
        values = None
        if materialize or check_finite:  # each tensor on the device(s) as it is read
            spec = leaf_spec(path, arr, cfg, model, experts) if mesh is not None else None
            if not packed:
                values = put(arr, None if mesh is None else NamedSharding(mesh, spec), dtype)
            elif mesh is None:
                values = jax.tree.map(jnp.asarray, arr)
            else:
                values = jax.tree.map(lambda a, s: put(a, NamedSharding(mesh, s)), arr, spec)
        to_check = [a for a in jax.tree.leaves(values) if jnp.issubdtype(a.dtype, jnp.floating)] if check_finite \
            else []
        if materialize:
            out.append(values)
            finite += [(a, len(described)) for a in to_check]
        else:
            if to_check:
                integrity.check_finite(to_check, lambda i: where)
            shape = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
            out.append(jax.tree.map(shape, arr) if packed else jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(dtype)))
        described.append(where)
    if cfg.tie_word_embeddings and "lm_head.weight" in ckpt:
        emb = src.raw(f"{prefix}embed_tokens.weight")
        if not np.array_equal(np.asarray(src.raw("lm_head.weight"), np.float32), np.asarray(emb, np.float32)):
            raise CheckpointError(f"{ckpt.file_of('lm_head.weight')}: tie_word_embeddings is true but "
                                  "lm_head.weight differs from embed_tokens.weight")
    extra = sorted(k for k in ckpt.keys() if k not in src.consumed and not k.endswith(IGNORED_SUFFIXES)
                   and not _other_tower(k, prefix))
    if extra:
        raise CheckpointError(f"{ckpt.dir}: {len(extra)} unexpected tensor(s) for model_type "
                              f"{cfg.model_type!r}: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    if materialize and finite:
        integrity.check_finite([a for a, _ in finite], lambda i: described[finite[i][1]])
    return Target(cfg, abstract.graphdef, jax.tree.unflatten(treedef, out))


def read_target_config(path) -> tuple[dict, ModelConfig]:
    """(raw config.json dict, parsed ModelConfig); config problems are reported as CheckpointError."""
    path = Path(path)
    hf = read_hf_config(path)
    try:
        return hf, config_from_hf(hf, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
