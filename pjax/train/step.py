"""The jitted train step: target features (online, or offline in the batch) -> EAGLE shift -> COD sample ->
loss and gradients (single pass or partitioned, spec D.5; with `TrainConfig.remat` the draft layers rematerialised
one at a time in the backward pass, `pjax.train.losses.drafter_states`) -> AdamW update. Data parallel over a 1-D
mesh axis "data".

Batch: dict of [B, S] int32 arrays `tokens`, `loss_mask`, `document_ids` (raw packed rows, see
`pjax.train.data.RowStream`), or an offline-feature batch (`pjax.train.data.FeatureStream`: shifted rows
with `hidden_states` and `verifier_last_hidden_states`; the target then only supplies its final norm and
lm_head). The loss of a step is the mean over rows of each row's count-normalised loss (speculators: DDP
averages per-rank single-row losses), so any sharding of the rows gives the same value.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from pjax.models.drafter import Drafter
from pjax.models.pairing import check_pair
from pjax.models.sharding import DATA_AXIS
from pjax.models.target import Target
from pjax.train.cod import cod_capacities, cod_sample, partition_segment, segment_bounds
from pjax.train.data import eagle_shift
from pjax.train.eagle3 import eagle3_row_loss
from pjax.train.target_features import target_features
from pjax.train.losses import LOSS_EPS, anchor_grid, cast_drafter, chain_metrics, depth_metrics, row_loss_terms
from pjax.train.optim import learning_rate_schedule, make_optimizer, merge_params, split_params, trainable_mask
from pjax.train.config import TrainConfig
from pjax.train.state import TrainState



def offline_rows(target: Target, drafter: Drafter, batch: dict) -> dict:
    """A `FeatureStream` batch (already shifted, features from disk) -> rows, checked against the models."""
    aux_ids = check_pair(target.config, drafter.config)
    b, s = batch["input_ids"].shape
    ht = target.config.hidden_size
    want = dict(loss_mask=(b, s), document_ids=(b, s), hidden_states=(b, s, len(aux_ids) * ht),
                verifier_last_hidden_states=(b, s, ht))
    for k, shape in want.items():
        if k not in batch or tuple(batch[k].shape) != shape:
            found = tuple(batch[k].shape) if k in batch else "missing"
            raise ValueError(f"offline feature batch: {k} must be {list(shape)} ({len(aux_ids)} aux layers x hidden "
                             f"size {ht} of the target), found {found}")
    return {k: batch[k] for k in ("input_ids", *want)}


def prepare_rows(target: Target, drafter: Drafter, batch: dict, cfg: TrainConfig, step_key):
    """Shift + COD layouts for a batch -> dict of per-row arrays (leading B). Raw packed rows (`tokens`, a
    `RowStream` batch) get their target features online; `FeatureStream` batches bring them, shifted."""
    if "hidden_states" in batch:
        rows = offline_rows(target, drafter, batch)
    else:
        aux_ids = check_pair(target.config, drafter.config)
        aux, final = target_features(target, batch["tokens"], batch["document_ids"], aux_ids,
                                     chunk=cfg.target_chunk, implementation=cfg.implementation)
        rows = jax.vmap(eagle_shift)(batch["tokens"], batch["loss_mask"], batch["document_ids"], aux, final)
    if cfg.objective == "peagle":
        b = batch["document_ids"].shape[0]
        keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(b))
        rows["layout"] = jax.vmap(lambda k, lm, doc: cod_sample(k, lm, cfg.cod, doc))(
            keys, rows["loss_mask"], rows["document_ids"])
    return rows


def _peagle_row(dr, target, row, layout, cfg: TrainConfig, owned=None, denom=None, num_depth0=None):
    loss, correct, weight = row_loss_terms(
        dr, target, row["input_ids"], row["hidden_states"], row["verifier_last_hidden_states"], row["loss_mask"],
        row["document_ids"], layout, num_depths=cfg.cod.num_depths, num_depth0=num_depth0, loss_type=cfg.loss_type,
        attn_chunk=cfg.attn_chunk, loss_chunk=cfg.loss_chunk, remat=cfg.remat, implementation=cfg.implementation)
    w = weight if owned is None else weight * owned.astype(weight.dtype)
    wsum = jnp.sum(weight) if denom is None else denom
    c, t = depth_metrics(correct, w, layout.depth, cfg.cod.num_depths)
    sup, wrong = anchor_grid(correct, w, layout.anchor_pos, layout.depth, row["input_ids"].shape[0],
                             cfg.cod.num_depths)
    return jnp.sum(loss * w) / (wsum + LOSS_EPS), dict(correct=c, total=t, supervised=sup, wrong=wrong)


def _sum_rows(m: dict) -> dict:
    """Row-summed per-depth counts; the per-row anchor grids [B, S, K] stay whole (a chain may span segments)."""
    return {k: v if k in ("supervised", "wrong") else jnp.sum(v, 0) for k, v in m.items()}


def _count_chains(m: dict) -> dict:
    """The anchor grids of a step's rows -> cond_correct, cond_total, chain_total [K] (`chain_metrics`)."""
    m = dict(m)
    cc, ct, ch = chain_metrics(m.pop("supervised"), m.pop("wrong"))
    return dict(m, cond_correct=cc, cond_total=ct, chain_total=ch)


