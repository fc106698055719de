"""The target model as a value: `Target(config, graphdef, params)` and pure functions over it.

A `Target` is a pytree (params are leaves, config and graphdef are static), so it can be passed
straight into `jax.jit` / `jax.vmap`d functions.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pjax.config import ModelConfig
from pjax.dtypes import parse_dtype
from pjax.models.casting import astype, matching_module
from pjax.models.transformer import ForwardOutput, Transformer
from pjax.precision import float32_products

__all__ = ["Target", "abstract_target", "consistent_target", "forward", "init_target", "logits_from_hidden",
           "target_logits"]


@dataclasses.dataclass(frozen=True)
class Target:
    config: ModelConfig
    graphdef: Any
    params: Any  # pure dict matching nnx.split(Transformer)[1]
    experts: str = "expert"  # how MoE experts are split over a mesh's "model" axis (`pjax.models.sharding`)

    @property
    def module(self) -> Transformer:
        """The NNX module view (cheap inside jit; outside jit prefer the pure functions)."""
        return nnx.merge(self.graphdef, self.params)

    @property
    def dtype(self):
        return self.params["embed_tokens"]["embedding"].dtype

    def astype(self, dtype) -> "Target":
        """The same target with floating params and the module's compute dtype both `dtype` (bfloat16 / float32 /
        float16). Casting only the params (`jax.tree.map(astype)`) would keep a module built for the old dtype."""
        return astype(self, abstract_target, dtype, "Target")


def consistent_target(target: "Target") -> "Target":
    """`target` with a module definition matching its params' dtype (rebuilt if the params were cast alone)."""
    return matching_module(target, abstract_target, "target")


jax.tree_util.register_dataclass(Target, data_fields=["params"], meta_fields=["config", "graphdef", "experts"])


def abstract_target(config: ModelConfig, dtype=jnp.float32) -> Target:
    """A Target whose params are ShapeDtypeStructs (no memory): the loader fills and checks them."""
    model = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return Target(config, graphdef, nnx.to_pure_dict(state))


def init_target(config: ModelConfig, key, dtype=jnp.float32, scale: float = 0.02) -> Target:
    """Random target (benchmarks, tests): normal(0, scale) matrices, ones for norms, zeros for biases."""
    abstract = abstract_target(config.validate(), parse_dtype(dtype, what="init_target dtype"))
    leaves, treedef = jax.tree.flatten_with_path(abstract.params)

    def kind(path):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in ("weight", "layer_scalar"):
            return "ones"
        return "zeros" if ("bias" in name or name == "sinks") else "normal"

    sizes = [int(np.prod(l.shape)) if kind(p) == "normal" else 0 for p, l in leaves]

    @jax.jit
    def make(k):  # one random draw for the whole tree: one small compile, generated on the device
        # draws are bucketed below 2**30 elements (large models exceed 32-bit counters otherwise)
        buckets, cur = [], 0
        for n in sizes:
            if not buckets or (n and cur + n > 2 ** 30):
                buckets.append(0)
                cur = 0
            buckets[-1] += n
            cur += n
        flats = [scale * jax.random.normal(jax.random.fold_in(k, i), (max(b, 1),), jnp.float32)
                 for i, b in enumerate(buckets)]
        out, bi, off = [], 0, 0
        for (p, l), n in zip(leaves, sizes):
            kd = kind(p)
            if kd == "normal":
                if off + n > buckets[bi]:
                    bi, off = bi + 1, 0
                out.append(flats[bi][off:off + n].reshape(l.shape).astype(l.dtype))
                off += n
            else:
                out.append((jnp.ones if kd == "ones" else jnp.zeros)(l.shape, l.dtype))
        return jax.tree.unflatten(treedef, out)

    params = make(key)
    return Target(config, abstract.graphdef, params)


@float32_products
def forward(target: Target, tokens, positions, cache=None, *, valid=None, mask=None, cache_rows=None, slots=None,
            tree=None, aux_layer_ids=(), return_final=False, implementation: str = "auto") -> ForwardOutput:
    """Run the target over tokens [B, T] at absolute positions [B, T].

    With `cache` (list of LayerKV, see `pjax.cache.init_cache`) this is the cached extend: the new
    K/V are written at their positions and each query attends to every cached position <= its own
    (sliding windows and sinks honoured). Rows may have different positions (ragged batches).
    `valid` [B, T] marks real tokens (padding writes no KV and is hidden from other tokens).
    With a cache and `mask` (an AttentionMask over the new tokens, e.g. `document_mask` of prompts packed in one
    row) the queries attend over the new tokens under the mask instead, and each token's K/V go to the cache row
    `cache_rows` [B, T] int32 (None: its own row) at its position: the packed prefill.
    With a cache, `slots` [B, T] int32 and `tree` (a `pjax.kernels.cache_attention.TreeMask`): a draft tree's
    verification, each token's K/V at its slot (not its position) and each query over the committed cache and its
    ancestors.
    implementation: the kernel switch ("xla": no Pallas kernel anywhere, "pallas": every kernel, "auto").
    """
    return target.module(tokens, positions, cache, valid=valid, mask=mask, cache_rows=cache_rows, slots=slots,
                         tree=tree, aux_layer_ids=tuple(aux_layer_ids), return_final=return_final,
                         implementation=implementation)


@float32_products
def logits_from_hidden(target: Target, hidden):
    """hidden [..., H] after the final norm -> float32 logits [..., V]."""
    return target.module.logits(hidden)


@float32_products
@jax.jit
def target_logits(target: Target, input_ids):
    """Float32 logits [B, T, V] of a plain causal forward over input_ids [B, T]."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    out = forward(target, input_ids, positions)
    return logits_from_hidden(target, out.hidden)
