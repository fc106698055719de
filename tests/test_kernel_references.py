"""jnp references of acceptance / metadata / rng vs independent numpy oracles (tests/kernel_np.py).

Distribution tests: each chi-square test rejects a correct sampler with probability <= ALPHA = 1e-4 (the
false-alarm rate); seeds are fixed, so the outcome is deterministic.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_np import chi2_pvalue, np_accept, np_draft_inputs, np_keep, np_probs, np_uniform
from pjax.kernels import rng
from pjax.kernels.acceptance import accept
from pjax.kernels.acceptance.reference import truncation_threshold
from pjax.kernels.metadata import build_draft_inputs

ALPHA = 1e-4


def test_rng_matches_numpy_hash_and_is_uniform():
    seed = np.array([0, 1, 2 ** 32 - 1, 12345], np.uint32)[:, None]
    pos = np.array([0, 7, 2 ** 31 - 1, 3])[:, None]
    lane = np.arange(4096)[None]
    uniform = jax.jit(rng.uniform, static_argnums=3)  # one program a call (op by op, each op compiles its own)
    for stream in (1, 2):
        got = np.asarray(uniform(jnp.asarray(seed), jnp.asarray(pos), jnp.asarray(lane), stream))
        np.testing.assert_array_equal(got, np_uniform(seed, pos, lane, stream).astype(np.float32))
    u = np.asarray(uniform(jnp.uint32(3), jnp.arange(20000), 0, 1))
    assert 0 < u.min() and u.max() < 1
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chi2_pvalue(counts, np.full(20, 0.05)) > ALPHA


def _inputs(key, b, k, v, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(key, 3)
    logits = (jax.random.normal(k1, (b, k + 1, v)) * 2).astype(dtype)
    amax = np.asarray(jnp.argmax(logits.astype(jnp.float32), -1))
    # drafts: target argmax for a random prefix, then a random id (possibly -1 or >= V)
    prefix = np.asarray(jax.random.randint(k2, (b,), 0, k + 1))
    rand = np.asarray(jax.random.randint(k3, (b, k), -1, v + 1))
    drafts = np.where(np.arange(k)[None] < prefix[:, None], amax[:, :k], rand).astype(np.int32)
    return logits, drafts


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_walk_matches_numpy(k):
    b, v = 16, 37
    logits, drafts = _inputs(jax.random.key(k), b, k, v, jnp.bfloat16)
    n = np.random.default_rng(k).integers(0, k + 1, b).astype(np.int32)
    r = accept(logits, jnp.asarray(drafts), None, temperature=jnp.zeros(b), seeds=jnp.zeros(b, jnp.uint32),
               positions=jnp.zeros(b, jnp.int32), num_drafts=jnp.asarray(n), implementation="xla")
    lg = np.asarray(logits.astype(jnp.float32))
    want = np.stack([np_accept(lg[i], drafts[i], None, 0.0, None, None, 0, 0, n[i]) for i in range(b)])
    np.testing.assert_array_equal(np.asarray(r.tokens), want)
    a = np.asarray(r.num_accepted)
    np.testing.assert_array_equal(np.asarray(r.next_token), want[np.arange(b), a])
    assert ((want >= 0).sum(1) == a + 1).all()


def test_all_accepted_bonus_and_padding():
    b, k, v = 4, 3, 10
    logits = jax.random.normal(jax.random.key(0), (b, k + 1, v))
    am = jnp.argmax(logits, -1).astype(jnp.int32)
    r = accept(logits, am[:, :k], None, temperature=jnp.zeros(b), seeds=jnp.zeros(b, jnp.uint32),
               positions=jnp.zeros(b, jnp.int32), num_drafts=jnp.array([3, 2, 0, 1]), implementation="xla")
    np.testing.assert_array_equal(np.asarray(r.num_accepted), [3, 2, 0, 1])
    np.testing.assert_array_equal(np.asarray(r.tokens[0]), np.asarray(am[0]))  # bonus = argmax p_{K+1}
    assert list(np.asarray(r.tokens[2])) == [int(am[2, 0]), -1, -1, -1]
    assert list(np.asarray(r.tokens[1, 3:])) == [-1]


@pytest.mark.parametrize("with_q", [False, True])
def test_stochastic_matches_numpy_float64(with_q):
    b, k, v = 24, 4, 29
    key = jax.random.key(7)
    logits, drafts = _inputs(key, b, k, v)
    rs = np.random.default_rng(1)
    q = rs.dirichlet(np.ones(v) * 0.3, size=(b, k)).astype(np.float32) if with_q else None
    temp = rs.choice([0.0, 0.6, 1.0, 1.7], b).astype(np.float32)
    top_k = rs.choice([0, 1, 3, 8], b).astype(np.int32)
    top_p = rs.choice([1.0, 0.5, 0.9], b).astype(np.float32)
    n = rs.integers(0, k + 1, b).astype(np.int32)
    seeds = rs.integers(0, 2 ** 32, b, dtype=np.uint64).astype(np.uint32)
    pos = rs.integers(0, 1000, b).astype(np.int32)
    r = jax.jit(lambda *a: accept(*a, temperature=temp, top_k=top_k, top_p=top_p, seeds=seeds, positions=pos,
                                  num_drafts=n, implementation="xla"))(logits, drafts, q)
    lg = np.asarray(logits)
    want = np.stack([np_accept(lg[i], drafts[i], None if q is None else q[i], temp[i], top_k[i], top_p[i],
                               seeds[i], pos[i], n[i]) for i in range(b)])
    np.testing.assert_array_equal(np.asarray(r.tokens), want)


def test_truncation_law_matches_numpy():
    rs = np.random.default_rng(3)
    b, v = 40, 50
    x = jnp.asarray(rs.normal(size=(b, 1, v)) * 3, jnp.float32)
    x = x.at[0, 0, 5].set(x[0, 0, 6])  # a tie
    top_k = rs.choice([0, 1, 2, 10, 49, 50, 60], b).astype(np.int32)
    top_p = rs.choice([1.0, 0.05, 0.3, 0.8, 0.99], b).astype(np.float32)
    thr = np.asarray(truncation_threshold(x, jnp.asarray(top_k), jnp.asarray(top_p)))
    xn = np.asarray(x)
    for i in range(b):
        got = xn[i, 0] >= thr[i, 0]
        np.testing.assert_array_equal(got, np_keep(xn[i, 0].astype(np.float64), top_k[i], top_p[i]), err_msg=str(i))


def _sample(logits, drafts, q, temp, top_k=None, top_p=None, n_rows=None):
    b = logits.shape[0]
    seeds = jnp.arange(b, dtype=jnp.uint32) * 7919 + 11
    fn = jax.jit(lambda l, d, qq: accept(l, d, qq, temperature=jnp.full((b,), temp), seeds=seeds,
                                         positions=jnp.full((b,), 100, jnp.int32),
                                         top_k=None if top_k is None else jnp.full((b,), top_k, jnp.int32),
                                         top_p=None if top_p is None else jnp.full((b,), top_p, jnp.float32),
                                         implementation="xla"))
    return np.asarray(fn(logits, drafts, q).tokens)


@pytest.mark.parametrize("mode", ["argmax", "sampled_q", "top_k_p"])
def test_first_and_conditional_second_token_distribution(mode):
    """x_1 ~ processed p_1; given x_1 = d_1 (accepted), x_2 ~ processed p_2(. | d_1)."""
    v, nsamp, temp = 6, 30000, 0.8  # K = 2 drafts
    rs = np.random.default_rng(11)
    l1 = rs.normal(size=v) * 1.5
    l2 = rs.normal(size=(v, v)) * 1.5  # p_2 depends on d_1
    top_k, top_p = (4, 0.8) if mode == "top_k_p" else (None, None)
    if mode == "sampled_q":
        q1 = rs.dirichlet(np.ones(v)); q2 = rs.dirichlet(np.ones(v), size=v)
        d1 = rs.choice(v, nsamp, p=q1)
        d2 = np.array([rs.choice(v, p=q2[a]) for a in d1])
        q = np.stack([np.broadcast_to(q1, (nsamp, v)), q2[d1]], 1).astype(np.float32)
    else:
        d1 = np.full(nsamp, int(np.argsort(l1)[-2]))  # a plausible but not top draft
        d2 = np.full(nsamp, int(np.argmax(l2[d1[0]])))
        q = None
    logits = np.stack([np.broadcast_to(l1, (nsamp, v)), l2[d1], rs.normal(size=(nsamp, v))], 1).astype(np.float32)
    drafts = np.stack([d1, d2], 1).astype(np.int32)
    toks = _sample(jnp.asarray(logits), jnp.asarray(drafts), None if q is None else jnp.asarray(q), temp,
                   top_k, top_p)
    p1, _ = np_probs(l1, temp, top_k, top_p)
    assert chi2_pvalue(np.bincount(toks[:, 0], minlength=v), p1) > ALPHA
    # conditional second token, pooled over d_1 values (sum of independent chi-squares via per-group tests)
    for a in np.unique(d1):
        sel = (toks[:, 0] == a) & (d1 == a)
        if sel.sum() < 200:
            continue
        p2, _ = np_probs(l2[a], temp, top_k, top_p)
        assert chi2_pvalue(np.bincount(toks[sel, 1], minlength=v), p2) > ALPHA / v


def test_acceptance_rate_argmax_drafts():
    """P(accept d_1) = p_1(d_1) for one-hot q."""
    v, nsamp = 5, 20000
    l1 = np.array([1.0, 0.2, -0.5, 0.7, 0.0])
    logits = np.broadcast_to(np.stack([l1, l1]), (nsamp, 2, v)).astype(np.float32)
    toks = _sample(jnp.asarray(logits), jnp.full((nsamp, 1), 3, jnp.int32), None, 1.0)
    p, _ = np_probs(l1, 1.0)
    rate = (toks[:, 0] == 3).mean()
    assert abs(rate - p[3]) < 5 * np.sqrt(p[3] * (1 - p[3]) / nsamp)


def test_seeded_rows_independent_of_batch():
    b, k, v = 8, 3, 40
    logits, drafts = _inputs(jax.random.key(2), b, k, v)
    kw = lambda s: dict(temperature=jnp.ones(s.size), seeds=jnp.asarray(s, jnp.uint32),
                        positions=jnp.asarray(s * 3, jnp.int32), implementation="xla")
    full = accept(logits, jnp.asarray(drafts), None, **kw(np.arange(b)))
    perm = np.array([5, 2, 7])
    part = accept(logits[perm], jnp.asarray(drafts[perm]), None, **kw(perm))
    np.testing.assert_array_equal(np.asarray(full.tokens)[perm], np.asarray(part.tokens))


@pytest.mark.parametrize("k", [1, 4, 11])
def test_draft_inputs_match_numpy(k):
    b = 7
    rs = np.random.default_rng(k)
    n = rs.integers(0, k + 1, b).astype(np.int32)
    vt = rs.integers(0, 1000, (b, k + 1)).astype(np.int32)
    nxt = rs.integers(0, 1000, b).astype(np.int32)
    start = rs.integers(0, 5000, b).astype(np.int32)
    s = 2 * k + (1 if k == 4 else 0)
    out = build_draft_inputs(jnp.asarray(n), jnp.asarray(vt), jnp.asarray(nxt), jnp.asarray(start), num_slots=s,
                             mask_token_id=7, implementation="xla")
    for i in range(b):
        want = np_draft_inputs(n[i], vt[i], nxt[i], start[i], s, 7)
        for name, val in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(out, name)[i]), np.asarray(val), err_msg=name)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="draft_ids"):
        accept(jnp.zeros((2, 4, 8)), jnp.zeros((2, 2), jnp.int32), temperature=jnp.zeros(2),
               seeds=jnp.zeros(2, jnp.uint32), positions=jnp.zeros(2, jnp.int32), implementation="xla")
    with pytest.raises(ValueError, match="num_slots"):
        build_draft_inputs(jnp.zeros(2, jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32),
                           jnp.zeros(2, jnp.int32), num_slots=5, mask_token_id=0, implementation="xla")
    with pytest.raises(ValueError, match="implementation"):
        build_draft_inputs(jnp.zeros(2, jnp.int32), jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32),
                           jnp.zeros(2, jnp.int32), num_slots=6, mask_token_id=0, implementation="cuda")
