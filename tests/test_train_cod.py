"""COD sampling (spec D.3) under jit, the P-EAGLE mask (spec D.2) as data, and attention under it."""
import numpy as np
import pytest
import torch

speculators = pytest.importorskip("speculators")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402

from pjax.kernels.flash_attention import attention  # noqa: E402
from pjax.kernels.flash_attention.config import FlashConfig  # noqa: E402
from pjax.train.masks import chain_index, cod_dense_mask, cod_mask  # noqa: E402
from pjax.train.cod import (CodConfig, cod_budget, cod_capacities, cod_sample, depth_count_table,  # noqa: E402
                            element_segment, layout_from_arrays, partition_layout)
from speculators.models.peagle.attention import create_peagle_mask_mod  # noqa: E402
from speculators.models.peagle.data import generate_cod_sample_indices  # noqa: E402
from tests.dense_attention import dense_attention  # noqa: E402

S = 512
FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these small programs
jit_sample = jax.jit(cod_sample, static_argnums=2, compiler_options=FAST)


def row(seed=0):
    """Two documents + padding; loss on a random ~80% of the tokens (never position 0)."""
    rng = np.random.default_rng(seed)
    doc = np.array([0] * 200 + [1] * 280 + [-1] * 32, np.int32)
    lm = ((rng.random(S) < 0.8) & (doc != -1)).astype(np.int32)
    lm[0] = 0
    return lm, doc


@pytest.mark.parametrize("max_anchors", [None, 100])
def test_cod_statistics_match_speculators(max_anchors):
    lm, doc = row()
    cfg = CodConfig(num_depths=6, max_anchors=max_anchors, same_document=False)
    sample = jax.jit(lambda k: cod_sample(k, lm, cfg, doc), compiler_options=FAST)
    ours, theirs = [], []
    for i in range(12):
        lay = jax.device_get(sample(jax.random.key(i)))
        assert lay.anchor_pos.shape == (cod_budget(S, cfg),)  # static budget
        a, d, ok = np.asarray(lay.anchor_pos), np.asarray(lay.depth), np.asarray(lay.valid)
        np.testing.assert_array_equal(a[:S], np.arange(S))
        assert ok[:S].all() and (a >= 0).all()
        present = {(int(x), int(y)) for x, y, v in zip(a, d, ok) if v}
        for x, y, v in zip(a, d, ok):
            if v and y > 0:
                assert lm[x + y] == 1  # reference position is loss-valid
                assert all((int(x), e) in present for e in range(y))  # the whole chain is present
        ours.append([int(ok[d == k].sum()) for k in range(6)])
        torch.manual_seed(i)
        _, td = generate_cod_sample_indices(S, torch.tensor(lm)[None], num_depths=6, max_anchors=max_anchors)
        theirs.append([int((td == k).sum()) for k in range(6)])
    ours, theirs = np.array(ours, float), np.array(theirs, float)
    # counts follow n_d = int(max(0, seeds - d) * max(r^d, r_min)) unless the candidate pool is smaller
    nseed = int(lm.sum()) if max_anchors is None else min(max_anchors, int(lm.sum()))
    table = depth_count_table(S, cfg)
    assert (ours <= table[:, nseed][None]).all()
    np.testing.assert_array_equal(ours[:, :2], theirs[:, :2])  # depths 0 and 1 are deterministic
    np.testing.assert_allclose(ours.mean(0), theirs.mean(0), rtol=0.05)


def test_cod_same_document_and_budget():
    lm, doc = row(1)
    lm[200] = 1  # first token of document 1 is loss-valid: its depth-1 anchor would sit in document 0
    cfg = CodConfig(num_depths=8, max_anchors=None)
    lay = jit_sample(jax.random.key(0), lm, cfg, doc)
    a, d, ok = (np.asarray(x) for x in (lay.anchor_pos, lay.depth, lay.valid))
    deep = ok & (d > 0)
    assert (doc[a[deep]] == doc[a[deep] + d[deep]]).all()
    # spec D.3 measured counts (S=4096, 3896 loss-valid): 2726/1908/1335/934/778; max_anchors=512: 357/249/174/121
    np.testing.assert_array_equal(depth_count_table(4096, cfg)[1:6, 3896], [2726, 1908, 1335, 934, 778])
    capped = depth_count_table(4096, CodConfig(num_depths=5, max_anchors=512))
    np.testing.assert_array_equal(capped[1:, 512], [357, 249, 174, 121])
    caps = cod_capacities(S, cfg)
    assert caps[0] == S and caps[1] == int((S - 1) * 0.7)  # worst case over loss masks: static
    assert sum(caps) == lay.anchor_pos.shape[0]


