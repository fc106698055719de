"""Lossless tree sampling (`accept_tree`): the first token and the first two tokens a tree round emits follow the
target's law (chi-square over many seeds, temperature alone and with top-k / top-p, a tree with several children at
the root and at depth 2), greedy rows get `accept_tree_greedy`'s result, a row's tokens do not depend on the other
rows, a chain tree gives the chain's sampled acceptance bit for bit, and `pjax.generate` samples with a tree, a
request alone as in a batch.

The target is a first-order Markov chain over V tokens (logits M[previous token]), so a node's law is M at its own
token and the law of the first two tokens is p(M[root])(x1) p(M[x1])(x2). A round that accepts no node emits x1 only;
its second token comes from a next round rooted at x1 (one position later), as the engine runs it. False-alarm rate:
ALPHA = 1e-3 per chi-square test (6 tests: 0.6% for the file)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.decode.tree import Tree, accept_tree, accept_tree_greedy
from pjax.kernels.acceptance.reference import accept as chain_accept
from tests.engine_utils import FAST, processed
from tests.test_distribution_engine import chi_square_pvalue
from tests.test_tree import DK, PROMPTS, chain, pair  # noqa: F401  (pair: the module's fixture)

V, K, S, G, ALPHA = 5, 3, 6000, 64, 1e-3
ROOT, POS = 2, 40  # the root's token; the position of the round's first token
PARENT = np.array([-1, -1, -1, 0, 0, 1, 3, 3])  # three children at the root, two under node 0 and under node 3
N = len(PARENT)
CASES = {"t0.7": (0.7, 0, 1.0), "t1_topk3_topp0.9": (1.0, 3, 0.9)}  # temperature, top_k, top_p

accept = jax.jit(accept_tree, static_argnames=("depths",), compiler_options=FAST)
greedy_accept = jax.jit(accept_tree_greedy, static_argnames=("depths",), compiler_options=FAST)


def markov():
    m = np.random.default_rng(3).normal(size=(V, V)) * 1.5
    order = lambda t, r: int(np.argsort(-m[t])[r])  # noqa: E731  the r-th likeliest token after t
    tok = np.zeros(N, int)
    tok[:3] = [order(ROOT, 1), order(ROOT, 0), order(ROOT, 3)]  # not in the law's order; the last one is cut by top-k
    tok[3:5] = [order(tok[0], 0), order(tok[0], 2)]
    tok[5] = order(tok[1], 0)
    tok[6:8] = [order(tok[3], 1), order(tok[3], 0)]
    return m, tok


def tree_of(tokens):
    """The tree of PARENT with tokens [B, N]."""
    b = tokens.shape[0]
    depth = np.zeros(N, int)
    vis = np.zeros((N + 1, N + 1), bool)
    vis[:, 0] = True
    for i, p in enumerate(PARENT):
        depth[i] = 1 if p < 0 else depth[p] + 1
        vis[i + 1] = vis[p + 1]
        vis[i + 1, i + 1] = True
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x), (b,) + x.shape)  # noqa: E731
    return Tree(jnp.asarray(tokens, jnp.int32), rep(PARENT.astype(np.int32)), rep(depth.astype(np.int32)), rep(vis))


def batch(roots):
    """One batch: for each case S rows of seeds 0..S-1 with the Markov logits under `roots` [2 S] (the root's token),
    then G greedy rows with random logits and random node counts. Returns the inputs of `accept`."""
    m, tok = markov()
    b = 2 * S + G
    rng = np.random.default_rng(4)
    logits = m[np.concatenate([np.asarray(roots)[:, None], np.broadcast_to(tok, (2 * S, N))], axis=1)]
    logits = np.concatenate([logits, rng.normal(size=(G, N + 1, V)) * 2], axis=0)
    tokens = np.broadcast_to(tok, (b, N))
    (t1, k1, p1), (t2, k2, p2) = CASES.values()
    col = lambda a, c, g: np.concatenate([np.full(S, a), np.full(S, c), np.full(G, g)])  # noqa: E731
    num = np.concatenate([np.full(2 * S, N), rng.integers(0, N + 1, G)])
    return dict(target_logits=jnp.asarray(logits, jnp.float32), tree=tree_of(tokens), depths=K,
                temperature=jnp.asarray(col(t1, t2, 0.0), jnp.float32), top_k=jnp.asarray(col(k1, k2, 0), jnp.int32),
                top_p=jnp.asarray(col(p1, p2, 1.0), jnp.float32),
                seeds=jnp.asarray(np.concatenate([np.arange(S), np.arange(S), np.arange(G)]), jnp.uint32),
                num_nodes=jnp.asarray(num, jnp.int32))


@pytest.fixture(scope="module")
def rounds():
    """(inputs, first round's result, the tokens (x1, x2) [2 S, 2] of the sampled rows)."""
    kw = batch(np.full(2 * S, ROOT))
    first = accept(positions=jnp.full(2 * S + G, POS, jnp.int32), **kw)
    tokens = np.asarray(first.tokens)[:2 * S]
    x1 = tokens[:, 0]
    again = accept(positions=jnp.full(2 * S + G, POS + 1, jnp.int32), **batch(x1))  # a next round rooted at x1
    x2 = np.where(np.asarray(first.num_accepted)[:2 * S] > 0, tokens[:, 1], np.asarray(again.tokens)[:2 * S, 0])
    return kw, first, np.stack([x1, x2], axis=1)


def law(case, first_only=False, temperature=None):
    m, _ = markov()
    t, k, p = CASES[case]
    t = t if temperature is None else temperature
    p1 = processed(m[ROOT], t, k, p)
    if first_only:
        return p1
    return p1[:, None] * np.stack([processed(m[x], t, k, p) for x in range(V)])


@pytest.mark.parametrize("case", list(CASES))
def test_first_tokens_follow_target_law(rounds, case):
    kw, first, x = rounds
    rows = slice(0, S) if case == "t0.7" else slice(S, 2 * S)
    counts = np.zeros((V, V), np.int64)
    np.add.at(counts, (x[rows, 0], x[rows, 1]), 1)
    assert chi_square_pvalue(counts.sum(axis=1), law(case, first_only=True)) > ALPHA
    assert chi_square_pvalue(counts, law(case)) > ALPHA
    n = np.asarray(first.num_accepted)[rows]
    assert set(n.tolist()) == set(range(K + 1))  # every depth ends a round, the root's rejection included
    path = np.asarray(first.path)[rows]
    assert len({tuple(r) for r in path[n >= 2, :2]}) >= 2  # several depth-2 nodes accepted (node 0's both children)
    if case != "t0.7":  # top-k 3 cuts the root's third child: never accepted
        assert not (path[:, 0] == 2).any()


def test_chi_square_detects_a_wrong_law(rounds):
    """Power check: the temperature-0.7 samples tested against the law at temperature 1 fail."""
    _, _, x = rounds
    counts = np.zeros((V, V), np.int64)
    np.add.at(counts, (x[:S, 0], x[:S, 1]), 1)
    with pytest.raises(AssertionError):
        assert chi_square_pvalue(counts, law("t0.7", temperature=1.0)) > ALPHA


def test_greedy_rows_are_accept_tree_greedy(rounds):
    kw, first, _ = rounds
    g = slice(2 * S, None)
    sub = {k: v for k, v in kw.items() if k in ("target_logits", "tree", "num_nodes")}
    sub = jax.tree.map(lambda a: a[g], sub)
    want = greedy_accept(sub["target_logits"], sub["tree"], depths=K, num_nodes=sub["num_nodes"])
    for got, ref in zip(first, want):
        np.testing.assert_array_equal(np.asarray(got)[g], np.asarray(ref))
    assert len(set(np.asarray(want.num_accepted).tolist())) >= 2


def test_a_row_does_not_depend_on_the_batch(rounds):
    """The rows permuted and the greedy rows' logits replaced: each row's result moves with it, unchanged."""
    kw, first, _ = rounds
    b = 2 * S + G
    perm = np.random.default_rng(5).permutation(b)
    moved = jax.tree.map(lambda a: a[perm] if getattr(a, "ndim", 0) and a.shape[0] == b else a, kw)
    moved["target_logits"] = moved["target_logits"].at[np.flatnonzero(perm >= 2 * S)].multiply(-1.0)
    out = accept(positions=jnp.full(b, POS, jnp.int32), **moved)
    keep = perm < 2 * S  # the sampled rows, now elsewhere in the batch
    for got, ref in zip(out, first):
        np.testing.assert_array_equal(np.asarray(got)[keep], np.asarray(ref)[perm[keep]])


def test_chain_tree_is_chain_sampling():
    """A chain tree (one child per node) gives the chain's sampled acceptance bit for bit (same seeds, positions,
    filters; ragged draft counts)."""
    rng = np.random.default_rng(6)
    b = 256
    logits = jnp.asarray(rng.normal(size=(b, K + 1, V)) * 2, jnp.float32)
    amax = np.asarray(jnp.argmax(logits, -1))
    drafts = jnp.asarray(np.where(rng.random((b, K)) < 0.5, amax[:, :K], rng.integers(0, V, (b, K))), jnp.int32)
    kw = dict(temperature=jnp.asarray(rng.choice([0.0, 0.7, 1.3], b), jnp.float32),
              top_k=jnp.asarray(rng.integers(0, 4, b), jnp.int32),
              top_p=jnp.asarray(rng.choice([1.0, 0.8], b), jnp.float32), seeds=jnp.arange(b, dtype=jnp.uint32),
              positions=jnp.asarray(rng.integers(0, 100, b), jnp.int32))
    num = jnp.asarray(rng.integers(0, K + 1, b), jnp.int32)
    want = jax.jit(chain_accept, compiler_options=FAST)(logits, drafts, num_drafts=num, **kw)
    got = accept(logits, chain(drafts), depths=K, num_nodes=num, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    assert len(set(np.asarray(want.num_accepted).tolist())) == K + 1


@pytest.mark.full  # sampled rows with a tree through generate: tests/test_tree_sequential.py in the default run
def test_generate_samples_with_a_tree(pair):  # noqa: F811
    """pjax.generate(tree_budget=N) at temperature > 0 (greedy and sampled rows in one batch, top-k on one): each
    request's output alone equals its output in the batch (same seed)."""
    kw = dict(max_new_tokens=10, drafting="parallel", num_speculative_tokens=DK, tree_budget=8, max_len=64,
              compiler_options=FAST)
    temps, seeds, top_k = [0.8, 0.0, 1.2], [11, 12, 13], [0, 0, 5]
    res = pjax.generate(*pair, PROMPTS, temperature=temps, seed=seeds, top_k=top_k, **kw)
    assert res.stats["stop_reasons"] == ["length"] * len(PROMPTS)
    for i in (0, 2):
        alone = pjax.generate(*pair, [PROMPTS[i]], temperature=temps[i], seed=seeds[i], top_k=top_k[i], **kw)
        assert alone.tokens[0] == res.tokens[i]
