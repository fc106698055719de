"""P-EAGLE / EAGLE-3 drafter checkpoints <-> `pjax.models.drafter.Drafter` (strict, shape-checked).

Formats read (spec B.1 / B.2):
- speculators (`speculators_model_type` "peagle" | "eagle3"): `config.json` with
  `transformer_layer_config`, weights `layers.0.*` (fused layer), `fc`, `mask_hidden`, `d2t`/`t2d`, ...
- vLLM-native / EAGLE-3 (amazon heads, NeMo Automodel): a llama / qwen3 `config.json` plus
  `draft_vocab_size`, layer 0 stored as `midlayer.*`, mask id under `mask_token_id` / `pard_token` /
  `ptd_token_id`, optional `eagle_config`.
`save_drafter` writes the speculators format (loadable by speculators `from_pretrained` and vLLM).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pjax._io import NATIVE_MARKER, write_json, write_output_dir
from pjax.checkpoint import integrity
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import read_hf_config
from pjax.checkpoint.hf import TensorSource
from pjax.checkpoint.safetensors import Checkpoint, save_file
from pjax.config import ConfigError, ModelConfig, RopeSpec
from pjax.dtypes import parse_dtype
from pjax.models.drafter import Drafter, DrafterConfig, abstract_drafter
from pjax.models.families import PARSERS, config_from_hf, rope_to_hf
from pjax.models.pairing import check_pair
from pjax.models.paths import param_path
from pjax.models.sharding import put

# Training-only frozen copies that speculators never saves; tolerated if an older writer kept them.
IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# vLLM's precedence for the parallel-drafting mask id (spec A.7), minus keys of other methods.
MASK_ID_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
SPECULATORS_VERSION = "0.9.0"


# ----------------------------------------------------------------------------------------- naming

def tensor_name(path: tuple, layout: str = "speculators") -> tuple[str, bool]:
    """pjax param path -> (checkpoint tensor name, transpose?). layout "vllm" stores layer 0 as midlayer."""
    parts = [str(p) for p in path]
    if parts == ["embed_tokens", "embedding"]:
        name, transpose = "embed_tokens.weight", False
    elif parts[-1] == "kernel":
        name, transpose = ".".join(parts[:-1]) + ".weight", True
    else:
        name, transpose = ".".join(parts), False
    if layout == "vllm" and name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name, transpose


# ----------------------------------------------------------------------------------------- config

def _flag(hf: dict, key: str, default: bool, where: str) -> bool:
    v = hf.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"{where}: {key} = {v!r} is not a boolean (unknown norm flag value)")
    return v


def _layer_config(tl: dict, where: str) -> ModelConfig:
    """Draft decoder geometry from a llama / qwen3 config dict (eagle-specific keys ignored)."""
    if not isinstance(tl, dict):
        raise CheckpointError(f"{where}: expected a llama/qwen3 config object, found {type(tl).__name__}")
    # eagle keys and the head's own architectures (e.g. LlamaForCausalLMEagle3) are not draft-layer geometry
    tl = {k: v for k, v in tl.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config", "architectures")}
    mt = tl.get("model_type")
    if mt not in ("llama", "qwen3"):
        raise CheckpointError(f"{where}: model_type {mt!r} is not supported for draft layers (expected 'llama' "
                              "or 'qwen3')")
    if mt == "qwen3" and not tl.get("layer_types") and tl.get("use_sliding_window") and tl.get("sliding_window"):
        # transformers' Qwen3Config default: layers >= max_window_layers slide
        n, mwl = int(tl.get("num_hidden_layers", 0)), int(tl.get("max_window_layers", 28))
        tl["layer_types"] = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    try:
        return config_from_hf(tl, where=where)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _mask_id(hf: dict, where: str) -> Optional[int]:
    found = {k: hf[k] for k in MASK_ID_KEYS if hf.get(k) is not None}
    vals = set(found.values())
    if len(vals) > 1:
        raise CheckpointError(f"{where}: mask token keys disagree: {found} (expected one id)")
    if not vals:
        return None
    v = vals.pop()
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"{where}: mask token id {v!r} is not an integer")
    return v


def _aux_ids(raw, where: str) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or not all(isinstance(i, int) for i in raw):
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of ints, found {raw!r}")
    return tuple(raw)


def _num_depths(hf: dict) -> Optional[int]:
    try:
        methods = hf["speculators_config"]["proposal_methods"]
        return int(methods[0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def is_head_config(hf: dict) -> bool:
    """Whether a config.json describes a drafter head (either layout); a target config has neither key."""
    return "speculators_model_type" in hf or "draft_vocab_size" in hf


def describe_head(path, hf: dict) -> Optional[str]:
    """'a P-EAGLE drafter head (speculators layout)' / 'an EAGLE-3 drafter head (vllm-native layout)' for a head
    directory, None for anything else. A vLLM-native head is P-EAGLE when it stores mask_hidden."""
    if not is_head_config(hf):
        return None
    if "speculators_model_type" in hf:
        kind, layout = hf["speculators_model_type"], "speculators"
    else:
        layout = "vllm-native"
        try:
            kind = "peagle" if "mask_hidden" in Checkpoint(path) else "eagle3"
        except CheckpointError:
            kind = None
    name = {"peagle": "a P-EAGLE drafter head", "eagle3": "an EAGLE-3 drafter head"}.get(kind, "a drafter head")
    return f"{name} ({layout} layout)"


def _not_a_head(path: Path, hf: dict) -> Optional[str]:
    """What a directory that is not a head is, when it is a target pjax could load."""
    if (path / NATIVE_MARKER).exists():
        return "a pjax-native target copy"
    text = hf.get("text_config")
    if hf.get("model_type") in PARSERS or (isinstance(text, dict) and text.get("model_type") in PARSERS):
        return f"a Hugging Face {hf.get('model_type')!r} target"
    return None


def drafter_config_from_hf(hf: dict, where: str, tensor_names=()) -> DrafterConfig:
    """Parse either checkpoint format's config.json into a DrafterConfig (not yet checked against weights)."""
    names = set(tensor_names)
    if "speculators_model_type" in hf:
        kind = hf["speculators_model_type"]
        if kind not in ("peagle", "eagle3"):
            raise CheckpointError(f"{where}: speculators_model_type {kind!r} is not supported (expected 'peagle' "
                                  "or 'eagle3')")
        if "transformer_layer_config" not in hf:
            raise CheckpointError(f"{where}: required key 'transformer_layer_config' is missing")
        layer = _layer_config(hf["transformer_layer_config"], f"{where}: transformer_layer_config")
        aux = _aux_ids(hf.get("eagle_aux_hidden_state_layer_ids"), where)
        mask_id = hf.get("mask_token_id") if kind == "peagle" else None
        if mask_id is not None and (not isinstance(mask_id, int) or isinstance(mask_id, bool)):
            raise CheckpointError(f"{where}: mask_token_id {mask_id!r} is not an integer")
        flags = dict(norm_before_residual=_flag(hf, "norm_before_residual", False, where),
                     norm_before_fc=_flag(hf, "norm_before_fc", False, where),
                     fc_norm=_flag(hf, "fc_norm", False, where),
                     norm_output=_flag(hf, "norm_output", False, where))
        verifier = (hf.get("speculators_config") or {}).get("verifier") or {}
        extra = dict(num_depths=_num_depths(hf), verifier_name_or_path=verifier.get("name_or_path"),
                     verifier_architectures=tuple(verifier.get("architectures") or ()))
        has_mask_hidden = kind == "peagle" and "mask_hidden" in names
        tl = hf["transformer_layer_config"]
    else:
        if "draft_vocab_size" not in hf:
            raise CheckpointError(f"{where}: neither 'speculators_model_type' (speculators format) nor "
                                  "'draft_vocab_size' (vLLM-native EAGLE-3 format) found; not a drafter checkpoint")
        layer = _layer_config(hf, where)
        eagle = hf.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise CheckpointError(f"{where}: eagle_config must be an object, found {eagle!r}")
        if eagle.get("use_aux_hidden_state") is False:
            raise CheckpointError(f"{where}: eagle_config.use_aux_hidden_state = false (EAGLE-1 style heads) is "
                                  "not supported (expected true)")
        aux = _aux_ids(hf.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")),
                       where)
        nbf = hf.get("norm_before_fc", eagle.get("norm_before_fc"))
        flags = dict(norm_before_residual=_flag(hf, "norm_before_residual", False, where),
                     norm_before_fc=_flag({"norm_before_fc": nbf}, "norm_before_fc", False, where),
                     fc_norm=_flag(hf, "fc_norm", False, where),
                     norm_output=_flag(hf, "norm_output", False, where))
        mask_id = _mask_id(hf, where)
        has_mask_hidden = "mask_hidden" in names
        kind = "peagle" if has_mask_hidden else "eagle3"
        nd = hf.get("num_depths")
        extra = dict(num_depths=int(nd) if nd else None)
        tl = hf
    vd = hf.get("draft_vocab_size")
    if not isinstance(vd, int) or isinstance(vd, bool):
        raise CheckpointError(f"{where}: draft_vocab_size must be an integer, found {vd!r}")
    ht = hf.get("target_hidden_size") or layer.hidden_size
    mpe = tl.get("max_position_embeddings")
    cfg = DrafterConfig(layer=layer, num_aux=len(aux) if aux else 3, target_hidden_size=int(ht),
                        draft_vocab_size=vd, mask_token_id=mask_id, aux_layer_ids=aux,
                        has_mask_hidden=has_mask_hidden, model_kind=kind,
                        max_position_embeddings=int(mpe) if mpe else None, **flags, **extra)
    try:
        return cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------- loading

