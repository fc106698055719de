"""`python -m pjax check`, section `drafter`: a random 2-layer P-EAGLE head (parallel slots with the mask token and
the mask feature) over a KV cache with each implementation, draft logits against a float64 numpy forward written
from the parameters: relative error (Frobenius) <= PARITY_BOUND. Needs only pjax and numpy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pjax.check.report import PARITY_BOUND, Report, float_errors, frobenius_rel, kernels_in
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.kernels import IMPLEMENTATIONS
from pjax.models.drafter import (DrafterConfig, combine, draft_logits_from_hidden, drafter_forward, init_drafter,
                                 init_drafter_cache)

__all__ = ["CHECKS", "drafter_reference"]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, :, None, None] * inv
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _attention(p, x, pos, nh, nkv, hd, theta):
    b, t, _ = x.shape
    q = _rope((x @ p["q_proj"]["kernel"]).reshape(b, t, nh, hd), pos, theta)
    k = _rope((x @ p["k_proj"]["kernel"]).reshape(b, t, nkv, hd), pos, theta)
    v = (x @ p["v_proj"]["kernel"]).reshape(b, t, nkv, hd)
    g = nh // nkv
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
    s = np.where((pos[:, None, None, :] <= pos[:, None, :, None]), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", s / s.sum(-1, keepdims=True), v).reshape(b, t, nh * hd)
    return o @ p["o_proj"]["kernel"]


def _mlp(p, x):
    gate = x @ p["gate_proj"]["kernel"]
    return (gate / (1 + np.exp(-gate)) * (x @ p["up_proj"]["kernel"])) @ p["down_proj"]["kernel"]


def drafter_reference(params, cfg: DrafterConfig, tokens, features, is_mask, pos) -> np.ndarray:
    """float64 P-EAGLE forward over one causal block of slots: fc fuses the features (mask slots: mask_hidden),
    layer 0 attends over [norm(embed) ; norm(fused)], the residual stream starts at the fused feature; deeper layers
    are llama decoder layers; draft-vocab logits of the final norm."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lay, eps = cfg.layer, cfg.layer.rms_norm_eps
    nh, spec = lay.num_heads, lay.layers[0]
    g = np.where(is_mask[..., None], p["mask_hidden"], np.asarray(features, np.float64))
    h = g @ p["fc"]["kernel"]
    e = p["embed_tokens"]["embedding"][tokens]
    for i in range(lay.num_layers):
        lp = p["layers"][i]
        if i == 0:
            x = np.concatenate([_rms(e, lp["input_layernorm"]["weight"], eps), _rms(h, lp["hidden_norm"]["weight"],
                                                                                    eps)], -1)
        else:
            x = _rms(h, lp["input_layernorm"]["weight"], eps)
        h = h + _attention(lp["self_attn"], x, pos, nh, spec.num_kv_heads, spec.head_dim, spec.rope.theta)
        h = h + _mlp(lp["mlp"], _rms(h, lp["post_attention_layernorm"]["weight"], eps))
    return _rms(h, p["norm"]["weight"], eps) @ p["lm_head"]["kernel"]


def check_drafter(report: Report, quick: bool) -> None:
    v, h, ht, a = 257, 64, 48, 3
    layer = ModelConfig("llama", v, h, 128, 8, tuple(LayerSpec(16, 2, RopeSpec(theta=10000.0)) for _ in range(2)),
                        rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=a, target_hidden_size=ht, draft_vocab_size=200, mask_token_id=v - 1,
                        aux_layer_ids=(1, 4, 7))
    drafter = init_drafter(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    b, t, k = 2, 14, 7  # 2K = 14 parallel slots: accepted tokens + bonus, then K - 1 mask slots
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, v - 1, (b, t))
    is_mask = np.arange(t)[None] >= t - (k - 1)
    tokens = np.where(is_mask, cfg.mask_token_id, tokens)
    features = rng.standard_normal((b, t, a * ht))
    pos = np.broadcast_to(np.arange(t), (b, t))
    want = drafter_reference(drafter.params, cfg, tokens, features, is_mask, pos.astype(np.float64))
    args = (drafter, jnp.asarray(tokens, jnp.int32), jnp.asarray(features, jnp.float32), jnp.asarray(is_mask),
            jnp.asarray(pos, jnp.int32))
    for impl in IMPLEMENTATIONS:
        def run(d, tok, feat, msk, p_, impl=impl):
            fused = jnp.where(msk[..., None], combine(d, d.params["mask_hidden"]), combine(d, feat))
            cache = init_drafter_cache(d, tok.shape[0], 32, jnp.float32)
            normed, _, _ = drafter_forward(d, tok, fused, p_, cache, implementation=impl)
            return draft_logits_from_hidden(d, normed)
        got = jax.jit(run)(*args)
        rel = frobenius_rel(got, want)
        report.record("drafter", "P-EAGLE head vs float64", impl, f"B={b} {t} slots (K={k}), 2 layers, cached (f32)",
                      abs_err=float_errors(got, want)[0], rel_err=rel, bound=f"rel<={PARITY_BOUND}",
                      ok=rel <= PARITY_BOUND, ran=kernels_in(run, *args))


CHECKS = (check_drafter,)
