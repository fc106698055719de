"""Model configuration: frozen, hashable dataclasses (usable as static jit arguments).

A `ModelConfig` describes any supported target family with per-layer geometry (`LayerSpec`), so one
decoder implementation serves llama, qwen3, qwen3_moe, gpt_oss and gemma4. Family-specific parsing of
Hugging Face `config.json` lives in `pjax.models.families`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np


class ConfigError(ValueError):
    """A configuration is unsupported or inconsistent; the message names the key and the expectation."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, mirroring Hugging Face `rope_parameters`.

    kind: "default" | "linear" | "llama3" | "yarn" | "proportional".
    """
    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = None

    def inv_freq(self, head_dim: int) -> tuple[np.ndarray, float]:
        """Returns (inv_freq [head_dim // 2] float32 (zero-padded for partial rotary), cos/sin scale)."""
        f32 = np.float32
        if self.kind == "proportional":
            angles = int(self.partial_rotary_factor * head_dim // 2)
            exps = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(f32) / f32(head_dim)
            inv = (1.0 / (f32(self.theta) ** exps)).astype(f32)
            inv = np.concatenate([inv, np.zeros(head_dim // 2 - angles, f32)])
            return (inv / f32(self.factor)).astype(f32), 1.0
        dim = int(head_dim * self.partial_rotary_factor)
        exps = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
        base = (f32(self.theta) ** exps).astype(f32)
        inv = (1.0 / base).astype(f32)
        scale = 1.0
        if self.kind == "default":
            pass
        elif self.kind == "linear":
            inv = inv / f32(self.factor)
        elif self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wl, high_wl = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            inv_l = np.where(wavelen > low_wl, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * inv_l / self.factor + smooth * inv_l
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            inv = np.where(medium, smoothed, inv_l).astype(f32)
        elif self.kind == "yarn":
            scale = self.attention_factor
            if scale is None:
                scale = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

            def corr(rot):
                return (dim * math.log(self.original_max_position_embeddings / (rot * 2 * math.pi))) / (
                    2 * math.log(self.theta))

            low, high = corr(self.beta_fast), corr(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=f32) - low) / (high - low), 0, 1).astype(f32)
            extra = (1 - ramp).astype(f32)
            inv = (1.0 / (f32(self.factor) * base)) * (1 - extra) + (1.0 / base) * extra
        else:
            raise ConfigError(f"unsupported rope type {self.kind!r}")
        inv = inv.astype(f32)
        if inv.shape[0] < head_dim // 2:
            raise ConfigError(f"partial rotary factor {self.partial_rotary_factor} is not supported for rope "
                              f"type {self.kind!r}")
        return inv, float(scale)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Geometry of one decoder layer (layers may differ, e.g. gemma4 global layers, gpt_oss windows)."""
    head_dim: int
    num_kv_heads: int
    rope: RopeSpec
    sliding_window: Optional[int] = None  # keys with pos > q_pos - window are visible; None = full
    k_eq_v: bool = False  # gemma4 global layers: no v_proj, V = v_norm(k_proj(x))
    moe: bool = False


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"  # "softmax_topk" (qwen3_moe) | "topk_softmax" (gpt_oss)
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. All flags default to plain Llama behaviour."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    norm_fp32_multiply: bool = False  # gpt_oss / gemma4: multiply the weight in fp32, then cast
    qk_norm: bool = False
    v_norm: bool = False  # gemma4: weightless RMSNorm on values
    attention_bias: bool = False
    attn_scale: Optional[float] = None  # None -> head_dim ** -0.5
    sinks: bool = False
    mlp_act: str = "silu"  # "silu" | "gelu_tanh" | "gptoss"
    mlp_bias: bool = False
    sandwich_norms: bool = False  # gemma4: post-attention and pre/post-feedforward norms
    layer_scalar: bool = False
    embed_scale: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    tie_word_embeddings: bool = False
    moe: Optional[MoeSpec] = None
    aux_layer_ids: tuple[int, ...] = ()
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # checkpoint metadata for warnings (not geometry: left out of equality and hashing, so it never splits a compile)
    max_position_embeddings: Optional[int] = dataclasses.field(default=None, compare=False)  # trained context
    architectures: tuple[str, ...] = dataclasses.field(default=(), compare=False)  # HF `architectures`
    name_or_path: Optional[str] = dataclasses.field(default=None, compare=False)  # the model's name or directory

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        """vLLM's default feature layers (2, n//2, n-3); below 8 layers those collide, so shallow targets (n >= 3)
        take three evenly spread distinct ids (1, ~n/2, n) instead (n itself = the stream after the last layer)."""
        n = self.num_layers
        ids = (2, n // 2, n - 3)
        if len(set(ids)) == 3 and min(ids) >= 0:
            return ids
        if n < 3:
            raise ConfigError(f"a target of {n} layers has no 3 distinct default aux layers; pass "
                              "eagle_aux_hidden_state_layer_ids explicitly")
        return (1, (n + 1) // 2, n)

    def validate(self) -> "ModelConfig":
        if self.num_layers < 1:
            raise ConfigError("num_hidden_layers must be >= 1")
        for i, spec in enumerate(self.layers):
            if self.num_heads % spec.num_kv_heads:
                raise ConfigError(f"layer {i}: num_attention_heads={self.num_heads} is not a multiple of "
                                  f"num_key_value_heads={spec.num_kv_heads}")
            if spec.head_dim % 2:
                raise ConfigError(f"layer {i}: head_dim={spec.head_dim} must be even for RoPE")
            if spec.moe and self.moe is None:
                raise ConfigError(f"layer {i} is a MoE layer but the config has no MoE parameters")
        for i in self.aux_layer_ids:
            if not 0 <= i <= self.num_layers:
                raise ConfigError(f"eagle_aux_hidden_state_layer_ids contains {i}, outside [0, {self.num_layers}]")
        return self