def _check_vocab_map(ckpt: Checkpoint, src: TensorSource, cfg: DrafterConfig):
    """d2t [Vd] / t2d [V] -> int32 d2t or None (identity); raises on any inconsistency."""
    v, vd = cfg.vocab_size, cfg.draft_vocab_size
    has_d2t, has_t2d = "d2t" in ckpt, "t2d" in ckpt
    if vd < v and not has_d2t:
        raise CheckpointError(f"{ckpt.dir}: tensor 'd2t' is missing (draft_vocab_size={vd} < vocab_size={v} needs "
                              f"a [{vd}] offset table)")
    ids = np.arange(vd, dtype=np.int64)
    d2t = None
    if has_d2t:
        if tuple(ckpt.shape("d2t")) != (vd,):
            raise CheckpointError(f"{ckpt.file_of('d2t')}: tensor 'd2t' has shape {list(ckpt.shape('d2t'))}, "
                                  f"expected [{vd}] (draft_vocab_size)")
        d2t = np.asarray(src.raw("d2t"))
        if d2t.dtype.kind not in "iu":
            raise CheckpointError(f"{ckpt.file_of('d2t')}: tensor 'd2t' has dtype {d2t.dtype}, expected integer")
        ids = ids + d2t.astype(np.int64)
        bad = np.nonzero((ids < 0) | (ids >= v))[0]
        if bad.size:
            raise CheckpointError(f"{ckpt.file_of('d2t')}: d2t maps draft id {int(bad[0])} to target id "
                                  f"{int(ids[bad[0]])}, outside [0, {v})")
        if np.unique(ids).size != vd:
            raise CheckpointError(f"{ckpt.file_of('d2t')}: d2t maps several draft ids to the same target id "
                                  "(expected a one-to-one draft vocabulary)")
    if has_t2d:
        if tuple(ckpt.shape("t2d")) != (v,):
            raise CheckpointError(f"{ckpt.file_of('t2d')}: tensor 't2d' has shape {list(ckpt.shape('t2d'))}, "
                                  f"expected [{v}] (vocab_size)")
        t2d = np.asarray(src.raw("t2d")).astype(bool)
        if int(t2d.sum()) != vd:
            raise CheckpointError(f"{ckpt.file_of('t2d')}: t2d marks {int(t2d.sum())} target ids, expected "
                                  f"draft_vocab_size={vd}")
        miss = np.nonzero(~t2d[ids])[0]
        if miss.size:
            raise CheckpointError(f"{ckpt.file_of('t2d')}: d2t is inconsistent with t2d: draft id {int(miss[0])} "
                                  f"maps to target id {int(ids[miss[0]])}, which t2d does not mark "
                                  f"({miss.size} such ids)")
    if d2t is None or (vd == v and not np.any(d2t)):
        return None
    return jnp.asarray(d2t, jnp.int32)


