"""Draft trees from per-position distributions, and their acceptance (pure functions, static shapes).

P-EAGLE drafts every depth in one drafter pass, so each depth d = 1..K comes with a full distribution p_d. A tree of
N nodes hangs under the root (the round's last committed token): node i carries a token, a parent (-1: the root) and
a depth; the nodes come in order of selection, so a parent always precedes its children. `build_tree` selects the N
best paths by a score of their per-depth probabilities (their product, or their minimum). EAGLE-3 drafts depth by
depth, each pass conditioned on the path so far: `grow_tree` builds EAGLE-2's dynamic tree (the drafter expands the
best W nodes of each depth in one pass, then the N best of every node generated form the tree). The target verifies
every node in one pass (each node attends to the committed cache and its ancestors); `accept_tree_greedy` walks the
longest path the target agrees with, and `accept_tree` accepts greedy and sampled rows alike (lossless: each emitted
token follows the target's law). Shapes: B rows, K depths, V vocabulary, N nodes (the budget), W frontier width.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from pjax.kernels import rng
from pjax.kernels.acceptance import reference as acc

__all__ = ["BEAM_WIDTH", "SCORES", "Frontier", "Tree", "TreeAccept", "accept_tree", "accept_tree_greedy", "beam_width",
           "build_tree", "candidate_count", "commit_path", "grow_tree", "path_count"]

FLOOR = -1e30  # log-probabilities are floored here (finite): a frontier slot with no node scores -inf, below any path


@dataclasses.dataclass
class Tree:
    """A draft tree per row. tokens [B, N] i32 (node i's token), parent [B, N] i32 (-1: a child of the root),
    depth [B, N] i32 (1..K), visible [B, N+1, N+1] bool: ancestor-or-self over (root, node 0..N-1), the root at
    index 0 (row i+1 = the slots node i attends to)."""
    tokens: Any
    parent: Any
    depth: Any
    visible: Any

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, n: int) -> "Tree":
        """The first n nodes, a tree itself (a parent precedes its children); of a best-first tree (`build_tree`,
        `grow_tree`), the tree of budget n up to exact ties."""
        return Tree(self.tokens[:, :n], self.parent[:, :n], self.depth[:, :n], self.visible[:, :n + 1, :n + 1])


jax.tree_util.register_dataclass(Tree, data_fields=["tokens", "parent", "depth", "visible"], meta_fields=[])


class TreeAccept(NamedTuple):
    num_accepted: jax.Array  # [B] i32 nodes on the accepted path (its depth)
    path: jax.Array  # [B, K] i32 node id at depth j + 1 of the accepted path, -1 past it
    tokens: jax.Array  # [B, K+1] i32 the path's tokens, then the bonus token, -1 padded
    next_token: jax.Array  # [B] i32 the bonus token = tokens[b, num_accepted[b]]


def path_count(depths: int, vocab: int, budget: int) -> int:
    """Distinct paths a tree of `budget` nodes can choose from (top-min(budget, vocab) tokens per depth): a budget
    above it cannot be filled."""
    m = min(budget, vocab)
    return sum(m ** d for d in range(1, depths + 1))


SCORES = ("product", "min")


def _best(score, logp, n: int):
    """Indices [B, n] of the n best entries of score, logp [B, C] (score first, then logp, then the lower index)."""
    idx = jnp.broadcast_to(jnp.arange(score.shape[1], dtype=jnp.int32), score.shape)
    return jax.lax.sort((-score, -logp, idx), dimension=1, num_keys=2, is_stable=True)[2][:, :n]


def build_tree(log_probs, budget: int, score: str = "product") -> Tree:
    """The `budget` best paths as a tree (tokens are vocabulary ids of `log_probs`).

    log_probs [B, K, V] f32: log p_d at each depth. A node is a tuple of ranks (r_1..r_d) into each depth's sorted
    distribution. score "product": the path's probability as if the depths were independent, sum_j log p_j(token
    of rank r_j); "min": its smallest per-depth probability, min_j p_j (the Frechet upper bound of the path's
    probability: P-EAGLE's depths are drafted from one context, so their errors are correlated and the product
    undervalues deep paths); ties by the product, then by depth and rank. A child never scores above its parent, so
    the N best nodes form a tree, and the N best of a depth are among the children of the N best of the depth above:
    a beam of N per depth (K sorts of N x min(N, V) candidates), then the N best of the K beams. Static shapes, a
    few operations per depth (a GPU runs them as a handful of kernels, not one per node). Needs budget <=
    `path_count(K, V, budget)`.
    """
    if score not in SCORES:
        raise ValueError(f"tree score {score!r}: expected one of {SCORES}")
    join = jnp.add if score == "product" else jnp.minimum
    b, k, v = log_probs.shape
    n = int(budget)
    m = min(n, v)
    lp, ids = jax.lax.top_k(log_probs.astype(jnp.float32), m)  # [B, K, M] sorted, ties -> lower id first
    lp = jnp.maximum(lp, FLOOR)
    # beams: per depth, the kept nodes' score, logp, token, and parent (index into the previous depth's beam)
    sc, lg, tok, par = [lp[:, 0]], [lp[:, 0]], [ids[:, 0]], [jnp.full((b, m), -1, jnp.int32)]
    for d in range(1, k):
        w = sc[-1].shape[1]
        cs = join(sc[-1][:, :, None], lp[:, d, None, :]).reshape(b, w * m)  # [B, W * M] children of the beam
        cl = (lg[-1][:, :, None] + lp[:, d, None, :]).reshape(b, w * m)
        keep = _best(cs, cl, min(n, w * m))
        pick = lambda x: jnp.take_along_axis(x, keep, axis=1)  # noqa: E731
        sc.append(pick(cs))
        lg.append(pick(cl))
        tok.append(jnp.take_along_axis(ids[:, d], keep % m, axis=1))
        par.append(keep // m)
    widths = [x.shape[1] for x in sc]
    offsets = [sum(widths[:d]) for d in range(k)]
    depth_of = jnp.asarray([d + 1 for d in range(k) for _ in range(widths[d])], jnp.int32)
    parent_of = jnp.concatenate([par[0]] + [par[d] + offsets[d - 1] for d in range(1, k)], axis=1)  # global ids
    sel = _best(jnp.concatenate(sc, axis=1), jnp.concatenate(lg, axis=1), n)  # [B, N] global ids, best first
    return _selected(sel, jnp.concatenate(tok, axis=1), parent_of, depth_of, k)


def _selected(sel, tokens, parent, depth, depths: int) -> Tree:
    """The tree of the candidates `sel` [B, N] (best first, every one's parent before it) out of C: tokens [B, C],
    parent [B, C] i32 (a candidate id, -1: the root), depth [C] i32; depths: K, the deepest a candidate can be."""
    b, n = sel.shape
    rows = jnp.arange(b)[:, None]
    slot = jnp.full(tokens.shape, -1, jnp.int32).at[rows, sel].set(jnp.arange(n, dtype=jnp.int32))
    gpar = jnp.take_along_axis(parent, sel, axis=1)
    node_parent = jnp.where(gpar >= 0, jnp.take_along_axis(slot, jnp.maximum(gpar, 0), axis=1), -1)
    # ancestor-or-self by walking up at most K - 1 parents
    node = jnp.arange(n, dtype=jnp.int32)
    anc = jnp.broadcast_to(node[None, :, None] == node[None, None, :], (b, n, n))
    cur = node_parent
    for _ in range(depths - 1):
        anc |= (cur[:, :, None] == node[None, None, :])
        cur = jnp.where(cur >= 0, jnp.take_along_axis(node_parent, jnp.maximum(cur, 0), axis=1), -1)
    top = jnp.zeros((b, 1, n + 1), bool).at[:, 0, 0].set(True)
    below = jnp.concatenate([jnp.ones((b, n, 1), bool), anc], axis=2)
    return Tree(jnp.take_along_axis(tokens, sel, axis=1).astype(jnp.int32), node_parent.astype(jnp.int32),
                depth[sel], jnp.concatenate([top, below], axis=1))


BEAM_WIDTH = 8  # `grow_tree`'s frontier: the nodes expanded at each depth


def beam_width(budget: int, depths: int, vocab: Optional[int] = None) -> int:
    """The frontier width W of `grow_tree` for N = budget nodes of depth <= K = depths: N for K = 1, else
    min(N, BEAM_WIDTH), widened until its W + (K - 1) W^2 candidates can fill N nodes; at most `vocab` (a node's
    children are its W likeliest tokens)."""
    n, k = int(budget), int(depths)
    w = n if k == 1 else min(n, BEAM_WIDTH)
    while w + (k - 1) * w * w < n:
        w += 1
    return w if vocab is None else min(w, int(vocab))


def candidate_count(width: int, depths: int) -> int:
    """Nodes `grow_tree` generates with frontier width W and K depths, the most it can keep: W + (K - 1) W^2."""
    return width + (depths - 1) * width * width


class Frontier(NamedTuple):
    """The W nodes of depth d a `grow_tree` step expands. Frontier node i of depth j has the frontier slot
    (j - 1) W + i, one of (K - 1) W (depths 1..K-1), so a drafter can give each frontier node its own scratch K/V."""
    tokens: jax.Array  # [B, W] i32 token ids (the log-probabilities' vocabulary)
    parent: jax.Array  # [B, W] i32 each node's parent in the previous frontier (-1: the root, d = 1)
    visible: jax.Array  # [B, W, (K-1) W] bool the frontier slots of each node's ancestors-or-self
    depth: jax.Array  # [] i32 d, 1..K-1


def grow_tree(log_probs, expand, carry, budget: int, depths: int, width: int, score: str = "product"):
    """EAGLE-2's dynamic tree: the drafter runs once per depth on the best W nodes so far, each conditioned on its path.

    log_probs [B, V] f32: log p at depth 1 (the root's distribution). expand(carry, frontier) -> (log_probs
    [B, W, V], carry): the distributions after each of the W `Frontier` nodes (depth d = 1..K-1), each given its
    own path (e.g. one drafter pass over the W tokens feeding back the parents' states, each attending to its
    ancestors' frontier slots). The procedure: depth 1's candidates are the root's W likeliest tokens, and all of
    them are the first frontier; at each depth d + 1 = 2..K every frontier node proposes its W likeliest children
    (W^2 candidates), and the W best candidates by path score become the next frontier. Then the N = budget best of
    all W + (K - 1) W^2 candidates are the tree, best first (ties by the product, then generation order: a parent
    before its children). Path score: "product", the sum of the log-probabilities along the path (EAGLE-2's), or
    "min", their minimum (`build_tree`). A child never scores above its parent, so the N best form a tree. Static
    shapes; the K - 1 expansions run in one `lax.scan`. Needs W <= V and N <= `candidate_count(W, K)`.
    Returns (the `Tree`, tokens as vocabulary ids of `log_probs`; carry)."""
    if score not in SCORES:
        raise ValueError(f"tree score {score!r}: expected one of {SCORES}")
    join = jnp.add if score == "product" else jnp.minimum
    b = log_probs.shape[0]
    k, n, w = int(depths), int(budget), int(width)
    if n > candidate_count(w, k):
        raise ValueError(f"grow_tree: budget={n} exceeds the {candidate_count(w, k)} candidates of width {w} and "
                         f"{k} depths")
    m = (k - 1) * w
    lane = jnp.arange(w, dtype=jnp.int32)
    own = lambda d: jnp.broadcast_to((d - 1) * w + lane[:, None] == jnp.arange(m)[None], (b, w, m))  # noqa: E731
    lp, ids = jax.lax.top_k(log_probs.astype(jnp.float32), w)  # [B, W] sorted, ties -> lower id first
    lp = jnp.maximum(lp, FLOOR)
    rows = jnp.broadcast_to(lane, (b, w))
    first = Frontier(ids.astype(jnp.int32), jnp.full((b, w), -1, jnp.int32), own(1), jnp.int32(1))

    def step(state, d):  # expands the frontier of depth d into the candidates of depth d + 1
        front, sc, lg, gid, carry = state
        clp, carry = expand(carry, front)
        clp, cid = jax.lax.top_k(clp.astype(jnp.float32), w)  # [B, W, W]
        clp = jnp.maximum(clp, FLOOR)
        cs = join(sc[:, :, None], clp).reshape(b, w * w)
        cl = (lg[:, :, None] + clp).reshape(b, w * w)
        ctok = cid.reshape(b, w * w).astype(jnp.int32)
        keep = _best(cs, cl, w)  # [B, W] the next frontier, best first
        pick = lambda x: jnp.take_along_axis(x, keep, axis=1)  # noqa: E731
        f = keep // w
        vis = jnp.take_along_axis(front.visible, f[..., None], axis=1) | own(d + 1)
        nxt = Frontier(pick(ctok), f, vis, d + 1)
        base = w + (d - 1) * w * w  # the candidate id of depth d + 1's first
        return (nxt, pick(cs), pick(cl), base + keep, carry), (cs, cl, ctok, jnp.repeat(gid, w, axis=1))

    sc, lg, tok, par = [lp], [lp], [ids.astype(jnp.int32)], [jnp.full((b, w), -1, jnp.int32)]
    if k > 1:
        state = (first, lp, lp, rows, carry)
        (*_, carry), outs = jax.lax.scan(step, state, jnp.arange(1, k, dtype=jnp.int32))
        for parts, x in zip((sc, lg, tok, par), outs):  # [K-1, B, W^2] -> [B, (K-1) W^2]
            parts.append(jnp.moveaxis(x, 0, 1).reshape(b, m * w))
    depth_of = jnp.asarray([1] * w + [d for d in range(2, k + 1) for _ in range(w * w)], jnp.int32)
    sel = _best(jnp.concatenate(sc, axis=1), jnp.concatenate(lg, axis=1), n)
    return _selected(sel, jnp.concatenate(tok, axis=1), jnp.concatenate(par, axis=1), depth_of, k), carry


def _walk(tree: Tree, depths: int, wins):
    """The accepted path from the nodes that win at their parent. wins [B, N] bool: node i is the child its parent
    moves to (at most one per node). A node is accepted iff it and every ancestor win; the deepest accepted node ends
    the path. Returns (num_accepted [B] i32, path [B, K] i32 (-1 past it), stop [B] i32: the slot of the path's end
    in the target's [root, node 0..N-1] (0: the root))."""
    b = tree.tokens.shape[0]
    anc = tree.visible[:, 1:, 1:]
    accepted = ~jnp.any(anc & ~wins[:, None, :], axis=-1)  # every ancestor-or-self wins
    reached = jnp.where(accepted, tree.depth, 0)
    num = jnp.max(reached, axis=1).astype(jnp.int32)
    deepest = jnp.argmax(reached, axis=1).astype(jnp.int32)
    on_path = anc[jnp.arange(b), deepest] & (num > 0)[:, None]  # [B, N]
    j = jnp.arange(depths, dtype=jnp.int32)[None]
    at = on_path[:, None, :] & (tree.depth[:, None, :] == j[..., None] + 1)  # [B, K, N]
    path = jnp.where(j < num[:, None], jnp.argmax(at, axis=-1), -1).astype(jnp.int32)
    return num, path, jnp.where(num > 0, deepest + 1, 0)


def _result(tree: Tree, num, path, next_token) -> TreeAccept:
    b, k = path.shape
    toks = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    j1 = jnp.arange(k + 1, dtype=jnp.int32)[None]
    toks = jnp.concatenate([toks, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j1 < num[:, None], toks, jnp.where(j1 == num[:, None], next_token[:, None], -1))
    return TreeAccept(num, path, tokens.astype(jnp.int32), next_token.astype(jnp.int32))


def _valid(tree: Tree, num_nodes):
    n = tree.size
    if num_nodes is None:
        return jnp.ones(tree.tokens.shape, bool)
    return jnp.arange(n, dtype=jnp.int32)[None] < num_nodes[:, None]


def accept_tree_greedy(target_logits, tree: Tree, depths: int, num_nodes=None) -> TreeAccept:
    """Greedy acceptance of a tree: node i is accepted iff its parent is (the root always is) and its token is the
    target's argmax (ties -> lowest id) at its parent; the deepest accepted node ends the path (siblings hold
    distinct tokens, so at most one child of a node is accepted), and the target's argmax there is the bonus token.
    A chain tree gives the chain's greedy acceptance.

    target_logits [B, N+1, V]: the target at (root, node 0..N-1); depths: K, the deepest a node can be (static);
    num_nodes [B] i32 or None (= N): nodes i >= num_nodes[b] are never accepted.
    """
    b = tree.tokens.shape[0]
    amax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N+1]
    wins = _valid(tree, num_nodes) & (tree.tokens == jnp.take_along_axis(amax, tree.parent + 1, axis=1))
    num, path, stop = _walk(tree, depths, wins)
    return _result(tree, num, path, amax[jnp.arange(b), stop])


def accept_tree(target_logits, tree: Tree, depths: int, *, temperature, seeds, positions, top_k=None, top_p=None,
                num_nodes=None) -> TreeAccept:
    """Lossless acceptance of a tree for greedy and sampled rows in one call: every emitted token follows the
    target's law of its row (temperature, then top-k, then top-p: `pjax.kernels.acceptance.reference`).

    target_logits [B, N+1, V]: the target at (root, node 0..N-1); depths: K (static); temperature [B] f32 (<= 0: a
    greedy row, which gets `accept_tree_greedy`'s result); seeds [B] u32; positions [B] i32: the absolute position
    of the first token the round emits (the root's + 1); top_k [B] i32 (0 = off) or None; top_p [B] f32 (1 = off)
    or None; num_nodes [B] i32 or None (= N): nodes i >= num_nodes[b] are no candidates.

    The rule (recursive rejection sampling with deterministic drafts, SpecInfer's multi-candidate rule with q one-hot).
    Walk from the root; at node u, with p the row's law at u and x_1..x_m the tokens of u's children in tree order
    (distinct), S_j = p(x_1) + .. + p(x_j) (S_0 = 0): child j is accepted iff the ones before it were not and
    u_j (1 - S_{j-1}) < p(x_j), u_j uniform in (0, 1). An accepted child becomes u and the walk goes on; if every
    child is rejected (or u has none), the next token is drawn from p restricted to the tokens other than
    x_1..x_m (the exponential race over them) and the round ends.
    Proof that the token emitted at u has law p: child j is tested with probability
    prod_{i<j} (1 - p(x_i) / (1 - S_{i-1})) = prod_{i<j} (1 - S_i) / (1 - S_{i-1}) = 1 - S_{j-1}, so x_j is emitted
    with probability (1 - S_{j-1}) p(x_j) / (1 - S_{j-1}) = p(x_j); every child is rejected with probability 1 - S_m,
    and then a token y outside the candidates is drawn with probability p(y) / (1 - S_m): p(y) in all. Each decision
    uses fresh randomness (below) and the walk continues from the emitted token's node with the target's law given
    that token, so the emitted sequence follows the target's law token by token. This is the chain's rule when every
    node has one child (and then gives the chain's tokens bit for bit).
    Randomness: u_j = uniform(seed, position of the token decided, j, STREAM_ACCEPT) and the race's noise keyed on
    (seed, position, lane) as the chain's (`pjax.kernels.rng`): nothing depends on the batch or the row's slot, and
    every (position, j) is used by at most one decision on the walk.
    Vectorised: every node's test is computed at once (its parent's law, its earlier siblings' mass), and the path
    is the nodes whose ancestors-or-self all win (`accept_tree_greedy`'s walk); one vocabulary pass draws the next
    token at the path's end.
    """
    b, n = tree.tokens.shape
    rows = jnp.arange(b)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions, jnp.int32)
    greedy, inv_t = acc.inverse_temperature(temperature)
    thr = acc.truncation_threshold(acc.scaled(target_logits, inv_t), top_k, top_p)
    amax, m, z = acc.position_stats(target_logits, inv_t, thr)  # [B, N+1] each
    valid = _valid(tree, num_nodes)
    slot = tree.parent + 1  # [B, N] where node i is decided: its parent's slot
    x_tok = target_logits[rows[:, None], slot, tree.tokens].astype(jnp.float32) * inv_t[:, None]
    at = lambda s: jnp.take_along_axis(s, slot, axis=1)  # noqa: E731
    p_tok = acc.kept_prob(x_tok, at(thr), at(m), at(z))  # [B, N] p_parent(token)
    i = jnp.arange(n, dtype=jnp.int32)
    before = ((tree.parent[:, :, None] == tree.parent[:, None, :]) & (i[None, None, :] < i[None, :, None])
              & valid[:, None, :])  # [B, N, N]: node j is a valid sibling before node i
    rank = jnp.sum(before, axis=-1, dtype=jnp.int32)
    left = jnp.maximum(1.0 - jnp.sum(jnp.where(before, p_tok[:, None, :], 0.0), axis=-1), 0.0)  # 1 - S_{j-1}
    u = rng.uniform(seeds[:, None], positions[:, None] + tree.depth - 1, rank, rng.STREAM_ACCEPT)
    passed = valid & (u * left < p_tok)
    first = passed & ~jnp.any(before & passed[:, None, :], axis=-1)
    wins = jnp.where(greedy[:, None], valid & (tree.tokens == at(amax)), first)
    num, path, stop = _walk(tree, depths, wins)
    v = target_logits.shape[-1]
    tested = valid & (tree.parent == stop[:, None] - 1)  # the children of the path's end
    allowed = jnp.ones((b, v), bool).at[rows[:, None], jnp.where(tested, tree.tokens, v)].set(False, mode="drop")
    x = acc.gather_rows(target_logits, stop).astype(jnp.float32) * inv_t[:, None]
    keep = x >= acc.gather_rows(thr, stop)[:, None]
    drawn = acc.sample_lanes(x, keep & allowed, seeds, positions + num)
    return _result(tree, num, path, jnp.where(greedy, amax[rows, stop], drawn))


def commit_path(cache, start, path, num_accepted):
    """The accepted path's K/V into chain form: every [B, S, ...] leaf of `cache` (e.g. a list of `LayerKV`) gets
    the entries at slots start + 1 + path[b, j] moved to start + 1 + j for j < num_accepted[b] (all read before any
    is written; path[j] >= j, so the moves never read a slot already moved). start [B] i32 the root's slot (the
    tree's first); path [B, K] i32 (-1 past the path); num_accepted [B] i32."""
    b, k = path.shape
    j = jnp.arange(k, dtype=jnp.int32)[None]
    src = start[:, None] + 1 + jnp.maximum(path, 0)
    rows = jnp.arange(b)[:, None]

    def move(x):
        dst = jnp.where(j < num_accepted[:, None], start[:, None] + 1 + j, x.shape[1])  # past the cache: dropped
        return x.at[rows, dst].set(x[rows, jnp.minimum(src, x.shape[1] - 1)], mode="drop")
    return jax.tree.map(move, cache)
