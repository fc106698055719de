"""EAGLE-3 draft trees (EAGLE-2's dynamic tree): `grow_tree` equals a numpy run of the same expand-rerank procedure on
a toy drafter whose distribution depends on the whole path; `sequential_tree` equals that procedure run with the
drafter's own chain steps along each path (ragged rows, stale cache entries that must stay unseen, an inactive row);
greedy decoding with an EAGLE-3 head and a tree equals plain greedy decoding on a second family (the tiny llama's
cases are in tests/test_tree.py); at temperature 1 the first two tokens follow the target's law."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.decode.draft import feedback, sequential_tree
from pjax.decode.tree import beam_width, candidate_count, grow_tree
from pjax.models.drafter import draft_logits_from_hidden, draft_to_target, drafter_forward, init_drafter_cache
from tests.engine_utils import FAST, make_eagle3
from tests.test_distribution_engine import ALPHA, PROMPT, chi_square_pvalue, joint_law
from tests.test_distribution_engine import V as SMALL_V
from tests.test_tree import paths


def procedure(root_lp, child_lp, n, k, w, score):
    """numpy: EAGLE-2's expand-rerank for B rows, node by node. root_lp [B, V] f32; child_lp(paths) -> [B, W, V] f32:
    the log-probabilities after each of the W paths (token tuples) of each row's frontier. Returns (each row's N best
    paths, best first; per expansion, each row's frontier as (path, frontier slots of its ancestors-or-self))."""
    join = np.add if score == "product" else np.minimum
    top = lambda lp: np.argsort(-lp, kind="stable")[:w]  # noqa: E731  ties -> the lower id
    b = root_lp.shape[0]
    cands = [[(lp, lp, (int(t),)) for t in top(root_lp[r]) for lp in [np.float32(root_lp[r, t])]] for r in range(b)]
    front = [[c + ({i},) for i, c in enumerate(cands[r])] for r in range(b)]
    fronts = []
    for d in range(1, k):
        fronts.append([[(f[2], f[3]) for f in front[r]] for r in range(b)])
        lps = child_lp([[f[2] for f in front[r]] for r in range(b)])
        for r in range(b):
            kids = [(join(f[0], lps[r, i, t]), np.float32(f[1] + lps[r, i, t]), f[2] + (int(t),), f[3])
                    for i, f in enumerate(front[r]) for t in top(lps[r, i])]
            cands[r] += [c[:3] for c in kids]
            order = sorted(range(len(kids)), key=lambda j: (-kids[j][0], -kids[j][1], j))[:w]
            front[r] = [kids[j][:3] + (kids[j][3] | {d * w + i},) for i, j in enumerate(order)]
    best = [[c[2] for _, c in sorted(enumerate(cands[r]), key=lambda x: (-x[1][0], -x[1][1], x[0]))[:n]]
            for r in range(b)]
    return best, fronts


# ----------------------------------------------------------------------------------------- the toy drafter

B, V, W, P = 2, 7, 3, 211  # P: the toy's table of distributions, indexed by a hash of (row, path)


def path_hash(row, path):
    h = row + 1
    for t in path:
        h = (h * 31 + t + 1) % P
    return h


@pytest.mark.parametrize("score,k,n", [("product", 3, 12), ("min", 3, 12), ("product", 1, 3)])
def test_grow_tree_is_the_procedure(score, k, n):
    """Toy drafter: the distribution after a path is a random table's row at a hash of (row, path), so every child
    depends on its whole path; the frontiers' ancestor slots and the tree (paths, best first, structure) are the
    procedure's (K = 3 from 21 candidates; K = 1: the root's best W)."""
    assert candidate_count(W, k) >= n
    keys = jax.random.split(jax.random.key(0), 2)
    table = jax.nn.log_softmax(jax.random.normal(keys[0], (P, V)) * 2, axis=-1)
    root = jax.nn.log_softmax(jax.random.normal(keys[1], (B, V)) * 2, axis=-1)

    def expand(carry, front):  # carry: (paths [B, W, K] (-1 padded), the frontiers' visible [K - 1, B, W, M])
        prev, seen = carry
        p = jnp.take_along_axis(prev, jnp.maximum(front.parent, 0)[..., None], axis=1)
        p = jnp.where(front.parent[..., None] >= 0, p, -1)
        p = jnp.where(jnp.arange(k) == front.depth - 1, front.tokens[..., None], p)
        h = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None] + 1, (B, W))
        for j in range(k):
            h = jnp.where(p[..., j] >= 0, (h * 31 + p[..., j] + 1) % P, h)
        seen = jax.lax.dynamic_update_index_in_dim(seen, front.visible, front.depth - 1, 0)
        return table[h], (p, seen)

    carry = (jnp.full((B, W, k), -1, jnp.int32), jnp.zeros((k - 1, B, W, (k - 1) * W), bool))
    grow = jax.jit(lambda r, c: grow_tree(r, expand, c, n, k, W, score), compiler_options=FAST)
    tree, (_, seen) = grow(root, carry)
    tab = np.asarray(table)
    want, fronts = procedure(np.asarray(root), lambda ps: np.stack([[tab[path_hash(r, p)] for p in row]
                                                                    for r, row in enumerate(ps)]), n, k, W, score)
    seen = np.asarray(seen)
    for r in range(B):
        assert paths(tree, r) == want[r]
        for d, front in enumerate(fronts):
            for i, (_, slots) in enumerate(front[r]):
                assert set(np.flatnonzero(seen[d, r, i])) == slots
    assert int(tree.depth.max()) == k


