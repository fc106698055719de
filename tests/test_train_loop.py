"""Train step: partitioned == single-pass gradients (spec D.5), exact resume through orbax, data
parallel on 4 fake CPU devices == 1 device, and a tiny end-to-end run (target, then a P-EAGLE head)."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from pjax.models.drafter import Drafter
from pjax.models.pairing import check_pair
from pjax.train.cod import cod_sample
from pjax.train.data import FeatureStream, pack_documents, stack_rows
from pjax.train.loop import train_drafter
from pjax.train.optim import split_params, trainable_mask
from pjax.train.state import init_train_state
from pjax.train.target_features import target_features
from pjax.train import make_mesh
from pjax.train.step import loss_and_grads, make_train_step, replicate, shard_batch, shard_target
from tests.train_utils import byte_training_setup

S, B = 64, 4
FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these tiny programs


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(la, lb))
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in lb)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def setup():
    """One TrainConfig for every test here (24 steps at lr 3e-3, the learning test's), so that the train step of each
    optimizer compiles once for the resume, learning and data-parallel tests."""
    target, drafter, stream, cfg = byte_training_setup(S, B, draft_vocab_size=200, num_depths=4, max_anchors=None)
    return target, drafter, stream, dataclasses.replace(cfg, total_steps=24,
                                                        optim=dataclasses.replace(cfg.optim, lr=3e-3))


def test_partitioned_grads_equal_single_pass(setup):
    """4 segments with causal completion (spec D.5) give the single-pass loss and gradients."""
    target, drafter, _, cfg = setup
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    pt, frozen = split_params(drafter.params, trainable_mask(drafter.params, cfg.optim))
    rng = np.random.default_rng(0)
    doc = np.array([[0] * 30 + [1] * 30 + [-1] * 4], np.int32)
    rows = dict(input_ids=rng.integers(0, 256, (1, S)).astype(np.int32),
                loss_mask=((rng.random((1, S)) < 0.8) & (doc >= 0)).astype(np.int32), document_ids=doc,
                hidden_states=rng.normal(size=(1, S, 96)).astype(np.float32),
                verifier_last_hidden_states=rng.normal(size=(1, S, 32)).astype(np.float32))

    @functools.partial(jax.jit, compiler_options=FAST)
    def both(pt, frozen, target, rows, key):
        rows = dict(rows, layout=jax.vmap(lambda lm, d: cod_sample(key, lm, cfg.cod, d))(
            rows["loss_mask"], rows["document_ids"]))
        one = loss_and_grads(pt, frozen, shell, target, rows, cfg)
        four = loss_and_grads(pt, frozen, shell, target, rows, dataclasses.replace(cfg, num_segments=4))
        return one, four

    (l1, g1, m1), (l4, g4, m4) = both(pt, frozen, target, rows, jax.random.key(7))
    assert int(m1["total"][3]) > 0  # deep elements are present and supervised
    assert rel(l4, l1) <= 1e-5
    assert tree_rel(g4, g1) <= 1e-4
    for k in ("correct", "total", "cond_correct", "cond_total", "chain_total"):  # chains may span segments
        np.testing.assert_array_equal(m1[k], m4[k], err_msg=k)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_exact(setup, tmp_path, optimizer):
    target, drafter, stream, cfg = setup
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer=optimizer))
    kw = dict(progress=False, compiler_options=FAST)
    straight = train_drafter(target, drafter, stream, cfg, steps=4, log_every=2, **kw)
    train_drafter(target, drafter, stream, cfg, steps=2, checkpoint_dir=tmp_path, **kw)
    resumed = train_drafter(target, drafter, stream, cfg, steps=4, checkpoint_dir=tmp_path, **kw)
    assert int(resumed.state.step) == 4 and int(resumed.state.data_position) == 4
    for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if optimizer == "adamw":
        assert straight.history[-1]["loss"] < straight.history[0]["loss"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizers_learn(setup, optimizer):
    target, drafter, stream, cfg = setup
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer=optimizer))
    run = train_drafter(target, drafter, stream, cfg, steps=24, log_every=4, progress=False, compiler_options=FAST)
    first, last = run.history[0], run.history[-1]
    assert last["loss"] < 0.9 * first["loss"]


def test_offline_features_step_equals_online(setup):
    """A train step on offline features (each document's target features computed alone, packed by
    `FeatureStream`) equals the step that computes them online from the packed raw row; wrong widths fail early."""
    target, drafter, stream, cfg = setup
    docs = [dataclasses.replace(d, tokens=d.tokens[:n], loss_mask=d.loss_mask[:n])
            for d, n in zip(stream.docs, (20, 20, 20))]  # 60 raw tokens: one packed row of S = 64
    online = stack_rows(pack_documents(docs, S))
    aux_ids = check_pair(target.config, drafter.config)
    features = jax.jit(target_features, static_argnums=3, compiler_options=FAST)  # one program for the 3 documents
    smps = []
    for d in docs:
        aux, final = features(target, d.tokens[None], np.zeros((1, len(d.tokens)), np.int32), aux_ids)
        smps.append(dict(input_ids=d.tokens, loss_mask=d.loss_mask, hidden_states=np.asarray(aux[0]),
                         verifier_last_hidden_states=np.asarray(final[0])))
    offline = FeatureStream(smps, S, 1, shuffle=False).batch(0)
    mesh1 = make_mesh(devices=jax.devices()[:1])
    step = make_train_step(cfg, mesh1, compiler_options=FAST)  # train_drafter's (the resume test compiled it online)
    shell, target = (replicate(x, mesh1) for x in (Drafter(drafter.config, drafter.graphdef, None, drafter.d2t),
                                                   target))

    def run(row):  # the row in each of the B rows of a batch
        return step(replicate(init_train_state(drafter, cfg), mesh1), shell, target,
                    shard_batch({k: np.repeat(v, B, axis=0) for k, v in row.items()}, mesh1))

    s_on, m_on = run(online)
    s_off, m_off = run(offline)
    assert rel(m_off["loss"], m_on["loss"]) <= 1e-5
    np.testing.assert_array_equal(m_on["total"], m_off["total"])
    assert tree_rel(s_off.params, s_on.params) <= 1e-5
    with pytest.raises(ValueError, match="hidden_states must be"):
        run(dict(offline, hidden_states=offline["hidden_states"][..., :-1]))


def test_data_parallel_matches_single_device(setup):
    target, drafter, stream, cfg = setup
    assert jax.device_count() >= 4
    batch = stream.batch(1)
    shell = Drafter(drafter.config, drafter.graphdef, None, drafter.d2t)
    mesh1 = make_mesh(devices=jax.devices()[:1])
    one = make_train_step(cfg, mesh1, compiler_options=FAST)  # compiled already by the resume test
    s1, m1 = one(replicate(init_train_state(drafter, cfg), mesh1), replicate(shell, mesh1), replicate(target, mesh1),
                 shard_batch(batch, mesh1))  # placed as train_drafter places them: the same program
    mesh = make_mesh(devices=jax.devices()[:4])
    many = make_train_step(cfg, mesh, compiler_options=FAST)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s4, m4 = many(jax.device_put(init_train_state(drafter, cfg), rep), jax.device_put(shell, rep),
                  jax.device_put(target, rep), shard_batch(batch, mesh))
    assert len(m4["loss"].sharding.device_set) == 4
    assert rel(m4["loss"], m1["loss"]) <= 1e-5
    for k in ("total", "chain_total"):  # correctness-free counts (argmax near-ties may differ)
        np.testing.assert_array_equal(m1[k], m4[k], err_msg=k)
    assert tree_rel(s4.params, s1.params) <= 1e-5
    # the frozen target split over the 4 devices (ZeRO-3 style) gives the same step
    sharded = shard_target(target, mesh, min_elements=1)
    big = [x for x in jax.tree.leaves(sharded.params) if x.size >= 256]
    assert big and all(x.addressable_shards[0].data.size * 4 == x.size for x in big)
    args = (jax.device_put(init_train_state(drafter, cfg), rep), jax.device_put(shell, rep), sharded,
            shard_batch(batch, mesh))
    compiled = many.lower(*args).compile()
    compiled_target = compiled.input_shardings[0][2]  # the step keeps the split placement
    assert [s.spec for s in jax.tree.leaves(compiled_target.params)] == [
        x.sharding.spec for x in jax.tree.leaves(sharded.params)]
    s4t, m4t = compiled(*args)  # (calling `many` would compile the program a second time)
    assert rel(m4t["loss"], m1["loss"]) <= 1e-5
    np.testing.assert_array_equal(m1["total"], m4t["total"])
    assert tree_rel(s4t.params, s1.params) <= 1e-5
    with pytest.raises(ValueError, match="split_target=True needs a mesh of more than one device"):
        train_drafter(target, drafter, stream, cfg, steps=1, progress=False, split_target=True)


@pytest.mark.full  # test_parallel_consistency.py::test_tiny_pair_learns checks a longer run of the same pair
def test_tiny_end_to_end_learns():
    from examples.tiny_pair import tiny_run
    run = tiny_run(target_steps=100, head_steps=80, batch_rows=4, seq_len=128, log_every=10, max_files=6)
    assert run.target_history[-1][1] < 0.75 * run.target_history[0][1]
    h = run.head_history
    first, last = h[0], h[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["acc_all"] > first["acc_all"] + 0.1
    for d in range(4):
        assert last["acc"][d] > first["acc"][d]
    assert last["tokens_per_s"] > 0