def _whole_row_loss(frozen, shell: Drafter, target: Target, rows: dict, cfg: TrainConfig):
    """fn(trainable params) -> (mean row loss, row-summed metrics) over whole rows (no partitioning)."""
    dtype = None if cfg.compute_dtype is None else jnp.dtype(cfg.compute_dtype)

    def drafter_of(p):
        full = merge_params(p, frozen)
        return cast_drafter(Drafter(shell.config, shell.graphdef, full, shell.d2t), dtype)

    if cfg.objective == "eagle3":
        def fn(p):
            dr = drafter_of(p)
            loss, m = jax.vmap(lambda r: eagle3_row_loss(
                dr, target, r["input_ids"], r["hidden_states"], r["verifier_last_hidden_states"], r["loss_mask"],
                r["document_ids"], ttt_steps=cfg.ttt_steps, ttt_step_loss_decay=cfg.ttt_step_loss_decay,
                loss_type=cfg.loss_type, attn_chunk=cfg.attn_chunk, loss_chunk=cfg.loss_chunk,
                implementation=cfg.implementation))(rows)
            return jnp.mean(loss), jax.tree.map(lambda x: jnp.sum(x, 0), m)
        return fn, drafter_of

    def fn(p):
        dr = drafter_of(p)
        loss, m = jax.vmap(lambda r, lay: _peagle_row(dr, target, r, lay, cfg))(rows, rows["layout"])
        return jnp.mean(loss), _count_chains(_sum_rows(m))
    return fn, drafter_of


def loss_and_grads(params_t, frozen, shell: Drafter, target: Target, rows: dict, cfg: TrainConfig):
    """(mean row loss, grads over the trainable leaves, metrics). Partitioned when num_segments > 1:
    one forward/backward per segment, run one after another in a loop, gradients summed. metrics: correct, total,
    cond_correct, cond_total [K] (P-EAGLE also chain_total [K], `pjax.train.losses.chain_metrics`), summed over rows."""
    whole, drafter_of = _whole_row_loss(frozen, shell, target, rows, cfg)
    if cfg.objective == "eagle3" or cfg.num_segments == 1:
        (loss, m), g = jax.value_and_grad(whole, has_aux=True)(params_t)
        return loss, g, m

    layout = rows["layout"]
    s, nseg = cfg.total_seq_len, cfg.num_segments
    caps = cod_capacities(s, cfg.cod)
    denom = jax.vmap(lambda r, lay: jnp.sum(r["loss_mask"][lay.anchor_pos + lay.depth].astype(jnp.float32)
                                            * lay.valid))(rows, layout)

    def branch(index, end):
        def run(p, rows, denom):
            def fn(p):
                dr = drafter_of(p)
                seg = jax.vmap(lambda lay: partition_segment(lay, s, nseg, index, caps))(rows["layout"])
                loss, m = jax.vmap(lambda r, sg, dn: _peagle_row(dr, target, r, sg.layout, cfg, sg.owned, dn, end))(
                    rows, seg, denom)
                return jnp.mean(loss), _sum_rows(m)
            (loss, m), g = jax.value_and_grad(fn, has_aux=True)(p)
            return loss, g, m
        return run

    # One segment at a time: a loop whose body switches to the segment's (static-shape) program, so
    # only one segment's activations are ever alive (an unrolled sequence lets XLA overlap them).
    branches = [branch(i, end) for i, (_, end) in enumerate(segment_bounds(s, nseg))]
    zero = jax.eval_shape(branches[-1], params_t, rows, denom)
    init = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)

    def body(i, acc):
        out = jax.lax.switch(i, branches, params_t, rows, denom)
        return jax.tree.map(jnp.add, acc, out)
    loss, grads, metrics = jax.lax.fori_loop(0, nseg, body, init)
    return loss, grads, _count_chains(metrics)


def train_step(state: TrainState, shell: Drafter, target: Target, batch: dict, cfg: TrainConfig):
    """One optimisation step (pure; jit with `make_train_step`). Returns (state, metrics)."""
    mask = trainable_mask(state.params, cfg.effective_optim)
    params_t, frozen = split_params(state.params, mask)
    base = jax.random.wrap_key_data(state.rng)
    step_key = jax.random.fold_in(base, state.step)
    rows = prepare_rows(target, shell, batch, cfg, step_key)
    loss, grads, m = loss_and_grads(params_t, frozen, shell, target, rows, cfg)
    tx = make_optimizer(cfg.optim, cfg.total_steps)
    updates, opt_state = tx.update(grads, state.opt_state, params_t)
    params_t = optax.apply_updates(params_t, updates)
    new = TrainState(state.step + 1, merge_params(params_t, frozen), opt_state, state.rng, state.data_position + 1)
    metrics = dict(loss=loss, correct=m["correct"], total=m["total"], grad_norm=_global_norm(grads),
                   lr=learning_rate_schedule(cfg.optim, cfg.total_steps)(state.step),
                   tokens=jnp.sum((batch["document_ids"] != -1).astype(jnp.int32)))
    for k in ("cond_correct", "cond_total", "chain_total"):
        if k in m:
            metrics[k] = m[k]
    return new, metrics


