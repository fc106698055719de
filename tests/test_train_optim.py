"""pjax.train.optim's Muon against the reference: speculators' `--optimizer muon` = torch.optim.Muon (match_rms_adamw)
on its 2-D weights and torch.optim.AdamW on the rest, after global-norm clipping, several steps in float32."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from pjax.train.optim import OptimConfig, make_optimizer, muon_mask, newton_schulz

SHAPES = {"embed_tokens": {"embedding": (40, 16)}, "fc": {"kernel": (48, 16)},
          "layers": {"0": {"q": {"kernel": (16, 24)}, "norm": {"scale": (16,)}, "up": {"kernel": (16, 32)}}},
          "mask_hidden": (1, 48)}
STEPS = 4
FAST = {"xla_backend_optimization_level": 0,  # CPU: much faster compiles of these tiny programs
        "xla_allow_excess_precision": False}  # keep every bf16 rounding, as op by op (and torch)


def _torch_reference(params, grads, cfg: OptimConfig, muon_names):
    """speculators' split and optimizers (speculators/train/optimizers.py), constant learning rates."""
    names = list(params)
    tp = {n: torch.nn.Parameter(torch.tensor(params[n])) for n in names}
    muon = torch.optim.Muon([tp[n] for n in names if n in muon_names], lr=cfg.muon_lr or cfg.lr,
                            momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay, ns_steps=cfg.muon_ns_steps,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([tp[n] for n in names if n not in muon_names], lr=cfg.lr, betas=(cfg.b1, cfg.b2),
                              eps=cfg.eps, weight_decay=cfg.weight_decay)
    for g in grads:
        for n in names:
            tp[n].grad = torch.tensor(g[n])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), cfg.grad_clip)
        muon.step()
        adamw.step()
    return {n: tp[n].detach().numpy() for n in names}


def test_muon_mask_follows_speculators():
    params = jax.tree.map(lambda s: jnp.zeros(s), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    mask = muon_mask(params)
    assert mask["fc"]["kernel"] and mask["layers"]["0"]["q"]["kernel"] and mask["layers"]["0"]["up"]["kernel"]
    assert not mask["embed_tokens"]["embedding"] and not mask["layers"]["0"]["norm"]["scale"]
    assert not mask["mask_hidden"]  # a [1, N] vector: AdamW (torch.optim.Muon takes matrices only)


def test_newton_schulz_orthogonalises():
    g = np.random.default_rng(0).normal(size=(24, 64)).astype(np.float32)
    ns = jax.jit(newton_schulz, compiler_options=FAST)  # as the train step runs it (op by op: ~50 programs)
    for x in (g, g.T):
        s = np.linalg.svd(np.asarray(ns(jnp.asarray(x)), np.float32), compute_uv=False)
        assert 0.5 < s.min() and s.max() < 1.5  # U S' V^T with S' near 1 (the quintic's design)
    ref = np.asarray(torch.optim._muon._zeropower_via_newtonschulz(torch.tensor(g), (3.4445, -4.7750, 2.0315), 5,
                                                                     1e-7).float())
    got = np.asarray(ns(jnp.asarray(g)), np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3  # the same bf16 roundings


@pytest.mark.parametrize("muon_lr", [None, 3e-3])
def test_muon_matches_torch(muon_lr):
    cfg = OptimConfig(lr=1e-2, optimizer="muon", muon_lr=muon_lr, schedule="constant", warmup_steps=0, grad_clip=1.0)
    rng = np.random.default_rng(1)
    flat, tree = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        SHAPES, is_leaf=lambda x: isinstance(x, tuple))[0]]
    params = [rng.normal(size=s).astype(np.float32) for s in flat]
    grads = [[rng.normal(size=s).astype(np.float32) for s in flat] for _ in range(STEPS)]

    tx = make_optimizer(cfg, STEPS)
    p = jax.tree.unflatten(tree, [jnp.asarray(x) for x in params])
    state = tx.init(p)

    @functools.partial(jax.jit, compiler_options=FAST)  # one program (op by op, the update compiles ~100 programs)
    def step(g, state, p):
        upd, state = tx.update(g, state, p)
        return optax.apply_updates(p, upd), state

    for g in grads:
        p, state = step(jax.tree.unflatten(tree, [jnp.asarray(x) for x in g]), state, p)
    got = dict(zip(paths, [np.asarray(x) for x in jax.tree.leaves(p)]))

    mask = dict(zip(paths, jax.tree.leaves(muon_mask(jax.tree.unflatten(tree, params)))))
    ref = _torch_reference(dict(zip(paths, params)), [dict(zip(paths, g)) for g in grads], cfg,
                           {n for n, m in mask.items() if m})
    start = dict(zip(paths, params))
    for n in paths:
        moved = ref[n] - start[n]
        err = np.linalg.norm((got[n] - start[n]) - moved) / np.linalg.norm(moved)
        assert err < 2e-3, (n, err)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        make_optimizer(OptimConfig(optimizer="sgd"), 10)
