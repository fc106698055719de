"""pjax targets -> Hugging Face checkpoints (`config.json`, safetensors, `generation_config.json`, tokenizer files)
that `transformers.AutoModelForCausalLM` and `pjax.load_target` load.

The inverse of `pjax.checkpoint.hf`: tensor names come from the same rule (`hf.hf_name`: `layers.{i}.mlp.up_proj.
kernel` -> `model.layers.{i}.mlp.up_proj.weight`, transposed), and the config is checked to parse back
(`pjax.models.families.config_from_hf`) to the target's own. Dense Llama and Qwen3 targets with full attention are
written (what pjax trains from scratch); other families and features are refused with the field that has no
Hugging Face form here.

Layout of OUT_DIR: config.json; model.safetensors (or model-0000k-of-0000n.safetensors shards + model.safetensors.
index.json above `max_shard_bytes`); generation_config.json; the tokenizer files of `tokenizer_dir`; the pjax output
marker (kind "hf-target"). Written beside its final place and renamed in (`write_output_dir`): never half
there; `overwrite` replaces only an earlier pjax output of the same kind.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import jax
import ml_dtypes
import numpy as np

from pjax._io import write_json, write_output_dir
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.hf import hf_name
from pjax.checkpoint.safetensors import save_file
from pjax.config import ConfigError, ModelConfig, RopeSpec
from pjax.dtypes import parse_dtype
from pjax.models.families import config_from_hf, rope_to_hf
from pjax.models.paths import param_path
from pjax.models.target import Target

__all__ = ["EXPORT_KIND", "TOKENIZER_FILE_NAMES", "hf_config", "hf_tensors", "save_hf_target"]

EXPORT_KIND = "hf-target"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# ModelConfig fields with no Hugging Face form in the llama / qwen3 configs, and their plain values.
_PLAIN = dict(norm_fp32_multiply=False, v_norm=False, attn_scale=None, sinks=False, mlp_act="silu",
              sandwich_norms=False, layer_scalar=False, embed_scale=None, final_logit_softcap=None, moe=None)


def _rope_parameters(cfg: ModelConfig) -> dict:
    try:
        return rope_to_hf(cfg.layers[0].rope)
    except ConfigError as e:
        raise CheckpointError(f"save_hf_target: {e}") from None


_ROPE_FIELDS = {"default": ("theta", "partial_rotary_factor"), "linear": ("theta", "partial_rotary_factor", "factor"),
                "llama3": ("theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "yarn": ("theta", "partial_rotary_factor", "factor", "original_max_position_embeddings", "beta_fast",
                         "beta_slow", "truncate", "attention_factor")}


def _used(rope: RopeSpec) -> RopeSpec:
    """`rope` with the fields its kind does not use at their defaults (the parser fills those from elsewhere)."""
    keep = _ROPE_FIELDS.get(rope.kind, tuple(f.name for f in dataclasses.fields(RopeSpec)))
    return RopeSpec(kind=rope.kind, **{k: getattr(rope, k) for k in keep})


def _dtype_name(dtype) -> str:
    try:
        return parse_dtype(dtype, what="save_hf_target dtype").name
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def hf_config(cfg: ModelConfig, *, dtype: str = "bfloat16", bos_token_id: Optional[int] = None,
              eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
              max_position_embeddings: Optional[int] = None) -> dict:
    """The Hugging Face `config.json` dict of a dense llama / qwen3 `cfg`; CheckpointError naming the field that
    cannot be written, or when the dict would not parse back to `cfg`."""
    where = "save_hf_target"
    if cfg.model_type not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {cfg.model_type!r} cannot be exported (supported: "
                              f"{sorted(ARCHITECTURES)})")
    for name, plain in _PLAIN.items():
        if getattr(cfg, name) != plain:
            raise CheckpointError(f"{where}: ModelConfig.{name}={getattr(cfg, name)!r} has no {cfg.model_type} "
                                  f"config field (expected {plain!r})")
    if cfg.qk_norm != (cfg.model_type == "qwen3"):
        raise CheckpointError(f"{where}: qk_norm={cfg.qk_norm} does not match model_type {cfg.model_type!r}")
    first = cfg.layers[0]
    for i, spec in enumerate(cfg.layers):
        if spec.sliding_window is not None or spec.k_eq_v or spec.moe:
            raise CheckpointError(f"{where}: layer {i} has sliding_window={spec.sliding_window}, k_eq_v={spec.k_eq_v}, "
                                  f"moe={spec.moe}; only dense full-attention layers are exported")
        if (spec.head_dim, spec.num_kv_heads, spec.rope) != (first.head_dim, first.num_kv_heads, first.rope):
            raise CheckpointError(f"{where}: layer {i} differs from layer 0 in head_dim / num_kv_heads / rope; the "
                                  f"{cfg.model_type} config has one geometry for every layer")
    dtype = _dtype_name(dtype)
    mpe = max_position_embeddings or cfg.max_position_embeddings
    if mpe is None:
        raise CheckpointError(f"{where}: max_position_embeddings is not set in the target's config; pass it")
    hf = {
        "architectures": [ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": first.num_kv_heads, "head_dim": first.head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(mpe), "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_parameters(cfg), "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "dtype": dtype,
    }
    if cfg.model_type == "llama":
        hf.update(mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    elif cfg.mlp_bias:
        raise CheckpointError(f"{where}: mlp_bias=True has no qwen3 config field")
    else:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                  layer_types=["full_attention"] * cfg.num_layers)
    if cfg.aux_layer_ids:
        hf["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    try:
        back = config_from_hf(hf)
    except ConfigError as e:
        raise CheckpointError(f"{where}: the written config does not parse back ({e})") from None
    informational = ("max_position_embeddings", "architectures", "name_or_path")
    back = dataclasses.replace(back, layers=tuple(dataclasses.replace(s, rope=_used(s.rope)) for s in back.layers))
    mine = dataclasses.replace(cfg, layers=tuple(dataclasses.replace(s, rope=_used(s.rope)) for s in cfg.layers))
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name not in informational and getattr(back, f.name) != getattr(mine, f.name)]
    if differ:
        raise CheckpointError(f"{where}: the written {cfg.model_type} config parses to another model than the "
                              f"target's: ModelConfig fields {differ} differ")
    return hf


def _named_leaves(target: Target):
    """(Hugging Face name, transpose?, leaf) of every parameter (the names `pjax.checkpoint.hf` reads)."""
    for kpath, leaf in jax.tree.flatten_with_path(target.params)[0]:
        path = param_path(kpath)
        name, transpose = hf_name(path, "model.", target.config.model_type)
        yield name, transpose, leaf


def _host(leaf, transpose: bool, dtype: str) -> np.ndarray:
    arr = np.asarray(jax.device_get(leaf))
    return np.ascontiguousarray((arr.T if transpose else arr).astype(DTYPES[dtype]))


def hf_tensors(target: Target, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """{Hugging Face tensor name: host array in `dtype`} of every parameter."""
    return {name: _host(leaf, transpose, dtype) for name, transpose, leaf in _named_leaves(target)}


def _special_ids(tokenizer_dir: Path) -> dict:
    """bos / eos / pad token ids named by tokenizer_config.json and found in tokenizer.json's added tokens."""
    try:
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        added = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return {}
    ids = {t["content"]: t["id"] for t in added if isinstance(t, dict) and "content" in t and "id" in t}
    out = {}
    for key in ("bos", "eos", "pad"):
        tok = config.get(f"{key}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in ids:
            out[f"{key}_token_id"] = ids[tok]
    return out


def _write_weights(target: Target, out: Path, dtype: str, max_shard_bytes: int) -> None:
    """model.safetensors, or shards of at most `max_shard_bytes` (a larger tensor alone) and their index; host
    memory holds one shard at a time."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    shards, size = [[]], 0
    for entry in _named_leaves(target):
        nbytes = entry[2].size * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        save_file({n: _host(x, t, dtype) for n, t, x in shards[0]}, out / "model.safetensors",
                  metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: _host(x, t, dtype) for n, t, x in shard}, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n, _, _ in shard})
    total = sum(x.size * itemsize for shard in shards for _, _, x in shard)
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": int(total)}, "weight_map": weight_map})


def save_hf_target(target: Target, path, *, dtype: str = "bfloat16", tokenizer_dir=None,
                   bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None,
                   pad_token_id: Optional[int] = None, max_position_embeddings: Optional[int] = None,
                   overwrite: bool = False, sources=(), max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Write `target` as a Hugging Face checkpoint directory at `path`; returns its absolute path.

    dtype: "bfloat16" (default), "float16" or "float32" for the weights. tokenizer_dir: a directory whose tokenizer
    files (TOKENIZER_FILE_NAMES present there; tokenizer.json or tokenizer.model required) are copied; the bos / eos /
    pad ids it names fill the ones not given. max_position_embeddings: the context written (default the target's).
    overwrite: replace an earlier pjax "hf-target" output at `path`; anything else there is refused, as is a `path`
    equal to, inside or containing one of `sources` (`pjax.checkpoint.prepare_output`)."""
    ids = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    tok_files = []
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        tok_files = [tokenizer_dir / n for n in TOKENIZER_FILE_NAMES if (tokenizer_dir / n).is_file()]
        if not any(f.name in ("tokenizer.json", "tokenizer.model") for f in tok_files):
            raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json or tokenizer.model to copy")
        ids = {k: v if v is not None else _special_ids(tokenizer_dir).get(k) for k, v in ids.items()}
    dtype = _dtype_name(dtype)
    hf = hf_config(target.config, dtype=dtype, max_position_embeddings=max_position_embeddings, **ids)
    generation = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    with write_output_dir(path, force=overwrite, kind=EXPORT_KIND, sources=sources,
                          metadata={"model_type": target.config.model_type, "dtype": dtype}) as tmp:
        _write_weights(target, tmp, dtype, max_shard_bytes)
        write_json(tmp / "config.json", hf)
        write_json(tmp / "generation_config.json", generation)
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
    return Path(os.path.abspath(path))
