"""Hugging Face `config.json` -> `ModelConfig`, one parser per supported `model_type`.

Each parser is strict: a missing required key, an unsupported option or an inconsistent value raises
`ConfigError` naming the key and what was expected.
"""
from __future__ import annotations

from typing import Callable

from pjax.config import ConfigError, LayerSpec, ModelConfig, MoeSpec, RopeSpec


def require(hf: dict, key: str, where: str = "config.json"):
    if key not in hf or hf[key] is None:
        raise ConfigError(f"{where}: required key {key!r} is missing")
    return hf[key]


def rope_from_hf(hf: dict, where: str = "config.json") -> RopeSpec:
    """Reads `rope_parameters` (transformers 5.x) or legacy `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    kind = params.get("rope_type", params.get("type", "default"))
    known = {"default", "linear", "llama3", "yarn", "proportional"}
    if kind not in known:
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported (supported: {sorted(known)})")
    spec = RopeSpec(
        kind=kind,
        theta=float(params.get("rope_theta", 10000.0)),
        factor=float(params.get("factor", 1.0) or 1.0),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                              or hf.get("max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
    )
    if kind == "llama3" and spec.high_freq_factor == spec.low_freq_factor:
        raise ConfigError(f"{where}: llama3 rope needs high_freq_factor != low_freq_factor")
    return spec


def _head_dim(hf: dict) -> int:
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    h, n = require(hf, "hidden_size"), require(hf, "num_attention_heads")
    if h % n:
        raise ConfigError(f"config.json: hidden_size={h} is not divisible by num_attention_heads={n} "
                          "and no head_dim is given")
    return h // n


def _layer_types(hf: dict, n: int) -> list[str]:
    types = hf.get("layer_types") or ["full_attention"] * n
    if len(types) != n:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries, expected num_hidden_layers={n}")
    bad = set(types) - {"full_attention", "sliding_attention"}
    if bad:
        raise ConfigError(f"config.json: unsupported layer_types {sorted(bad)}")
    return types


def _aux_ids(hf: dict) -> tuple[int, ...]:
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else ()


def _common(hf: dict, *, window_key_on: bool = True, **overrides) -> ModelConfig:
    """Shared Llama-like parsing: geometry, per-layer windows, rope, norms, tying."""
    n = int(require(hf, "num_hidden_layers"))
    nh = int(require(hf, "num_attention_heads"))
    nkv = int(hf.get("num_key_value_heads") or nh)
    hd = _head_dim(hf)
    rope = rope_from_hf(hf)
    window = hf.get("sliding_window")
    types = _layer_types(hf, n)
    layers = []
    for i, t in enumerate(types):
        w = None
        if t == "sliding_attention" and window_key_on:
            if not window:
                raise ConfigError(f"config.json: layer {i} is sliding_attention but sliding_window is {window!r}")
            w = int(window)
        layers.append(LayerSpec(head_dim=hd, num_kv_heads=nkv, rope=rope, sliding_window=w))
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"config.json: hidden_act {hf.get('hidden_act')!r} is not supported for "
                          f"{hf.get('model_type')} (expected 'silu')")
    kw = dict(
        model_type=hf["model_type"],
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=int(require(hf, "hidden_size")),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_heads=nh,
        layers=tuple(layers),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_layer_ids=_aux_ids(hf),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def parse_llama(hf: dict) -> ModelConfig:
    return _common(hf)


def parse_qwen3(hf: dict) -> ModelConfig:
    # Qwen3 only uses sliding windows when use_sliding_window is set.
    return _common(hf, window_key_on=bool(hf.get("use_sliding_window", False)), qk_norm=True)


def parse_qwen3_moe(hf: dict) -> ModelConfig:
    cfg = _common(hf, window_key_on=bool(hf.get("use_sliding_window", False)), qk_norm=True)
    n = cfg.num_layers
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    e = int(require(hf, "num_experts"))
    moe = MoeSpec(num_experts=e, top_k=int(require(hf, "num_experts_per_tok")),
                  intermediate_size=int(require(hf, "moe_intermediate_size")), router="softmax_topk",
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True)))
    if moe.top_k > e:
        raise ConfigError(f"config.json: num_experts_per_tok={moe.top_k} exceeds num_experts={e}")
    layers = tuple(
        LayerSpec(s.head_dim, s.num_kv_heads, s.rope, s.sliding_window,
                  moe=(i not in mlp_only and e > 0 and (i + 1) % step == 0))
        for i, s in enumerate(cfg.layers))
    if any(not s.moe for s in layers) and not cfg.intermediate_size:
        raise ConfigError("config.json: dense layers present but intermediate_size is missing")
    import dataclasses
    return dataclasses.replace(cfg, layers=layers, moe=moe)


PARSERS: dict[str, Callable[[dict], ModelConfig]] = {
    "llama": parse_llama,
    "qwen3": parse_qwen3,
    "qwen3_moe": parse_qwen3_moe,
}


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Dispatch on `model_type` (text config of multimodal checkpoints is taken from `text_config`)."""
    model_type = hf.get("model_type")
    if model_type not in PARSERS and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
        model_type = hf.get("model_type")
    if model_type not in PARSERS:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported "
                          f"(supported: {sorted(PARSERS)})")
    cfg = PARSERS[model_type](hf)
    return cfg.validate()
