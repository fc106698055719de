"""Hugging Face `config.json` -> `ModelConfig`, one parser per supported `model_type`.

Each parser is strict: a missing required key, an unsupported option or an inconsistent value raises
`ConfigError` naming the key and what was expected.
"""
from __future__ import annotations

import dataclasses
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
    if kind == "yarn" and spec.attention_factor is None and (params.get("mscale") or params.get("mscale_all_dim")):
        raise ConfigError(f"{where}: yarn mscale / mscale_all_dim are not supported (give attention_factor)")
    if kind == "llama3" and spec.high_freq_factor == spec.low_freq_factor:
        raise ConfigError(f"{where}: llama3 rope needs high_freq_factor != low_freq_factor")
    return spec


def rope_to_hf(rope: RopeSpec) -> dict:
    """The Hugging Face `rope_parameters` dict of `rope` (the inverse of `rope_from_hf` for the kinds a llama / qwen3
    config can state); ConfigError for the others (proportional)."""
    if rope.kind not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(f"rope type {rope.kind!r} cannot be written to a llama / qwen3 config (supported: default, "
                          "linear, llama3, yarn)")
    d = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind in ("linear", "llama3", "yarn"):
        d["factor"] = rope.factor
    if rope.kind == "llama3":
        d.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                 original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.kind == "yarn":
        d.update(original_max_position_embeddings=rope.original_max_position_embeddings, beta_fast=rope.beta_fast,
                 beta_slow=rope.beta_slow, truncate=rope.truncate)
        if rope.attention_factor is not None:
            d["attention_factor"] = rope.attention_factor
    if rope.partial_rotary_factor != 1.0:
        d["partial_rotary_factor"] = rope.partial_rotary_factor
    return d


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


def _num_experts(hf: dict, where: str = "config.json") -> int:
    """`num_experts` (attribute name) or `num_local_experts` (what transformers writes)."""
    for key in ("num_experts", "num_local_experts"):
        if hf.get(key) is not None:
            return int(hf[key])
    raise ConfigError(f"{where}: required key 'num_local_experts' (or 'num_experts') is missing")


def parse_qwen3_moe(hf: dict) -> ModelConfig:
    cfg = _common(hf, window_key_on=bool(hf.get("use_sliding_window", False)), qk_norm=True)
    window = None
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        window = int(hf["sliding_window"])  # Qwen3-MoE applies the window on every layer when enabled
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    e = _num_experts(hf)
    moe = MoeSpec(num_experts=e, top_k=int(require(hf, "num_experts_per_tok")),
                  intermediate_size=int(require(hf, "moe_intermediate_size")), router="softmax_topk",
                  norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if not 0 < moe.top_k <= e:
        raise ConfigError(f"config.json: num_experts_per_tok={moe.top_k} must be in [1, num_experts={e}]")
    layers = tuple(
        dataclasses.replace(s, sliding_window=window or s.sliding_window,
                            moe=(i not in mlp_only and e > 0 and (i + 1) % step == 0))
        for i, s in enumerate(cfg.layers))
    if any(not s.moe for s in layers) and not cfg.intermediate_size:
        raise ConfigError("config.json: dense layers present but intermediate_size is missing")
    return dataclasses.replace(cfg, layers=layers, moe=moe)


def parse_gpt_oss(hf: dict) -> ModelConfig:
    """GPT-OSS: sinks, alternating sliding/full layers, YaRN, biases, top-k-then-softmax router with bias,
    interleaved clamped SwiGLU experts with biases, fp32 norm multiply."""
    hf = dict(hf)
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):  # transformers' GptOssConfig default
        hf["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}
    if hf.get("rope_parameters") and "rope_theta" not in hf["rope_parameters"]:
        hf["rope_parameters"] = dict(hf["rope_parameters"], rope_theta=hf.get("rope_theta", 150000.0))
    hf.setdefault("rope_theta", 150000.0)
    n = int(require(hf, "num_hidden_layers"))
    if not hf.get("layer_types"):
        hf["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    hf.setdefault("sliding_window", 128)
    hf.setdefault("attention_bias", True)
    e = _num_experts(hf)
    inter = int(require(hf, "intermediate_size"))
    moe = MoeSpec(num_experts=e, top_k=int(require(hf, "num_experts_per_tok")), intermediate_size=inter,
                  router="topk_softmax", norm_topk_prob=False, router_bias=True, expert_bias=True)
    if not 0 < moe.top_k <= e:
        raise ConfigError(f"config.json: num_experts_per_tok={moe.top_k} must be in [1, num_local_experts={e}]")
    cfg = _common(hf, sinks=True, norm_fp32_multiply=True, mlp_act="gptoss", moe=moe,
                  rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                  swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(s, moe=True) for s in cfg.layers))


def _gemma4_rope(hf: dict, layer_type: str, where: str) -> RopeSpec:
    params = hf.get("rope_parameters") or {}
    if layer_type in params or "full_attention" in params or "sliding_attention" in params:
        params = params.get(layer_type)
        if params is None:
            raise ConfigError(f"{where}: rope_parameters has no entry for {layer_type!r}")
    elif not params:
        params = ({"rope_type": "default", "rope_theta": 10000.0} if layer_type == "sliding_attention" else
                  {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0})
    return rope_from_hf({"rope_parameters": dict(params),
                         "max_position_embeddings": hf.get("max_position_embeddings", 8192)}, where)


def parse_gemma4_text(hf: dict, where: str = "config.json") -> ModelConfig:
    """Gemma 4 text stack (dense MLP): plain RMSNorm (fp32 multiply), q/k/v norms, scale 1.0, sandwich
    norms, layer_scalar, sqrt(H)-scaled embeddings, GeGLU-tanh, final logit softcap, and per-layer
    geometry: full-attention layers use `per_layer_config` (or `global_head_dim` /
    `num_global_key_value_heads`), proportional RoPE and, with `attention_k_eq_v`, V = v_norm(k_proj(x))."""
    n = int(require(hf, "num_hidden_layers", where))
    nh = int(require(hf, "num_attention_heads", where))
    nkv = int(hf.get("num_key_value_heads") or nh)
    hd = int(hf.get("head_dim") or 256)
    h = int(require(hf, "hidden_size", where))
    for key, bad in (("hidden_size_per_layer_input", "per-layer embeddings (PLE)"),
                     ("num_kv_shared_layers", "KV sharing between layers"),
                     ("enable_moe_block", "the Gemma 4 MoE block")):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported ({bad}); only dense Gemma 4 text "
                              "models without PLE / KV sharing are")
    if hf.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{where}: use_bidirectional_attention='all' is not supported (causal decoder only)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{where}: hidden_activation {act!r} is not supported (expected 'gelu_pytorch_tanh')")
    types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(n)])
    if len(types) != n:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries, expected num_hidden_layers={n}")
    bad = set(types) - {"full_attention", "sliding_attention"}
    if bad:
        raise ConfigError(f"{where}: unsupported layer_types {sorted(bad)}")
    types[-1] = "full_attention"  # transformers forces the last layer to full attention
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    overrides = {int(k): dict(v) for k, v in (hf.get("per_layer_config") or {}).items()}
    if not hf.get("per_layer_config"):
        glob = {"head_dim": int(hf.get("global_head_dim") or 512)}
        if k_eq_v and hf.get("num_global_key_value_heads"):
            glob["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        overrides = {i: glob for i, t in enumerate(types) if t == "full_attention"}
    for i, o in overrides.items():
        if not 0 <= i < n:
            raise ConfigError(f"{where}: per_layer_config names layer {i}, outside [0, {n})")
        unknown = set(o) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ConfigError(f"{where}: per_layer_config[{i}] overrides {sorted(unknown)}; only head_dim and "
                              "num_key_value_heads are supported")
    window = hf.get("sliding_window")
    ropes = {t: _gemma4_rope(hf, t, where) for t in set(types)}
    layers = []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        if t == "sliding_attention" and not window:
            raise ConfigError(f"{where}: layer {i} is sliding_attention but sliding_window is {window!r}")
        layers.append(LayerSpec(head_dim=int(o.get("head_dim", hd)), num_kv_heads=int(o.get("num_key_value_heads", nkv)),
                                rope=ropes[t], sliding_window=int(window) if t == "sliding_attention" else None,
                                k_eq_v=k_eq_v and t == "full_attention"))
    cap = hf.get("final_logit_softcapping")
    return ModelConfig(
        model_type="gemma4_text", vocab_size=int(require(hf, "vocab_size", where)), hidden_size=h,
        intermediate_size=int(require(hf, "intermediate_size", where)), num_heads=nh, layers=tuple(layers),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), norm_fp32_multiply=True, qk_norm=True, v_norm=True,
        attention_bias=bool(hf.get("attention_bias", False)), attn_scale=1.0, mlp_act="gelu_tanh",
        sandwich_norms=True, layer_scalar=True, embed_scale=float(h) ** 0.5,
        final_logit_softcap=float(cap) if cap else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), aux_layer_ids=_aux_ids(hf))