# ----------------------------------------------------------------------------------------- the drafter

def tiny_target(model_type="llama", vocab=97, **kw):
    layer = LayerSpec(8, 2, RopeSpec(theta=10000.0))
    cfg = ModelConfig(model_type, vocab, 32, 64, 4, (layer,) * 3, rms_norm_eps=1e-5, **kw)
    return pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def qwen3():
    """A tiny qwen3 target (q / k norms) and a 2-layer EAGLE-3 head with a draft vocabulary (trees map ids through
    d2t) that feeds back its normed states."""
    target = tiny_target("qwen3", qk_norm=True)
    return target, make_eagle3(target, draft_vocab_size=48, norm_output=True, num_layers=2)


def test_sequential_tree_is_the_procedure_on_the_drafter(qwen3):
    """`sequential_tree` after a committed pass over ragged rows (every other cache slot holds stale K/V): the tree is
    the procedure's, with each path's distribution from the drafter's chain steps along it (each token at its position,
    fed its parent's state, K/V at its position); the committed slots and the inactive row's cache stay as they were."""
    target, drafter = qwen3
    k, n, cap, h = 3, 10, 32, drafter.config.hidden_size
    spec = pjax.decode.make_spec(target, drafter, pjax.decode.EngineConfig(
        drafting="sequential", num_speculative_tokens=k, tree_budget=n), max_new_tokens=4)
    w = beam_width(n, k, drafter.config.draft_vocab_size)
    lengths = np.array([5, 11, 3])
    b, root = len(lengths), jnp.asarray(lengths - 1, jnp.int32)
    rng = np.random.default_rng(0)
    forward = jax.jit(lambda c, tok, hid, valid: drafter_forward(drafter, tok, hid, jnp.broadcast_to(
        jnp.arange(cap, dtype=jnp.int32), (b, cap)), c, valid=valid), compiler_options=FAST)
    inputs = lambda: (jnp.asarray(rng.integers(0, 97, (b, cap)), jnp.int32),  # noqa: E731
                      jnp.asarray(rng.normal(size=(b, cap, h)), jnp.float32))
    _, _, stale = forward(init_drafter_cache(drafter, b, cap, jnp.float32), *inputs(), jnp.ones((b, cap), bool))
    normed, prenorm, cache = forward(stale, *inputs(), jnp.arange(cap)[None] < lengths[:, None])
    at_root = lambda x: x[jnp.arange(b), root]  # noqa: E731
    logits, fed = draft_logits_from_hidden(drafter, at_root(normed)), at_root(feedback(drafter, normed, prenorm))
    active = jnp.asarray([True, True, False])
    tree, after = jax.jit(sequential_tree, static_argnames=("spec",), compiler_options=FAST)(
        drafter, cache, logits, fed, root, active, spec=spec)

    @functools.partial(jax.jit, compiler_options=FAST)
    def chain(rows, tokens):  # the drafter's chain steps along paths: rows [R] (their batch rows), tokens [R, K - 1]
        def step(carry, i):
            c, f = carry
            pos = (root[rows] + 1 + i)[:, None]
            nm, pre, c = drafter_forward(drafter, tokens[:, i, None], f[:, None], pos, c)
            lp = jax.nn.log_softmax(draft_logits_from_hidden(drafter, nm[:, 0]))
            return (c, feedback(drafter, nm, pre)[:, 0]), lp
        (c, _), lp = jax.lax.scan(step, (jax.tree.map(lambda x: x[rows], cache), fed[rows]), jnp.arange(k - 1))
        return lp, c  # [K - 1, R, Vd], the K/V the steps wrote

    ids = np.asarray(draft_to_target(drafter, jnp.arange(drafter.config.draft_vocab_size)))
    kv = []  # per expansion, each frontier node's K/V at its position [L][B, W, ...]

    def child_lp(ps):
        d = len(ps[0][0])
        toks = np.zeros((b * w, k - 1), np.int32)
        for r, row in enumerate(ps):
            for i, p in enumerate(row):
                toks[r * w + i, :d] = ids[list(p)]
        lp, c = chain(jnp.repeat(jnp.arange(b), w), jnp.asarray(toks))
        at = np.repeat(lengths - 1 + d, w)
        kv.append([np.asarray(x)[np.arange(b * w), at].reshape((b, w) + x.shape[2:]) for x in jax.tree.leaves(c)])
        return np.asarray(lp)[d - 1].reshape(b, w, -1)
    want, fronts = procedure(np.asarray(jax.nn.log_softmax(logits)), child_lp, n, k, w, "product")
    for r in range(2):
        assert paths(tree, r) == [tuple(int(t) for t in ids[list(p)]) for p in want[r]]
        # each frontier node's K/V in its scratch slot: the chain's at its position (its token, position, parent)
        for d in range(1, k):
            for x, want_kv in zip(jax.tree.leaves(after), kv[d - 1]):
                np.testing.assert_allclose(np.asarray(x)[r, lengths[r] + (d - 1) * w:][:w], want_kv[r], atol=1e-5)
    assert len({p[:-1] for p, _ in fronts[1][0]}) > 1  # nodes of several parents expanded at depth 2
    assert int(tree.depth[:2].max()) == k
    for a, z in zip(jax.tree.leaves(cache), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(z)[2], np.asarray(a)[2])  # the inactive row
        for r in range(2):  # committed slots kept; the scratch past the root written
            np.testing.assert_array_equal(np.asarray(z)[r, :lengths[r]], np.asarray(a)[r, :lengths[r]])
            scratch = slice(lengths[r], lengths[r] + w)
            assert not np.array_equal(np.asarray(z)[r, scratch], np.asarray(a)[r, scratch])