def test_partition_owns_every_element_once():
    lm, doc = row(2)
    n = 128
    lm, doc = lm[:n], doc[:n]
    cfg = CodConfig(num_depths=5, max_anchors=None)
    lay = jit_sample(jax.random.key(3), lm, cfg, doc)
    segs = jax.jit(lambda x: partition_layout(x, n, 4, cod_capacities(n, cfg)), compiler_options=FAST)(lay)
    owned = []
    for sg in segs:
        a, d, ok, own = (np.asarray(x) for x in (sg.layout.anchor_pos, sg.layout.depth, sg.layout.valid, sg.owned))
        owned += [(int(x), int(y)) for x, y, o in zip(a, d, own) if o]
        # causal completion: every owned element's context (depth-0 anchors <= its anchor) is present
        assert (a[own] < (d == 0).sum()).all()
    full = {(int(x), int(y)) for x, y, v in zip(np.asarray(lay.anchor_pos), np.asarray(lay.depth),
                                                 np.asarray(lay.valid)) if v}
    assert len(owned) == len(set(owned)) and set(owned) == full
    seg = np.asarray(jax.jit(element_segment, static_argnums=(2, 3), compiler_options=FAST)(
        jnp.asarray([0, 127, 128, 511, 127]), jnp.asarray([0, 0, 0, 0, 1]), 512, 4))
    np.testing.assert_array_equal(seg, [0, 0, 1, 3, 1])


@pytest.mark.parametrize("window", [None, 3])
def test_mask_builder_matches_speculators(window):
    lm, doc = row(4)
    doc_s, lm_s = doc[:40].copy(), lm[:40]
    doc_s[34:] = -1
    torch.manual_seed(0)
    a, d = generate_cod_sample_indices(40, torch.tensor(lm_s)[None], num_depths=4)
    a, d = torch.cat([a, torch.tensor([-1])]), torch.cat([d, torch.tensor([1])])  # an element anchored before the row
    mod = create_peagle_mask_mod(a, d, torch.tensor(doc_s), window)
    ref = create_mask(mod, None, None, len(a), len(a), device="cpu")[0, 0].numpy()
    ours = np.asarray(cod_dense_mask(layout_from_arrays(a.numpy(), d.numpy()), doc_s, window))
    np.testing.assert_array_equal(ours, ref)


SMALL = FlashConfig(block_q=16, block_k=16, dkv_block_q=16, dkv_block_k=16, dq_block_q=16, dq_block_k=16)


@pytest.mark.parametrize("window,chunk", [(None, None), (2, 16)])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_cod_attention_equals_dense(window, chunk, implementation):
    """Attention under `cod_mask` (context part + chain part; the reference in query chunks, or the flash kernel
    merged with the chain part) == a plain softmax under the dense D.2 mask, forward and gradients, including
    windows smaller than the depth (the chain root stays visible through the context)."""
    lm, doc = row(5)
    n0 = 64
    lm_s, doc_s = lm[:n0], doc[:n0].copy()
    doc_s[60:] = -1
    cfg = CodConfig(num_depths=4, max_anchors=None)
    lay = jit_sample(jax.random.key(1), lm_s, cfg, doc_s)
    n = lay.anchor_pos.shape[0]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, n, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, n, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, n, 2, 8)), jnp.float32)
    dense = cod_dense_mask(lay, doc_s, window)
    live = np.asarray(dense.any(-1))  # rows with no visible key are don't-care
    w = jnp.asarray(rng.normal(size=(1, n, 4, 8)) * live[None, :, None, None], jnp.float32)
    mask = cod_mask(lay, doc_s, 4, n0, chunk)

    def ours(q, k, v):
        return attention(q, k[:, :n0], v[:, :n0], mask, chain_k=k, chain_v=v, scale=0.35, window=window,
                         implementation=implementation, config=SMALL)

    def with_grads(fn):  # one program: the values and the gradients of sum(fn * w)
        return jax.jit(lambda *a: (fn(*a), jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(*a)),
                       compiler_options=FAST)

    want, wants = with_grads(lambda q, k, v: dense_attention(q, k, v, dense[None], 0.35))(q, k, v)
    got, grads = with_grads(ours)(q, k, v)
    np.testing.assert_allclose(np.asarray(got)[0][live], np.asarray(want)[0][live], rtol=1e-5, atol=1e-5)
    for g, gw in zip(grads, wants):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-4, atol=1e-5)


def test_chain_index_holds_repeated_elements():
    """A chain is a run of the (anchor, depth)-sorted elements: repeated elements are all found (slots permitting),
    invalid ones never, depth 0 (the context's own anchor) never."""
    lay = layout_from_arrays(np.array([0, 1, 2, 2, 2, 2, 1]), np.array([0, 0, 0, 1, 2, 2, 1]),
                             np.array([1, 1, 1, 1, 1, 1, 0], bool))
    index = jax.jit(chain_index, static_argnums=(1, 2), compiler_options=FAST)
    idx, found = (np.asarray(x) for x in index(lay, 3, 3))
    chains = [sorted(int(j) for j, f in zip(idx[i], found[i]) if f) for i in range(7)]
    assert chains == [[], [], [], [3], [3, 4, 5], [3, 4, 5], []]