def load_drafter(path, dtype=jnp.bfloat16, target_config: Optional[ModelConfig] = None, *, target=None,
                 parallel_drafting: Optional[bool] = None, check_finite: bool = True, mesh=None) -> Drafter:
    """Load a speculators-format or vLLM-native drafter directory (strict: every tensor present, shaped, of a
    floating dtype where a float is expected, none unexpected; d2t / t2d consistent).

    target_config / target: when given, the head is checked against the target and its aux layer ids resolved
    (`pjax.models.pairing.check_pair`: the same rule the engine and training apply to a head loaded without
    one). `target` (a pjax Target) also supplies `embed_tokens` when the head has none. parallel_drafting=True
    requires mask_hidden and a mask token id. check_finite: reject NaN / inf weights (after the cast to
    `dtype`), naming the tensor; one device pass over all of them. mesh: a `jax.sharding.Mesh` (`pjax.make_mesh`)
    on whose every device the head is placed whole (replicated), tensor by tensor as it is read.
    """
    dtype = parse_dtype(dtype, what="load_drafter dtype")
    path = Path(path)
    where = str(path / "config.json")
    hf = read_hf_config(path)
    if not is_head_config(hf):
        other = _not_a_head(path, hf)
        if other is not None:
            raise CheckpointError(f"{path} is {other}, not a drafter head; load it with load_target")
    ckpt = Checkpoint(path)
    layout = "speculators" if "speculators_model_type" in hf else "vllm"
    cfg = drafter_config_from_hf(hf, where, ckpt.keys())
    if target is not None and target_config is None:
        target_config = target.config
    if target_config is not None:
        try:
            cfg = dataclasses.replace(cfg, aux_layer_ids=check_pair(target_config, cfg, where))
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    if parallel_drafting and not (cfg.has_mask_hidden and cfg.mask_token_id is not None):
        missing = [n for n, ok in (("tensor 'mask_hidden'", cfg.has_mask_hidden),
                                   (f"a mask token id ({' / '.join(MASK_ID_KEYS)})", cfg.mask_token_id is not None))
                   if not ok]
        raise CheckpointError(f"{path}: parallel drafting requested but the head has no {' and no '.join(missing)}")

    src = TensorSource(ckpt, None)
    rep = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    h, fc_name = cfg.hidden_size, "fc.weight"
    if fc_name in ckpt and tuple(ckpt.shape(fc_name)) != (h, cfg.fc_in):
        raise CheckpointError(f"{ckpt.file_of(fc_name)}: tensor 'fc.weight' has shape {list(ckpt.shape(fc_name))}, "
                              f"expected [{h}, {cfg.fc_in}] (hidden_size x num_aux={cfg.num_aux} * "
                              f"target_hidden_size={cfg.target_hidden_size})")
    abstract = abstract_drafter(cfg, dtype)
    leaves, treedef = jax.tree.flatten_with_path(abstract.params)
    out, described = [], []
    for kpath, leaf in leaves:
        p = param_path(kpath)
        name, transpose = tensor_name(p, layout)
        described.append(f"{ckpt.file_of(name)}: tensor {name!r}" if name in ckpt else
                         f"{path}: embed_tokens shared from the target")
        if name in ckpt and not jnp.issubdtype(ckpt.dtype(name), jnp.floating):
            raise CheckpointError(f"{ckpt.file_of(name)}: tensor {name!r} has dtype {ckpt.dtype(name)}, expected a "
                                  "floating dtype")
        if p == ("mask_hidden",):
            arr = src.raw(name)
            if arr.size != cfg.fc_in or arr.ndim > 3 or any(s != 1 for s in arr.shape[:-1]):
                raise CheckpointError(f"{ckpt.file_of(name)}: tensor 'mask_hidden' has shape {list(arr.shape)}, "
                                      f"expected [1, 1, {cfg.fc_in}] (num_aux * target_hidden_size)")
            arr = np.asarray(arr, np.float32).reshape(-1)
        elif p == ("embed_tokens", "embedding") and name not in ckpt:
            if target is None:
                raise CheckpointError(f"{path}: tensor 'embed_tokens.weight' is missing and no target was given to "
                                      "share it from (pass target=...)")
            arr = np.asarray(target.params["embed_tokens"]["embedding"], np.float32)
            if arr.shape != tuple(leaf.shape):
                raise CheckpointError(f"{path}: target embed_tokens has shape {list(arr.shape)}, expected "
                                      f"{list(leaf.shape)}")
        else:
            want = tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape)
            arr = src.read(name, want)
            arr = arr.T if transpose else arr
        out.append(put(arr, rep, dtype))
    if check_finite:
        integrity.check_finite(out, described.__getitem__)
    d2t = _check_vocab_map(ckpt, src, cfg)
    extra = sorted(k for k in ckpt.keys()
                   if k not in src.consumed and k not in IGNORED and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        hints = []
        if "input_norm.weight" in extra:
            hints.append("input_norm.weight present but norm_before_fc is false")
        if any(k.startswith("fc_norm.") for k in extra):
            hints.append("fc_norm.* present but fc_norm is false")
        if "mask_hidden" in extra:
            hints.append(f"mask_hidden is not expected in a {cfg.model_kind} head")
        raise CheckpointError(f"{ckpt.dir}: {len(extra)} unexpected tensor(s) for a {layout}-format "
                              f"{cfg.model_kind} head: {extra[:8]}{' ...' if len(extra) > 8 else ''}"
                              + (f" ({'; '.join(hints)})" if hints else ""))
    return Drafter(cfg, abstract.graphdef, jax.tree.unflatten(treedef, out), d2t if d2t is None else put(d2t, rep))


# ----------------------------------------------------------------------------------------- saving

def _rope_parameters(rope: RopeSpec) -> dict:
    try:
        return rope_to_hf(rope)
    except ConfigError as e:
        raise CheckpointError(f"drafter config: {e}") from None


def layer_config_to_hf(cfg: DrafterConfig) -> dict:
    """The `transformer_layer_config` dict (llama / qwen3) for a drafter's decoder geometry."""
    lay = cfg.layer
    s0 = lay.layers[0]
    for i, s in enumerate(lay.layers):
        if (s.head_dim, s.num_kv_heads, s.rope) != (s0.head_dim, s0.num_kv_heads, s0.rope):
            raise CheckpointError(f"layer {i} geometry differs from layer 0; a llama/qwen3 config cannot express it")
    windows = {s.sliding_window for s in lay.layers} - {None}
    if len(windows) > 1:
        raise CheckpointError(f"draft layers use several sliding windows {sorted(windows)}; a llama/qwen3 config "
                              "has one sliding_window")
    if lay.mlp_act != "silu" or lay.qk_norm != (lay.model_type == "qwen3") or lay.sinks or lay.sandwich_norms:
        raise CheckpointError(f"drafter layers are not plain {lay.model_type} layers (mlp_act={lay.mlp_act}, "
                              f"qk_norm={lay.qk_norm}, sinks={lay.sinks}, sandwich_norms={lay.sandwich_norms})")
    window = windows.pop() if windows else None
    types = ["sliding_attention" if s.sliding_window else "full_attention" for s in lay.layers]
    d = {
        "model_type": lay.model_type, "vocab_size": lay.vocab_size, "hidden_size": lay.hidden_size,
        "intermediate_size": lay.intermediate_size, "num_hidden_layers": lay.num_layers,
        "num_attention_heads": lay.num_heads, "num_key_value_heads": s0.num_kv_heads, "head_dim": s0.head_dim,
        "hidden_act": "silu", "rms_norm_eps": lay.rms_norm_eps, "rope_parameters": _rope_parameters(s0.rope),
        "attention_bias": lay.attention_bias, "mlp_bias": lay.mlp_bias, "layer_types": types,
        "sliding_window": window, "tie_word_embeddings": False,
    }
    if cfg.max_position_embeddings:
        d["max_position_embeddings"] = cfg.max_position_embeddings
    if lay.model_type == "qwen3":
        d["use_sliding_window"] = window is not None
        d["max_window_layers"] = types.index("sliding_attention") if window is not None else lay.num_layers
    return d


def drafter_config_to_hf(cfg: DrafterConfig, dtype_name: str, verifier_name_or_path=None) -> dict:
    peagle = cfg.model_kind == "peagle"
    verifier = verifier_name_or_path if verifier_name_or_path is not None else cfg.verifier_name_or_path
    hf = {
        "architectures": ["PEagleDraftModel" if peagle else "Eagle3DraftModel"],
        "speculators_model_type": cfg.model_kind,
        "speculators_version": SPECULATORS_VERSION,
        "dtype": dtype_name,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer_config_to_hf(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) or None,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": peagle,
        "speculators_config": {
            "algorithm": cfg.model_kind,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.num_depths or (8 if peagle else 3),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(cfg.verifier_architectures)},
        },
    }
    if peagle:
        hf["mask_token_id"] = cfg.mask_token_id
    return hf