def eval_step(state: TrainState, shell: Drafter, target: Target, batch: dict, cfg: TrainConfig):
    """The train step's loss and metrics on a batch, without gradients or an update (pure; held-out evaluation).
    Whole rows at once (a forward keeps no activations for a backward); the COD layout is the one `train_step` would
    draw at the state's step, so the metrics equal that step's. Returns the train step's metrics less lr/grad_norm."""
    mask = trainable_mask(state.params, cfg.effective_optim)
    params_t, frozen = split_params(state.params, mask)
    rows = prepare_rows(target, shell, batch, cfg, jax.random.fold_in(jax.random.wrap_key_data(state.rng),
                                                                       state.step))
    loss, m = _whole_row_loss(frozen, shell, target, rows, cfg)[0](params_t)
    return dict(m, loss=loss, tokens=jnp.sum((batch["document_ids"] != -1).astype(jnp.int32)))


def _global_norm(tree):
    tree_mod = getattr(optax, "tree", None)
    return tree_mod.norm(tree) if tree_mod is not None and hasattr(tree_mod, "norm") else optax.global_norm(tree)


def make_train_step(cfg: TrainConfig, mesh: Optional[jax.sharding.Mesh] = None, donate: bool = True,
                    compiler_options: Optional[dict] = None):
    """jit(train_step) for a config; with a mesh, batch rows are sharded over "data", the state and head
    replicated, and the target kept as placed: place it on the mesh with `replicate` or `shard_target` first (a target
    committed to other devices is an error; batch_rows must divide by the mesh size). Cached per arguments, so
    repeated runs reuse one compilation. compiler_options: XLA options (e.g.
    {"xla_backend_optimization_level": 0} for fast CPU compiles in tests)."""
    opts = None if compiler_options is None else tuple(sorted(compiler_options.items()))
    return _make_train_step(cfg, mesh, donate, opts)


@functools.lru_cache(maxsize=16)
def _make_train_step(cfg: TrainConfig, mesh, donate: bool, opts):
    cfg.validate()
    fn = functools.partial(train_step, cfg=cfg)
    kw = dict(donate_argnums=(0,)) if donate else {}
    if opts is not None:
        kw["compiler_options"] = dict(opts)
    if mesh is None:
        return jax.jit(fn, **kw)
    n = mesh.devices.size
    if cfg.batch_rows % n:
        raise ValueError(f"batch_rows={cfg.batch_rows} is not divisible by the {n} devices of the mesh")
    rep = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(DATA_AXIS))
    return jax.jit(fn, in_shardings=(rep, rep, None, rows), out_shardings=(rep, rep), **kw)  # None: as placed


def shard_batch(batch: dict, mesh: Optional[jax.sharding.Mesh]):
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    sh = NamedSharding(mesh, P(DATA_AXIS))
    return {k: jax.device_put(jnp.asarray(v), sh) for k, v in batch.items()}


def replicate(tree, mesh: Optional[jax.sharding.Mesh]):
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P()))


SHARD_MIN_ELEMENTS = 1 << 16  # smaller target leaves (norms, biases) stay replicated


def target_leaf_spec(shape: tuple, n: int, min_elements: int = SHARD_MIN_ELEMENTS) -> P:
    """Partition of one frozen-target weight over the "data" axis of n devices: its largest dimension that n divides
    (the first of equal ones), or replicated when none does or the leaf has fewer than `min_elements`."""
    if n == 1 or int(np.prod(shape)) < min_elements:
        return P()
    dims = [int(d) for d in np.argsort([-x for x in shape], kind="stable") if shape[d] % n == 0]
    return P(*[DATA_AXIS if i == dims[0] else None for i in range(len(shape))]) if dims else P()


def shard_target(target: Target, mesh: jax.sharding.Mesh, min_elements: int = SHARD_MIN_ELEMENTS) -> Target:
    """The frozen target with each large weight split over the mesh's "data" devices (ZeRO-3 style: every device
    stores 1/n of it and XLA gathers the weights inside the jitted step where it needs them). Trades those collectives
    for stored memory; the step's peak falls by less (H200 x2, 8B target: 46.0 vs 49.6 GiB, docs/performance.md). The step equals the replicated one (tests/test_train_loop.py)."""
    n = mesh.devices.size
    params = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, target_leaf_spec(x.shape, n, min_elements))), target.params)
    return dataclasses.replace(target, params=params)
