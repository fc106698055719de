"""Top-k mixture-of-experts layer (qwen3_moe and gpt_oss routers): the expert matmul kernel for decode / verify
(each selected expert read once), a grouped matmul for prefill and training."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pjax.config import ModelConfig, MoeSpec
from pjax.kernels.expert_matmul import expert_matmul
from pjax.kernels.grouped_matmul import grouped_matmul
from pjax.models import per_shard
from pjax.models.layers import activation, linear

__all__ = ["MOE_FEW_PAIRS", "MoE", "mix_experts"]


# Token-expert pairs up to this count, and up to twice the expert count, use `expert_matmul` (each selected expert read
# once); more (prefill, training) sort the pairs by expert for the grouped matmul (work grows with the pairs). Where the
# crossover lies was measured per layer shape (docs/performance.md, "Expert matmul" and "Grouped matmul").
MOE_FEW_PAIRS = 128


class MoE(nnx.Module):
    """Top-k mixture of experts. Expert weights are stacked: gate_up [E, H, 2I] (gate half, then up
    half), down [E, I, H] (arrays, or `QuantizedWeight`s of those logical shapes: MXFP4 / FP8 kept packed);
    optional biases. Router: qwen3 (softmax -> top-k -> renormalise) or
    gpt_oss (logits + bias -> top-k -> softmax over the k)."""

    def __init__(self, cfg: ModelConfig, spec: MoeSpec, *, dtype, rngs):
        h, e, i = cfg.hidden_size, spec.num_experts, spec.intermediate_size
        self.router = linear(h, e, spec.router_bias, dtype, rngs)
        init = nnx.initializers.normal(0.02)
        self.gate_up = nnx.Param(init(rngs.params(), (e, h, 2 * i), dtype))
        self.down = nnx.Param(init(rngs.params(), (e, i, h), dtype))
        self.gate_up_bias = nnx.Param(jnp.zeros((e, 2 * i), dtype)) if spec.expert_bias else None
        self.down_bias = nnx.Param(jnp.zeros((e, h), dtype)) if spec.expert_bias else None
        self.spec, self.cfg = spec, cfg

    def route(self, x):
        """x [N, H] -> (weights [N, k] in x.dtype, expert ids [N, k] int32)."""
        logits = self.router(x)
        if self.spec.router == "topk_softmax":
            top, idx = jax.lax.top_k(logits, self.spec.top_k)
            w = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
        else:
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            w, idx = jax.lax.top_k(probs, self.spec.top_k)
            if self.spec.norm_topk_prob:
                w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w.astype(x.dtype), idx

    def __call__(self, x, implementation: str = "auto"):
        """x [..., H] -> [..., H]; implementation: the kernel switch (expert matmul for decode / verify, grouped
        matmul for more pairs; per shard under a mesh, `pjax.models.per_shard.experts`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.route(x)
        params = {"gate_up": self.gate_up.get_value(), "down": self.down.get_value(),  # arrays or QuantizedWeights
                  "gate_up_bias": None if self.gate_up_bias is None else self.gate_up_bias[...],
                  "down_bias": None if self.down_bias is None else self.down_bias[...]}
        mix = functools.partial(mix_experts, spec=self.spec, cfg=self.cfg, implementation=implementation)
        y = per_shard.experts(mix, x, w, idx, params, self.spec.num_experts, implementation)
        return y.astype(x.dtype).reshape(shape)


def _expert_out(e_ids, x_rows, matmul, params: dict, spec: MoeSpec, cfg: ModelConfig):
    """Shared expert math on gathered rows: activation and down projection with biases (e_ids index params)."""
    inter = spec.intermediate_size
    gu = matmul(x_rows, params["gate_up"])
    if params["gate_up_bias"] is not None:
        gu = gu + params["gate_up_bias"][e_ids]
    a = activation(cfg.mlp_act, gu[..., :inter], gu[..., inter:], cfg)
    out = matmul(a, params["down"], second=True)
    if params["down_bias"] is not None:
        out = out + params["down_bias"][e_ids]
    return out


def mix_experts(x, w, idx, params: dict, first=None, *, spec: MoeSpec, cfg: ModelConfig, implementation: str):
    """y float32 [N, H] = sum over each token's k routed experts of w * expert(x): x [N, H], w [N, k], idx [N, k]
    int32; params: gate_up [E', H, 2I], down [E', I, H] (arrays or `QuantizedWeight`s), gate_up_bias [E', 2I] and
    down_bias [E', H] or None, the experts first .. first + E' - 1 (first None: all E experts, E' = E). Pairs routed
    to other experts add nothing (expert parallel: a shard's own experts, `pjax.models.per_shard.experts`)."""
    n, k = idx.shape
    num = params["down"].shape[0]
    own = None if first is None else (idx >= first) & (idx < first + num)  # [N, k] pairs of these experts
    ids = idx if own is None else jnp.where(own, idx - first, num)  # others: past the last (sorted last, dropped)
    if n * k <= min(MOE_FEW_PAIRS, 2 * spec.num_experts):  # decode / verify: selected experts, once each
        safe = ids if own is None else jnp.minimum(ids, num - 1)

        def matmul(a, wts, second=False):  # pairs (token, j) in row-major order; token rows feed k pairs
            rows = a.reshape(n * k, -1) if second else a
            return expert_matmul(rows, safe.reshape(-1), wts, repeat=1 if second else k,
                                 implementation=implementation).reshape(n, k, -1)
        out = _expert_out(safe, x, matmul, params, spec, cfg)  # [N, k, H]
    else:  # prefill / training: sort token-expert pairs by expert, grouped matmul
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        e_sorted = flat[order]
        rows = x[order // k]
        sizes = jnp.bincount(flat, length=num).astype(jnp.int32)  # other experts' pairs (id num) are not counted

        def matmul(a, wts, second=False):
            return grouped_matmul(a, wts, sizes, implementation=implementation)
        e_rows = e_sorted if own is None else jnp.minimum(e_sorted, num - 1)
        out_sorted = _expert_out(e_rows, rows, matmul, params, spec, cfg)  # [N*k, H]
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(n, k, -1)
    if own is not None:
        out = jnp.where(own[..., None], out, 0)
    return jnp.einsum("nk,nkh->nh", w.astype(jnp.float32), out.astype(jnp.float32))
