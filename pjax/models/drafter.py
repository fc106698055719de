"""The P-EAGLE / EAGLE-3 drafter: NNX modules and pure functions over a `Drafter` value.

Dataflow of one slot (spec A.1): `f = combine(g)` fuses the A concatenated target features
(`[A*Ht] -> [H]`), `e = embed(x)`, the fused first layer attends over `[norm(e) ; norm(f)]` (2H wide),
deeper layers are plain llama / qwen3 decoder layers, and `lm_head(norm(h))` gives draft-vocab logits
that `d2t` maps to target ids. P-EAGLE adds `mask_hidden` (a learned pre-`fc` feature) and a mask
token for the parallel slots.

Shapes: B batch, T slots, S cache / key length, N flattened COD elements, H draft hidden size,
A aux layers, Ht target hidden size, V target vocab, Vd draft vocab.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pjax.config import ConfigError, LayerSpec, ModelConfig
from pjax.dtypes import parse_dtype
from pjax.kernels.rows import take_rows
from pjax.models.attention import Attention
from pjax.models.cache import LayerKV, init_cache
from pjax.models.casting import astype, matching_module
from pjax.models.layers import MLP, Linear, RMSNorm
from pjax.models.transformer import DecoderLayer
from pjax.precision import float32_products

__all__ = ["Drafter", "DrafterConfig", "DrafterModel", "abstract_drafter", "combine", "consistent_drafter", "draft_logits_from_hidden",
           "draft_to_target", "drafter_forward", "init_drafter", "init_drafter_cache", "logits_to_target_vocab",
           "mask_feature", "no_parallel_reason"]

MODEL_KINDS = ("peagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static description of a drafter head (hashable; usable as a static jit argument).

    layer: draft decoder geometry (llama or qwen3 type, L layers, vocab_size = target vocab V).
    num_aux: A, number of concatenated target features; target_hidden_size: Ht.
    draft_vocab_size: Vd (<= V). mask_token_id: P-EAGLE mask token (target vocab id) or None.
    aux_layer_ids: target layers whose entering residual stream feeds the drafter (may be empty
    when the checkpoint does not say; then the target's default (2, n//2, n-3) applies).
    """
    layer: ModelConfig
    num_aux: int
    target_hidden_size: int
    draft_vocab_size: int
    mask_token_id: Optional[int] = None
    aux_layer_ids: tuple[int, ...] = ()
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    has_mask_hidden: bool = True
    model_kind: str = "peagle"
    num_depths: Optional[int] = None
    norm_output: bool = False  # EAGLE-3 sequential drafting feeds back normed states (TTT)
    max_position_embeddings: Optional[int] = None
    verifier_name_or_path: Optional[str] = None
    verifier_architectures: tuple[str, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def fc_in(self) -> int:
        return self.num_aux * self.target_hidden_size

    def validate(self) -> "DrafterConfig":
        lay = self.layer
        if lay.model_type not in ("llama", "qwen3"):
            raise ConfigError(f"drafter layer model_type {lay.model_type!r} is not supported (expected 'llama' "
                              "or 'qwen3')")
        if lay.moe is not None or any(s.moe for s in lay.layers):
            raise ConfigError("drafter layers must be dense (MoE draft layers are not supported)")
        if self.model_kind not in MODEL_KINDS:
            raise ConfigError(f"model_kind {self.model_kind!r} is not one of {MODEL_KINDS}")
        for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "has_mask_hidden", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a boolean, found {getattr(self, name)!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("unknown norm flag combination: norm_before_fc=true and fc_norm=true are mutually "
                              "exclusive (expected at most one of them)")
        if self.num_aux < 1 or self.target_hidden_size < 1:
            raise ConfigError(f"num_aux={self.num_aux} and target_hidden_size={self.target_hidden_size} must be >= 1")
        if self.aux_layer_ids and len(self.aux_layer_ids) != self.num_aux:
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids has {len(self.aux_layer_ids)} entries, expected "
                              f"num_aux={self.num_aux}")
        if len(set(self.aux_layer_ids)) != len(self.aux_layer_ids) or any(i < 0 for i in self.aux_layer_ids):
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} must be distinct and >= 0")
        if not 1 <= self.draft_vocab_size <= lay.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={lay.vocab_size}]")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < lay.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {lay.vocab_size})")
        if self.num_depths is not None and self.num_depths < 1:
            raise ConfigError(f"num_depths={self.num_depths} must be >= 1")
        lay.validate()
        return self


