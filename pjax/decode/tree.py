"""Draft trees from per-position distributions, and their greedy acceptance (pure functions, static shapes).

P-EAGLE drafts every depth in one drafter pass, so each depth d = 1..K comes with a full distribution p_d. A tree of
N nodes hangs under the root (the round's last committed token): node i carries a token, a parent (-1: the root) and
a depth; the nodes come in order of selection, so a parent always precedes its children. `build_tree` selects the N
best paths by a score of their per-depth probabilities (their product, or their minimum); the target verifies every
node in one pass (each node attends to the committed cache and its ancestors) and `accept_tree_greedy` walks the
longest path the target agrees with. Shapes: B rows, K depths, V vocabulary, N nodes (the budget).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["SCORES", "Tree", "TreeAccept", "accept_tree_greedy", "build_tree", "commit_path", "path_count"]

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
    rows = jnp.arange(b)[:, None]
    slot = jnp.full((b, parent_of.shape[1]), -1, jnp.int32).at[rows, sel].set(jnp.arange(n, dtype=jnp.int32))
    gpar = jnp.take_along_axis(parent_of, sel, axis=1)
    parent = jnp.where(gpar >= 0, jnp.take_along_axis(slot, jnp.maximum(gpar, 0), axis=1), -1)
    # ancestor-or-self by walking up at most K - 1 parents
    node = jnp.arange(n, dtype=jnp.int32)
    anc = node[None, :, None] == node[None, None, :]
    cur = parent
    for _ in range(k - 1):
        anc |= (cur[:, :, None] == node[None, None, :])
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parent, jnp.maximum(cur, 0), axis=1), -1)
    top = jnp.zeros((b, 1, n + 1), bool).at[:, 0, 0].set(True)
    below = jnp.concatenate([jnp.ones((b, n, 1), bool), anc], axis=2)
    return Tree(jnp.take_along_axis(jnp.concatenate(tok, axis=1), sel, axis=1).astype(jnp.int32),
                parent.astype(jnp.int32), depth_of[sel], jnp.concatenate([top, below], axis=1))


def accept_tree_greedy(target_logits, tree: Tree, depths: int, num_nodes=None) -> TreeAccept:
    """Greedy acceptance of a tree: node i is accepted iff its parent is (the root always is) and its token is the
    target's argmax (ties -> lowest id) at its parent; the deepest accepted node ends the path (siblings hold
    distinct tokens, so at most one child of a node is accepted), and the target's argmax there is the bonus token.
    A chain tree gives the chain's greedy acceptance.

    target_logits [B, N+1, V]: the target at (root, node 0..N-1); depths: K, the deepest a node can be (static);
    num_nodes [B] i32 or None (= N): nodes i >= num_nodes[b] are never accepted.
    """
    b, n = tree.tokens.shape
    amax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N+1]
    ok = tree.tokens == jnp.take_along_axis(amax, tree.parent + 1, axis=1)
    if num_nodes is not None:
        ok &= jnp.arange(n, dtype=jnp.int32)[None] < num_nodes[:, None]
    anc = tree.visible[:, 1:, 1:]
    accepted = ~jnp.any(anc & ~ok[:, None, :], axis=-1)  # every ancestor-or-self agrees
    reached = jnp.where(accepted, tree.depth, 0)
    num = jnp.max(reached, axis=1).astype(jnp.int32)
    deepest = jnp.argmax(reached, axis=1)
    on_path = anc[jnp.arange(b), deepest] & (num > 0)[:, None]  # [B, N]
    j = jnp.arange(depths, dtype=jnp.int32)[None]
    at = on_path[:, None, :] & (tree.depth[:, None, :] == j[..., None] + 1)  # [B, K, N]
    path = jnp.where(j < num[:, None], jnp.argmax(at, axis=-1), -1).astype(jnp.int32)
    bonus = amax[jnp.arange(b), jnp.where(num > 0, deepest + 1, 0)]
    toks = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    j1 = jnp.arange(depths + 1, dtype=jnp.int32)[None]
    toks = jnp.concatenate([toks, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j1 < num[:, None], toks, jnp.where(j1 == num[:, None], bonus[:, None], -1))
    return TreeAccept(num, path, tokens.astype(jnp.int32), bonus)


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