def drafter_tensors(drafter: Drafter, dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """Speculators-format tensors (float tensors cast to `dtype`; d2t int64, t2d bool when Vd < V
    or the mapping is not the identity)."""
    cfg = drafter.config
    if cfg.model_kind == "peagle" and not cfg.has_mask_hidden:
        raise CheckpointError("a peagle head without mask_hidden cannot be written in the speculators format")
    tensors = {}
    for kpath, leaf in jax.tree.flatten_with_path(drafter.params)[0]:
        p = param_path(kpath)
        name, transpose = tensor_name(p)
        arr = np.asarray(jax.device_get(leaf))
        arr = arr.T if transpose else arr
        if p == ("mask_hidden",):
            arr = arr.reshape(1, 1, -1)
        tensors[name] = np.ascontiguousarray(arr.astype(dtype))
    if drafter.d2t is not None or cfg.draft_vocab_size < cfg.vocab_size:
        d2t = np.zeros(cfg.draft_vocab_size, np.int64) if drafter.d2t is None else \
            np.asarray(jax.device_get(drafter.d2t)).astype(np.int64)
        t2d = np.zeros(cfg.vocab_size, np.bool_)
        t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    return tensors


def save_drafter(drafter: Drafter, path, *, dtype="bfloat16", verifier_name_or_path: Optional[str] = None,
                 overwrite: bool = False, sources=()) -> Path:
    """Write `path/config.json` + `path/model.safetensors` in the speculators format; returns the absolute path.

    dtype: "bfloat16" (default), "float16" or "float32" for floating tensors. The directory is built beside
    `path` and renamed into place with the pjax output marker (kind "drafter"). overwrite: replace a head
    written earlier by pjax; any other existing directory (a downloaded head, a model) is refused, as is a
    `path` equal to, inside or containing one of `sources` (`pjax.checkpoint.prepare_output`). NaN / inf
    weights (in `dtype`) are refused, naming the tensor.
    """
    try:
        dtype = parse_dtype(dtype, what="save_drafter dtype").name
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    hf = drafter_config_to_hf(drafter.config, dtype, verifier_name_or_path)
    tensors = drafter_tensors(drafter, np.dtype(dtype))
    names = list(tensors)
    integrity.check_finite([jnp.asarray(tensors[k]) for k in names],
                           lambda i: f"{os.path.abspath(path)}: not written: tensor {names[i]!r}",
                           hint="a head with NaN / inf weights is never saved")
    with write_output_dir(path, force=overwrite, kind="drafter", sources=sources,
                          metadata={"model_kind": drafter.config.model_kind}) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", hf)
    return Path(os.path.abspath(path))
