"""P-EAGLE chain metrics: each depth's accuracy given the anchor's earlier depths right (cond_acc) and the whole
chain's (chain_acc), against a numpy reference written from the definition: on a hand-built layout, and on real
train steps of a tiny model (single pass and partitioned), whose per-element correctness is recomputed with
`row_loss_terms`; held-out evaluation (`eval_step`, `evaluate_drafter`) reports the train step's metrics."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.models.drafter import Drafter
from pjax.train.loop import evaluate_drafter, summarize
from pjax.train.losses import anchor_grid, chain_metrics, row_loss_terms, with_params
from pjax.train.state import init_train_state
from pjax.train import make_mesh
from pjax.train.step import eval_step, make_train_step, prepare_rows, replicate, shard_batch
from tests.train_utils import byte_training_setup

FAST = {"xla_backend_optimization_level": 0}


def reference(anchor, depth, weight, correct, s, k):
    """(cond_correct, cond_total, chain_total) [K] from the definition: an anchor counts at depth d when each of its
    depths 0..d has an element of weight > 0 (a depth is right when all its elements are)."""
    elems = {}
    for a, d, w, c in zip(anchor, depth, weight, correct):
        if w > 0 and 0 <= a < s:
            elems.setdefault((int(a), int(d)), []).append(bool(c))
    cc, ct, ch = np.zeros(k), np.zeros(k), np.zeros(k)
    for a in range(s):
        for d in range(k):
            if any((a, j) not in elems for j in range(d + 1)):
                continue
            right = [all(elems[(a, j)]) for j in range(d + 1)]
            ch[d] += 1
            if all(right[:d]):
                ct[d] += 1
                cc[d] += right[d]
    return cc, ct, ch


@functools.partial(jax.jit, static_argnums=(4, 5), compiler_options=FAST)  # one program per shape, not per op
def _grid_metrics(anchor, depth, weight, correct, s, k):
    grids = anchor_grid(correct.astype(bool), weight.astype(jnp.float32), anchor.astype(jnp.int32),
                        depth.astype(jnp.int32), s, k)
    return grids, chain_metrics(*grids)


def grid_metrics(anchor, depth, weight, correct, s, k):
    grids, metrics = _grid_metrics(*(jnp.asarray(x) for x in (anchor, depth, weight, correct)), s, k)
    return grids, [np.asarray(x) for x in metrics]


def test_hand_built_layout():
    s, k = 8, 4
    # (anchor, depth, weight, correct)
    elems = [(a, 0, w, c) for a, w, c in zip(range(s), [0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1, 1, 1])]
    elems += [
        (2, 1, 1, 1), (2, 2, 1, 0), (2, 3, 1, 1),  # chain right, wrong, right
        (1, 1, 1, 1), (1, 2, 1, 1), (1, 3, 1, 1),  # all right
        (3, 1, 1, 1), (3, 2, 1, 1),  # depth 0 wrong
        (4, 1, 0, 1), (4, 2, 1, 1),  # depth 1 outside the loss: anchor 4 stops at depth 0
        (5, 2, 1, 1),  # depth 1 missing: not nested
        (6, 1, 1, 1), (6, 1, 1, 0),  # a repeated element, one copy wrong: depth 1 wrong
        (6, 2, 1, 1),
        (0, 1, 1, 1), (0, 2, 1, 1),  # depth 0 of anchor 0 carries no loss
        (0, 1, 0, 0), (0, 3, 0, 0),  # padding slots (weight 0)
        (-1, 1, 1, 1), (8, 1, 1, 1),  # anchors outside the row
    ]
    a, d, w, c = (np.array(x) for x in zip(*elems))
    want = reference(a, d, w, c, s, k)
    # by hand: depth 0 supervised at anchors 1..7, wrong at 3
    np.testing.assert_array_equal(want[2], [7, 4, 4, 2])  # anchors 1..7; 1, 2, 3, 6; 1, 2, 3, 6; 1, 2
    np.testing.assert_array_equal(want[1], [7, 3, 2, 1])  # 1..7; 1, 2, 6; 1, 2; 1
    np.testing.assert_array_equal(want[0], [6, 2, 1, 1])  # 1..7 but 3; 1, 2; 1; 1
    _, got = grid_metrics(a, d, w, c, s, k)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(g, r)
    # grids of two disjoint halves add up to the whole (partitioned steps)
    half = np.arange(len(a)) % 2 == 0
    g1, _ = grid_metrics(a[half], d[half], w[half], c[half], s, k)
    g2, _ = grid_metrics(a[~half], d[~half], w[~half], c[~half], s, k)
    for g, r in zip(jax.jit(chain_metrics, compiler_options=FAST)(g1[0] + g2[0], g1[1] + g2[1]), want):
        np.testing.assert_array_equal(np.asarray(g), r)


def test_random_layouts_batched():
    """Random layouts (repeats, gaps, padding) of 3 rows at once: row-wise grids summed == the per-row references."""
    s, k, n = 16, 5, 120
    rng = np.random.default_rng(0)
    rows = [(rng.integers(-1, s + 1, n), rng.integers(0, k, n), (rng.random(n) < 0.9).astype(np.float32),
             rng.random(n) < 0.85) for _ in range(3)]
    for a, d, w, c in rows:  # depth 0 everywhere, as in a COD layout
        a[:s], d[:s] = np.arange(s), 0
    grids = [grid_metrics(*r, s, k)[0] for r in rows]
    got = jax.jit(chain_metrics, compiler_options=FAST)(jnp.stack([g[0] for g in grids]),
                                                        jnp.stack([g[1] for g in grids]))
    want = np.sum([reference(*r, s, k) for r in rows], axis=0)
    assert want[1][k - 1] > 0
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), r)


S, B, K = 64, 2, 4


@pytest.fixture(scope="module")
def setup():
    # a 3-token draft vocabulary: a random head agrees with the target often enough for chains 4 deep
    return byte_training_setup(S, B, draft_vocab_size=3, num_depths=K, max_anchors=40)


@pytest.mark.full  # the default run checks the eval step's metrics against the train step's
def test_train_step_chain_metrics(setup):
    """The step's cond/chain counts equal the reference over per-element correctness recomputed from the step's own
    layout; the partitioned step (3 segments) gives the same counts; `summarize` turns them into cond_acc/chain_acc."""
    target, drafter, stream, cfg = setup
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    state = init_train_state(drafter, cfg)
    batch = shard_batch(stream.batch(0), None)
    _, m = make_train_step(cfg, donate=False, compiler_options=FAST)(state, shell, target, batch)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)  # the step's COD key
    rows = jax.jit(lambda b: prepare_rows(target, shell, b, cfg, key), compiler_options=FAST)(batch)

    @functools.partial(jax.jit, compiler_options=FAST)
    def terms(params, row, layout):
        _, correct, weight = row_loss_terms(
            with_params(drafter, params), target, row["input_ids"], row["hidden_states"],
            row["verifier_last_hidden_states"], row["loss_mask"], row["document_ids"], layout, num_depths=K)
        return correct, weight

    want = np.zeros((3, K))
    marginal = np.zeros((2, K))
    for i in range(B):
        row = {k: v[i] for k, v in rows.items() if k != "layout"}
        layout = jax.tree.map(lambda x: x[i], rows["layout"])
        correct, weight = (np.asarray(x) for x in terms(state.params, row, layout))
        a, d = np.asarray(layout.anchor_pos), np.asarray(layout.depth)
        want += reference(a, d, weight, correct, S, K)
        marginal += [np.bincount(d, weight * correct, K), np.bincount(d, weight, K)]
    np.testing.assert_array_equal(m["correct"], marginal[0])  # the recomputation is the step's
    np.testing.assert_array_equal(m["total"], marginal[1])
    assert want[1][K - 1] > 0 and (want[0] < want[1]).any()  # deep chains present, some wrong
    assert not np.allclose(want[0] / want[1], marginal[0] / marginal[1])  # conditional != marginal
    for name, r in zip(("cond_correct", "cond_total", "chain_total"), want):
        np.testing.assert_array_equal(m[name], r, err_msg=name)
    _, m3 = make_train_step(dataclasses.replace(cfg, num_segments=3), donate=False, compiler_options=FAST)(
        state, shell, target, batch)
    for name in ("correct", "total", "cond_correct", "cond_total", "chain_total"):
        np.testing.assert_array_equal(m3[name], m[name], err_msg=name)
    summary = summarize(1, [jax.device_get(m)], 1.0)
    np.testing.assert_allclose(summary["cond_acc"], want[0] / want[1])
    np.testing.assert_allclose(summary["chain_acc"], want[0] / want[2])


@pytest.mark.parametrize("objective", ["peagle", "eagle3"])
def test_eval_step_reports_the_train_steps_metrics(setup, objective):
    """eval_step on (state, batch) gives the loss and every count of train_step on the same pair (P-EAGLE: the same
    COD layout), and evaluate_drafter summarises those of batches 0..n-1 as the training log does."""
    target, drafter, stream, cfg = setup
    cfg = dataclasses.replace(cfg, objective=objective, ttt_steps=3)
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    state = init_train_state(drafter, cfg)
    batches = [shard_batch(stream.batch(i), None) for i in range(2)]
    step = make_train_step(cfg, donate=False, compiler_options=FAST)
    mesh1 = make_mesh(devices=jax.devices()[:1])
    ev = jax.jit(functools.partial(eval_step, cfg=cfg), compiler_options=FAST)  # placed as evaluate_drafter runs it:
    placed = [replicate(x, mesh1) for x in (state, shell, target)]  # the same program, compiled once
    trained = [jax.device_get(step(state, shell, target, b)[1]) for b in batches]
    for i, t in enumerate(trained):
        e = jax.device_get(ev(*placed, shard_batch(stream.batch(i), mesh1)))
        np.testing.assert_allclose(e["loss"], t["loss"], rtol=1e-6)
        keys = [k for k in t if k not in ("loss", "lr", "grad_norm")]
        assert {"correct", "total", "cond_correct", "cond_total", "tokens"} <= set(keys) <= set(e)
        for k in keys:
            np.testing.assert_array_equal(e[k], t[k], err_msg=k)
    got = evaluate_drafter(target, drafter, stream, cfg, batches=2, compiler_options=FAST)
    want = summarize(2, trained, 1.0)
    for k in ("acc", "cond_acc") + (("chain_acc",) if objective == "peagle" else ()):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="batches=0"):
        evaluate_drafter(target, drafter, stream, cfg, batches=0)
