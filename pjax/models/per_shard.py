"""The Pallas kernels per shard under a ("data", "model") mesh of several devices.

A program traced under `traced_on(mesh)` (the engine's programs: `pjax.decode.engine`) finds the mesh at trace time
(`jax.sharding.get_abstract_mesh`), and the layers run their kernel calls inside `jax.shard_map` over it, split as the
plan of `pjax.models.sharding` splits their inputs, so that no input moves between devices:
- attention over a KV cache (decode, verify, draft trees: `cache_attention`) and over the new tokens (prefill:
  `attention`): rows on "data" (where "data" divides them), query heads on "model" (where "model" divides them), K/V
  heads on "model" where "model" divides the KV heads (`sharding.kv_spec`). Where the KV heads are replicated (fewer
  than the devices) every shard holds all of them and takes the ones its query heads use: a copy of those heads per
  call, which the KV cache of such a layer pays for each step;
- MoE experts (`experts`), expert parallel: each shard runs the expert kernels (expert matmul for decode / verify,
  grouped matmul for prefill) on its own experts for the token-expert pairs routed to them, zero elsewhere, and XLA's
  psum over "model" adds the shards' sums. A target whose experts are split by the intermediate dimension
  (`Target.experts` "intermediate") runs the MoE's XLA reference: a shard's slice of gate_up [E, H, 2I] holds gate
  or up columns, not the pairs of both that its slice of down needs.
Each shard picks its kernel (`implementation`) for its own shapes. Collectives are XLA's; the results equal the
unsharded kernels' up to the order of the psum's additions. Off a mesh, with implementation "xla", or with "auto"
off a GPU (no kernel runs), the layers call the ops as they are and XLA's partitioner (GSPMD) splits the references.
The drafter, replicated over "model", goes through the same calls: each shard takes its heads' slice of the
replicated q / K / V (no communication in) and XLA gathers the heads' outputs. Kernel ops called on whole arrays
under the mesh (acceptance and sampling over the split vocabulary, the drafter's inputs) run their XLA references
(`pjax.kernels.dispatch.on_mesh`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pjax.kernels import dispatch
from pjax.kernels import flash_attention
from pjax.kernels.cache_attention import cache_attention as cache_attention_op
from pjax.models.sharding import DATA_AXIS, MODEL_AXIS

__all__ = ["attention", "cache_attention", "context_mesh", "experts", "traced_on"]

_EXPERTS = contextvars.ContextVar("pjax_expert_sharding", default="expert")


@contextlib.contextmanager
def traced_on(mesh, experts: str = "expert"):
    """Trace the models inside this block under `mesh` (a `jax.sharding.Mesh` with axes "data" and "model", or None:
    nothing changes): their kernels run per shard. experts: how the target's MoE experts are split
    (`Target.experts`). Usable inside `jax.jit` (it sets the abstract mesh, part of every inner jit's cache key)."""
    if mesh is None or mesh.size == 1:
        yield
        return
    token = _EXPERTS.set(experts)
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield
    finally:
        _EXPERTS.reset(token)


def context_mesh():
    """The abstract ("data", "model") mesh of several devices that the current trace runs under (outside a
    `shard_map` over it: `pjax.kernels.dispatch.on_mesh`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if dispatch.on_mesh() and set(mesh.axis_names) == {DATA_AXIS, MODEL_AXIS} else None


def _per_shard(implementation: str):
    """The context mesh when a kernel may run (implementation other than "xla"; "auto" only on a GPU), else None."""
    if implementation == "xla" or (implementation == "auto" and not dispatch.on_gpu()):
        return None
    return context_mesh()


def _axes(mesh, rows: int, heads: int, kv_heads: int):
    """(rows axis, query heads axis, KV heads axis) of the plan: "data" / "model" where it divides the count."""
    d, m = mesh.shape[DATA_AXIS], mesh.shape[MODEL_AXIS]
    row = DATA_AXIS if d > 1 and rows % d == 0 else None
    head = MODEL_AXIS if m > 1 and heads % m == 0 else None
    kv = MODEL_AXIS if head and kv_heads % m == 0 else None
    return row, head, kv


def _rows_spec(x, batch: int, row) -> P:
    """A per-row leaf [B, ...] on the rows axis; a leaf shared by every row ([1, ...]) replicated."""
    return P(row, *([None] * (x.ndim - 1))) if row and x.shape[0] == batch else P()


def _own_kv_heads(x, heads: int, kv_heads: int, mesh):
    """x [B, S, nkv, hd] (all KV heads, replicated) -> the KV heads that this shard's heads / m query heads use, in
    order: [B, S, n, hd] with n = its query heads / g where those span whole groups of g = heads / nkv, 1 where
    they share one KV head, else one KV head per query head."""
    local, g = heads // mesh.shape[MODEL_AXIS], heads // kv_heads
    n = local // g if local % g == 0 else (1 if g % local == 0 else local)
    first = jax.lax.axis_index(MODEL_AXIS) * local
    return jnp.take(x, (first + jnp.arange(n) * (local // n)) // g, axis=2)


def _shard_map(fn: Callable, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def cache_attention(q, k, v, q_pos, *, tree=None, sinks=None, kv_len=None, implementation: str = "auto", **kw):
    """`pjax.kernels.cache_attention.cache_attention` (same arguments and result), per shard under a mesh."""
    mesh = _per_shard(implementation)
    if mesh is None:
        return cache_attention_op(q, k, v, q_pos, tree=tree, sinks=sinks, kv_len=kv_len,
                                  implementation=implementation, **kw)
    b, nh, nkv = q.shape[0], q.shape[2], k.shape[2]
    row, head, kv_head = _axes(mesh, b, nh, nkv)
    args = dict(q=q, k=k, v=v, q_pos=q_pos, tree=tree, sinks=sinks, kv_len=kv_len)
    specs = dict(q=P(row, None, head, None), k=P(row, None, kv_head, None), v=P(row, None, kv_head, None),
                 q_pos=P(row, None), tree=jax.tree.map(lambda x: _rows_spec(x, b, row), tree), sinks=P(head),
                 kv_len=P(row))
    args = {name: x for name, x in args.items() if x is not None}

    def local(a):
        if head and not kv_head:
            a = dict(a, k=_own_kv_heads(a["k"], nh, nkv, mesh), v=_own_kv_heads(a["v"], nh, nkv, mesh))
        return cache_attention_op(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("q_pos"), implementation=implementation,
                                  **a, **kw)
    return _shard_map(local, mesh, ({n: specs[n] for n in args},), P(row, None, head, None))(args)


def attention(q, k, v, mask, *, sinks=None, chain_k=None, chain_v=None, implementation: str = "auto", **kw):
    """`pjax.kernels.flash_attention.attention` (same arguments and result), per shard under a mesh."""
    mesh = _per_shard(implementation)
    if mesh is None:
        return flash_attention.attention(q, k, v, mask, sinks=sinks, chain_k=chain_k, chain_v=chain_v,
                                         implementation=implementation, **kw)
    b, nh, nkv = q.shape[0], q.shape[2], k.shape[2]
    row, head, kv_head = _axes(mesh, b, nh, nkv)
    heads = P(row, None, kv_head, None)
    args = dict(q=q, k=k, v=v, mask=mask, sinks=sinks, chain_k=chain_k, chain_v=chain_v)
    specs = dict(q=P(row, None, head, None), k=heads, v=heads, mask=jax.tree.map(lambda x: _rows_spec(x, b, row), mask),
                 sinks=P(head), chain_k=heads, chain_v=heads)
    args = {name: x for name, x in args.items() if x is not None}

    def local(a):
        if head and not kv_head:
            a = dict(a, **{n: _own_kv_heads(a[n], nh, nkv, mesh) for n in ("k", "v", "chain_k", "chain_v") if n in a})
        return flash_attention.attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("mask"),
                                         implementation=implementation, **a, **kw)
    return _shard_map(local, mesh, ({n: specs[n] for n in args},), P(row, None, head, None))(args)


def experts(mix: Callable, x, weights, idx, params: dict, num_experts: int, implementation: str = "auto"):
    """y float32 [N, H] = mix(x, weights, idx, params, first): the weighted sum over each token's routed experts;
    x [N, H], weights [N, k], idx [N, k] int32 (expert ids), params: the experts' stacked weights, split by expert
    (`sharding.param_spec`, experts "expert"). mix(..., first) sums the pairs of experts first .. first + E' - 1
    (E' = params' leading axis; first None: all). Under a mesh (expert parallel), each shard mixes its own experts
    and a psum over "model" adds them up; otherwise `mix(..., None)` as it is."""
    mesh = _per_shard(implementation)
    m = 1 if mesh is None else mesh.shape[MODEL_AXIS]
    if mesh is None or _EXPERTS.get() != "expert" or num_experts % m:
        return mix(x, weights, idx, params, None)
    row = _axes(mesh, x.shape[0], 1, 1)[0]
    split = jax.tree.map(lambda a: P(MODEL_AXIS, *([None] * (a.ndim - 1))), params)

    def local(x, weights, idx, params):
        first = jax.lax.axis_index(MODEL_AXIS) * (num_experts // m)
        return jax.lax.psum(mix(x, weights, idx, params, first), MODEL_AXIS)
    return _shard_map(local, mesh, (P(row, None), P(row, None), P(row, None), split), P(row, None))(
        x, weights, idx, params)
