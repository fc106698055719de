"""The decoder-only transformer shared by every target family (NNX modules, tree style)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pjax.config import LayerSpec, ModelConfig
from pjax.kernels.rows import take_rows
from pjax.models.attention import Attention
from pjax.models.cache import LayerKV
from pjax.models.layers import MLP, RMSNorm, head_logits
from pjax.models.moe import MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, dtype, rngs):
        h, eps, f32m = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_multiply
        self.input_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.self_attn = Attention(cfg, spec, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.mlp = MoE(cfg, cfg.moe, dtype=dtype, rngs=rngs) if spec.moe else MLP(
            cfg, h, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
            self.post_feedforward_layernorm = RMSNorm(h, eps, f32m, dtype=dtype)
        self.layer_scalar = nnx.Param(jnp.ones((1,), dtype)) if cfg.layer_scalar else None

    def __call__(self, x, positions, kv: Optional[LayerKV], *, valid=None, mask=None, cache_rows=None, slots=None,
                 tree=None, implementation: str = "auto"):
        """x [B, T, H] -> (x [B, T, H], kv); arguments as `Attention`."""
        a, kv = self.self_attn(self.input_layernorm(x), positions, kv, valid=valid, mask=mask, cache_rows=cache_rows,
                               slots=slots, tree=tree, implementation=implementation)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            x = x + self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(x), implementation))
        else:
            x = x + a
            x = x + self._mlp(self.post_attention_layernorm(x), implementation)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar[...]
        return x, kv

    def _mlp(self, x, implementation):
        return self.mlp(x, implementation) if isinstance(self.mlp, MoE) else self.mlp(x)


@dataclasses.dataclass
class ForwardOutput:
    """hidden [B, T, H] after the final norm; aux [B, T, A*H] residual streams entering the requested
    layers (pre-norm, in request order) or None; final [B, T, H] pre-norm last hidden state or None;
    cache: updated per-layer KV list or None."""
    hidden: Any
    aux: Any
    final: Any
    cache: Any


jax.tree_util.register_dataclass(ForwardOutput, data_fields=["hidden", "aux", "final", "cache"], meta_fields=[])


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, s, dtype=dtype, rngs=rngs) for s in cfg.layers])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_fp32_multiply, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Linear(
            cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def embed(self, tokens):
        """tokens [...] -> [..., H]: nnx.Embed's lookup, its gradient summed in float32 (`take_rows`: frequent tokens
        repeat thousands of times a training batch), times the family's embedding scale."""
        x = take_rows(self.embed_tokens.embedding[...], tokens)
        if self.cfg.embed_scale is not None:
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        return x

    def __call__(self, tokens, positions, cache=None, *, valid=None, mask=None, cache_rows=None, slots=None,
                 tree=None, aux_layer_ids: tuple[int, ...] = (), return_final: bool = False,
                 implementation: str = "auto") -> ForwardOutput:
        """tokens, positions [B, T] int32; cache: list of LayerKV or None; valid [B, T] bool; mask: an AttentionMask
        or None; cache_rows [B, T] int32: the cache row each token's K/V goes to (None: its own row; see `Attention`);
        slots [B, T] int32 / tree a TreeMask: a draft tree's verification (see `Attention`);
        implementation: the kernel switch ("xla" | "pallas" | "auto") for every kernel of the forward."""
        x = self.embed(tokens)
        captured = {}
        new_cache = [] if cache is not None else None
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                captured[i] = x
            x, kv = layer(x, positions, None if cache is None else cache[i], valid=valid, mask=mask,
                          cache_rows=cache_rows, slots=slots, tree=tree, implementation=implementation)
            if cache is not None:
                new_cache.append(kv)
        captured[len(self.layers)] = x
        aux = jnp.concatenate([captured[i] for i in aux_layer_ids], axis=-1) if aux_layer_ids else None
        return ForwardOutput(self.norm(x), aux, x if return_final else None, new_cache)

    def logits(self, hidden):
        """hidden [..., H] (after the final norm) -> float32 logits [..., V] (soft-capped where the config says)."""
        return head_logits(hidden, self.head_weight(), self.cfg.final_logit_softcap)

    def head_weight(self):
        """The LM head as [H, V] (the transposed embedding when tied)."""
        return self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