GREEDY = [[3, 1, 4], [1, 5, 2, 6, 5, 3, 5, 0, 7], [2, 7, 1, 0]]  # ragged
SAMPLED = 1021  # with the greedy rows, 1024 device rows


def test_generate_greedy_and_sampled_rows_with_a_tree():
    """One batch through `pjax.generate` with an EAGLE-3 head (draft vocabulary of 6 of the 8 ids) and trees of
    N = 5 > K = 2 on a tiny qwen3: the ragged greedy rows emit plain greedy's tokens (each one the target's argmax
    after the ones before it: one forward over prompt and output), and 1021 rows of one prompt at temperature 1
    (seeds 0..1020) emit first two tokens (the prefill's, then the first tree round's) that follow the target's law
    (chi-square, as tests/test_distribution_engine.py)."""
    target = tiny_target("qwen3", vocab=SMALL_V, qk_norm=True)
    drafter = make_eagle3(target, draft_vocab_size=6, sharpen=3.0)
    g, new = len(GREEDY), 5
    res = pjax.generate(target, drafter, GREEDY + [PROMPT] * SAMPLED, max_new_tokens=[new] * g + [2] * SAMPLED,
                        temperature=[0.0] * g + [1.0] * SAMPLED, seed=[0] * g + list(range(SAMPLED)),
                        drafting="sequential", num_speculative_tokens=2, tree_budget=5, compiler_options=FAST)
    seqs = [p + t for p, t in zip(GREEDY, res.tokens[:g])]
    ids = np.zeros((g, max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    amax = np.asarray(jnp.argmax(pjax.models.target_logits(target, jnp.asarray(ids)), axis=-1))
    for i, p in enumerate(GREEDY):
        assert len(res.tokens[i]) == new and res.tokens[i] == amax[i, len(p) - 1:len(p) - 1 + new].tolist()
    toks = np.array(res.tokens[g:])
    counts = np.zeros((SMALL_V, SMALL_V), np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    assert chi_square_pvalue(counts, joint_law(target, 1.0, 0, 1.0)) > ALPHA
    assert res.stats["num_accepted_tokens"] > 0.05 * SAMPLED  # tree nodes were accepted, and rejected
    assert res.stats["acceptance_rates"][0] < 0.95