class FusedFirstLayer(nnx.Module):
    """EAGLE-3 layer 0: attention over `[input_layernorm(e) ; hidden_norm(f)]` (q/k/v take 2H),
    residual = f (or hidden_norm(f) with norm_before_residual), then the usual MLP block."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, norm_before_residual: bool, dtype, rngs):
        h, eps, f32m = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_multiply
        self.input_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.hidden_norm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.self_attn = Attention(cfg, spec, q_in=2 * h, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.mlp = MLP(cfg, h, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.norm_before_residual = norm_before_residual

    def __call__(self, e, f, positions, kv: Optional[LayerKV], *, valid=None, mask=None, cache_rows=None,
                 slots=None, tree=None, implementation: str = "auto"):
        """e, f [B, T, H] -> (h [B, T, H], kv)."""
        e_n, f_n = self.input_layernorm(e), self.hidden_norm(f)
        residual = f_n if self.norm_before_residual else f
        a, kv = self.self_attn(jnp.concatenate([e_n, f_n], axis=-1), positions, kv, valid=valid, mask=mask,
                               cache_rows=cache_rows, slots=slots, tree=tree, implementation=implementation)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class DrafterModel(nnx.Module):
    """Parameter tree of a drafter (names follow the speculators checkpoint, see pjax.checkpoint.heads)."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        lay = cfg.layer
        h, eps = lay.hidden_size, lay.rms_norm_eps
        self.embed_tokens = nnx.Embed(lay.vocab_size, h, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.input_norm = RMSNorm(cfg.fc_in, eps, dtype=dtype) if cfg.norm_before_fc else None
        self.fc_norm = nnx.List([RMSNorm(cfg.target_hidden_size, eps, dtype=dtype) for _ in range(cfg.num_aux)]) \
            if cfg.fc_norm else None
        self.fc = Linear(cfg.fc_in, h, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        first = FusedFirstLayer(lay, lay.layers[0], norm_before_residual=cfg.norm_before_residual, dtype=dtype,
                                rngs=rngs)
        self.layers = nnx.List([first] + [DecoderLayer(lay, s, dtype=dtype, rngs=rngs) for s in lay.layers[1:]])
        self.norm = RMSNorm(h, eps, dtype=dtype)
        self.lm_head = nnx.Linear(h, cfg.draft_vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.mask_hidden = nnx.Param(jnp.zeros((cfg.fc_in,), dtype)) if cfg.has_mask_hidden else None
        self.num_aux = cfg.num_aux

    def combine(self, g):
        """g [..., A*Ht] -> [..., H]: optional input_norm or per-chunk fc_norm, then fc."""
        g = g.astype(self.fc.kernel.dtype)
        if self.input_norm is not None:
            g = self.input_norm(g)
        if self.fc_norm is not None:
            chunks = jnp.split(g, self.num_aux, axis=-1)
            g = jnp.concatenate([norm(c) for norm, c in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(g)

    def embed(self, tokens):
        """tokens [...] -> [..., H]: nnx.Embed's lookup with its gradient summed in float32 (`take_rows`: training
        layouts embed the mask token thousands of times a row)."""
        return take_rows(self.embed_tokens.embedding[...], tokens)

    def __call__(self, tokens, hidden_in, positions, cache=None, *, valid=None, mask=None, cache_rows=None,
                 slots=None, tree=None, implementation: str = "auto"):
        """tokens, positions [B, T]; hidden_in [B, T, H] (combined); mask None, an `AttentionMask` (training layouts)
        or a per-layer sequence of those; cache_rows, slots, tree: see `drafter_forward`. Returns (normed [B, T, H],
        prenorm [B, T, H], cache)."""
        n = len(self.layers)
        masks = list(mask) if isinstance(mask, (list, tuple)) else [mask] * n
        if len(masks) != n:
            raise ValueError(f"got {len(masks)} per-layer masks for {n} draft layers")
        e = self.embed(tokens)
        new_cache = [] if cache is not None else None
        h = hidden_in.astype(e.dtype)
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else cache[i]
            kw = dict(valid=valid, mask=masks[i], cache_rows=cache_rows, slots=slots, tree=tree,
                      implementation=implementation)
            h, kv = layer(e, h, positions, kv, **kw) if i == 0 else layer(h, positions, kv, **kw)
            if cache is not None:
                new_cache.append(kv)
        return self.norm(h), h, new_cache

    def logits(self, normed):
        """normed [..., H] -> float32 [..., Vd]."""
        return jnp.einsum("...h,hv->...v", normed, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A drafter as a pytree value: params (pure dict of nnx.split(DrafterModel)) and `d2t`
    (int32 [Vd] offsets draft id -> target id, or None for the identity) are leaves."""
    config: DrafterConfig
    graphdef: Any
    params: Any
    d2t: Any = None

    @property
    def module(self) -> DrafterModel:
        return nnx.merge(self.graphdef, self.params)

    @property
    def dtype(self):
        return self.params["fc"]["kernel"].dtype

    def astype(self, dtype) -> "Drafter":
        """The same head with floating params and the module's compute dtype both `dtype` (see Target.astype)."""
        return astype(self, abstract_drafter, dtype, "Drafter")


def consistent_drafter(drafter: "Drafter") -> "Drafter":
    """`drafter` with a module definition matching its params' dtype (rebuilt if the params were cast alone)."""
    return matching_module(drafter, abstract_drafter, "drafter")


jax.tree_util.register_dataclass(Drafter, data_fields=["params", "d2t"], meta_fields=["config", "graphdef"])


def abstract_drafter(config: DrafterConfig, dtype=jnp.float32) -> Drafter:
    """A Drafter whose params are ShapeDtypeStructs (the loader fills and checks them)."""
    model = nnx.eval_shape(lambda: DrafterModel(config.validate(), dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return Drafter(config, graphdef, nnx.to_pure_dict(state))


def init_drafter(config: DrafterConfig, key, dtype=jnp.float32, scale: float = 0.02) -> Drafter:
    """Random drafter: normal(0, scale) matrices, ones for norms, normal(0, 1) mask_hidden (as
    speculators), and a random ascending draft vocabulary when Vd < V. Host-side numpy RNG seeded
    from `key` (compiling threefry for every leaf is slow on CPU)."""
    abstract = abstract_drafter(config, parse_dtype(dtype, what="init_drafter dtype"))
    leaves, treedef = jax.tree.flatten_with_path(abstract.params)
    seed = np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)
    rng = np.random.default_rng(seed.astype(np.uint32).ravel().tolist())

    def fill(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "weight":
            return jnp.ones(leaf.shape, leaf.dtype)
        if name == "bias":
            return jnp.zeros(leaf.shape, leaf.dtype)
        std = 1.0 if name == "mask_hidden" else scale
        return jnp.asarray(std * rng.standard_normal(leaf.shape, np.float32), leaf.dtype)

    params = jax.tree.unflatten(treedef, [fill(p, l) for p, l in leaves])
    d2t = None
    vd, v = config.draft_vocab_size, config.vocab_size
    if vd < v:
        ids = np.sort(rng.permutation(v)[:vd])
        d2t = jnp.asarray(ids - np.arange(vd), jnp.int32)
    return Drafter(config, abstract.graphdef, params, d2t)


@float32_products
def combine(drafter: Drafter, features):
    """features [..., A*Ht] -> fused feature [..., H] (input_norm / fc_norm / none, then fc)."""
    return drafter.module.combine(features)


def mask_feature(drafter: Drafter):
    """combine(mask_hidden) -> [H], the feature of every parallel (mask) slot."""
    reason = no_parallel_reason(drafter.config)
    if reason:
        raise ValueError(reason)
    return combine(drafter, drafter.params["mask_hidden"])


def no_parallel_reason(cfg: DrafterConfig) -> str:
    """Why this head cannot draft in parallel (P-EAGLE), or "" when it can."""
    missing = [n for n, ok in (("mask_hidden", cfg.has_mask_hidden), ("mask_token_id", cfg.mask_token_id is not None))
               if not ok]
    if not missing:
        return ""
    return (f"parallel drafting needs mask_hidden and mask_token_id, but this {cfg.model_kind} head has no "
            f"{' and no '.join(missing)} (an EAGLE-3 head only supports sequential drafting)")


@float32_products
def drafter_forward(drafter: Drafter, tokens, hidden_in, positions, cache=None, *, valid=None, mask=None,
                    cache_rows=None, slots=None, tree=None, implementation: str = "auto"):
    """One drafter pass over slots.

    tokens, positions [B, T] int32 (absolute positions); hidden_in [B, T, H] already combined (fc
    output, mask_feature, or for EAGLE-3 sequential steps the previous prenorm output).
    cache: list of LayerKV (init_drafter_cache), index = absolute position; new K/V are written at
    `positions` (rows with valid False write nothing) and queries attend causally by position
    (per-layer sliding windows honoured). mask: an `AttentionMask` (`pjax.kernels.flash_attention.mask`; or one
    per layer) replacing the positional rule (training layouts); cache may then be a `StepKV` (EAGLE-3 TTT steps).
    With a LayerKV cache, a mask and cache_rows [B, T] int32, each slot's K/V go to cache row cache_rows (the
    packed prefill, `pjax.decode.packing`). With a LayerKV cache, slots [B, T] int32 and tree a
    `pjax.kernels.cache_attention.TreeMask`: the K/V go to cache indices `slots` and each query sees the committed
    cache and its ancestors under the tree mask (a draft tree grown depth by depth, `pjax.decode.draft`).
    implementation: the kernel switch ("xla" | "pallas" | "auto"). Returns (normed [B, T, H], prenorm [B, T, H],
    cache).
    """
    return drafter.module(tokens, hidden_in, positions, cache, valid=valid, mask=mask, cache_rows=cache_rows,
                          slots=slots, tree=tree, implementation=implementation)


def init_drafter_cache(drafter: Drafter, batch: int, capacity: int, dtype=jnp.bfloat16) -> list[LayerKV]:
    """One LayerKV per draft layer, zeros [batch, capacity, nkv, hd]."""
    return init_cache(drafter.config.layer, batch, capacity, dtype)


@float32_products
def draft_logits_from_hidden(drafter: Drafter, normed):
    """normed [..., H] (after the final norm) -> float32 draft-vocab logits [..., Vd]."""
    return drafter.module.logits(normed)


def draft_to_target(drafter: Drafter, draft_ids):
    """Draft-vocab ids -> target-vocab ids (`id + d2t[id]`; identity without d2t)."""
    if drafter.d2t is None:
        return draft_ids
    return draft_ids + drafter.d2t[draft_ids].astype(draft_ids.dtype)


def logits_to_target_vocab(drafter: Drafter, logits, fill=-jnp.inf):
    """Draft-vocab logits [..., Vd] -> [..., V] with `fill` outside the draft vocabulary (vLLM's scatter)."""
    if drafter.d2t is None and drafter.config.draft_vocab_size == drafter.config.vocab_size:
        return logits
    vd = drafter.config.draft_vocab_size
    ids = draft_to_target(drafter, jnp.arange(vd, dtype=jnp.int32))
    out = jnp.full(logits.shape[:-1] + (drafter.config.vocab_size,), fill, logits.dtype)
    return out.at[..., ids].set(logits)