def parse_gemma4(hf: dict) -> ModelConfig:
    """Multimodal Gemma 4 config: the text stack is `text_config` (weights under model.language_model.)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: model_type 'gemma4' needs a 'text_config' object")
    text = dict(text)
    if "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    if not text.get("eagle_aux_hidden_state_layer_ids") and _aux_ids(hf):
        text["eagle_aux_hidden_state_layer_ids"] = list(_aux_ids(hf))
    return parse_gemma4_text(text, "config.json text_config")


PARSERS: dict[str, Callable[[dict], ModelConfig]] = {
    "llama": parse_llama,
    "qwen3": parse_qwen3,
    "qwen3_moe": parse_qwen3_moe,
    "gpt_oss": parse_gpt_oss,
    "gemma4_text": parse_gemma4_text,
    "gemma4": parse_gemma4,
}


# numeric config.json fields: a string or a list there is a ConfigError naming the field (not a conversion traceback)
_NUMBERS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "sliding_window",
            "max_position_embeddings", "num_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "decoder_sparse_step", "swiglu_limit", "swiglu_alpha", "global_head_dim",
            "num_global_key_value_heads", "final_logit_softcapping")


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Dispatch on `model_type` (text config of multimodal checkpoints is taken from `text_config`)."""
    outer = hf
    model_type = hf.get("model_type")
    if model_type not in PARSERS and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
        model_type = hf.get("model_type")
    if model_type not in PARSERS:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported "
                          f"(supported: {sorted(PARSERS)})")
    for key in _NUMBERS:
        v = hf.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
    try:
        cfg = PARSERS[model_type](hf)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: a field of the {model_type} config has a value of the wrong type "
                          f"({type(e).__name__}: {e})") from None
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    mpe = text.get("max_position_embeddings") or hf.get("max_position_embeddings")
    archs = outer.get("architectures") or hf.get("architectures") or ()
    name = outer.get("_name_or_path")
    cfg = dataclasses.replace(cfg, max_position_embeddings=int(mpe) if mpe else None,
                              architectures=tuple(str(a) for a in archs) if isinstance(archs, (list, tuple)) else (),
                              name_or_path=name if isinstance(name, str) and name else None)
    return cfg.validate()
