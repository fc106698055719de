"""Draft trees: `build_tree` is the exact best-N by path probability (brute force over every token path of a tiny
vocabulary), `accept_tree_greedy` equals a step-by-step walk of the tree and, on a chain, the chain's greedy
acceptance; cache attention under a tree mask equals a brute-force masked attention and, for a chain, the position
rule; greedy decoding with a tree (P-EAGLE's, and EAGLE-3's grown depth by depth) equals plain greedy decoding token
for token."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.decode.tree import Tree, accept_tree_greedy, build_tree
from pjax.kernels.acceptance.reference import accept as chain_accept
from tests.engine_utils import FAST, make_drafter, make_eagle3, round_programs, tiny_llama

B, K, V, N = 3, 3, 4, 10

build = jax.jit(build_tree, static_argnames=("budget", "score"), compiler_options=FAST)
accept = jax.jit(accept_tree_greedy, static_argnames=("depths",), compiler_options=FAST)


def chain(tokens):
    """The chain tree of tokens [B, K]: node i at depth i + 1, a child of node i - 1."""
    b, k = tokens.shape
    vis = np.tril(np.ones((k + 1, k + 1), bool))
    return Tree(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(-1, k - 1, dtype=jnp.int32), (b, k)),
                jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), (b, k)),
                jnp.broadcast_to(jnp.asarray(vis), (b, k + 1, k + 1)))


def paths(tree: Tree, b: int):
    """Row b's nodes as token paths from the root (and checks of the tree's structure)."""
    tok, par, dep, vis = (np.asarray(x[b]) for x in (tree.tokens, tree.parent, tree.depth, tree.visible))
    out = []
    for i in range(len(tok)):
        p = par[i]
        assert p < i  # a parent precedes its children
        assert dep[i] == (1 if p < 0 else dep[p] + 1)
        out.append((out[p] if p >= 0 else ()) + (int(tok[i]),))
    for i, seq in enumerate(out):
        anc = {j for j, s in enumerate(out) if s == seq[:len(s)]}
        assert set(np.flatnonzero(vis[i + 1, 1:])) == anc and vis[i + 1, 0]
    assert vis[0, 0] and not vis[0, 1:].any()
    return out


@pytest.mark.parametrize("score", ["product", "min"])
def test_build_tree_is_exact_best_n(score):
    """Best-N by the product of the per-depth probabilities, or by their minimum (ties by the product)."""
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (B, K, V)) * 2, axis=-1)
    tree = build(lp, budget=N, score=score)
    lpn = np.asarray(lp, np.float32)
    for b in range(B):
        got = paths(tree, b)
        assert len(set(got)) == N
        every = [seq for d in range(1, K + 1) for seq in itertools.product(range(V), repeat=d)]
        logp = {seq: np.float32(sum(lpn[b, j, t] for j, t in enumerate(seq))) for seq in every}
        key = {seq: (logp[seq],) if score == "product" else (min(lpn[b, j, t] for j, t in enumerate(seq)), logp[seq])
               for seq in every}
        best = sorted(every, key=lambda s: tuple(-x for x in key[s]))[:N]
        assert set(got) == set(best)
        assert [key[s] for s in got] == sorted(key[s] for s in got)[::-1]  # best first
    if score == "min":  # the two rules differ on this input: min keeps deeper paths
        assert tree.depth.sum() > build(lp, budget=N, score="product").depth.sum()


def walk(amax, tree: Tree, b: int, n_valid: int):
    """Row b's accepted path by a step-by-step walk from the root."""
    tok, par = np.asarray(tree.tokens[b]), np.asarray(tree.parent[b])
    path, cur = [], -1
    while True:
        nxt = [i for i in range(n_valid) if par[i] == cur and tok[i] == amax[b, cur + 1]]
        if not nxt:
            return path, int(amax[b, cur + 1])
        cur = nxt[0]
        path.append(cur)


def test_accept_tree_greedy_walks_the_tree():
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (B, K, V)), axis=-1)
    tree = build(lp, budget=N)
    rng = np.random.default_rng(0)
    tok = np.asarray(tree.tokens)
    for trial in range(6):  # target argmaxes that follow a random branch, then stop at a random node
        amax = rng.integers(0, V, (B, N + 1))
        for b in range(B):
            cur = -1
            for _ in range(trial % (K + 1)):
                kids = [i for i in range(N) if tree.parent[b, i] == cur]
                if not kids:
                    break
                c = kids[rng.integers(len(kids))]
                amax[b, cur + 1] = tok[b, c]
                cur = c
        logits = jax.nn.one_hot(amax, V) + 0.01 * jax.random.normal(jax.random.key(trial), (B, N + 1, V))
        num_nodes = np.array([N, 4, 0 if trial % 2 else N])
        res = accept(logits, tree, depths=K, num_nodes=jnp.asarray(num_nodes, jnp.int32))
        for b in range(B):
            path, bonus = walk(amax, tree, b, num_nodes[b])
            n = len(path)
            assert int(res.num_accepted[b]) == n
            assert list(res.path[b]) == path + [-1] * (K - n)
            assert list(res.tokens[b]) == [int(tok[b, i]) for i in path] + [bonus] + [-1] * (K - n)
            assert int(res.next_token[b]) == bonus


def test_chain_tree_is_chain_acceptance():
    rng = np.random.default_rng(2)
    logits = jax.random.normal(jax.random.key(2), (4, K + 1, V))
    amax = np.asarray(jnp.argmax(logits, -1))
    drafts = np.where(rng.random((4, K)) < 0.7, amax[:, :K], rng.integers(0, V, (4, K)))
    num = jnp.asarray([K, K, 1, 0], jnp.int32)
    want = jax.jit(chain_accept, compiler_options=FAST)(logits, jnp.asarray(drafts), temperature=jnp.zeros(4), seeds=jnp.zeros(4, jnp.uint32),
                        positions=jnp.zeros(4, jnp.int32), num_drafts=num)
    got = accept(logits, chain(drafts), depths=K, num_nodes=num)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.next_token, want.next_token)


def brute_attention(q, k, v, q_pos, start, vis, window, sinks, kv_len, scale):
    """numpy: each query over the keys it sees, listed one by one (committed slots by position, tree slots by the
    ancestor mask, the window on every key's position)."""
    b, t, nh, hd = q.shape
    s, nkv = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    for r in range(b):
        for i in range(t):
            keys = []
            for slot in range(min(s, kv_len[r])):
                j = slot - start[r]
                if j < 0:
                    pos, seen = slot, slot <= q_pos[r, i]
                elif j < t:
                    pos, seen = q_pos[r, j], vis[r, i, j]
                else:
                    continue
                if seen and (window is None or pos > q_pos[r, i] - window):
                    keys.append(slot)
            for h in range(nh):
                kh = h // (nh // nkv)
                sc = np.array([q[r, i, h] @ k[r, sl, kh] for sl in keys]) * scale
                m = max(sc.max(initial=-np.inf), sinks[h])
                e = np.exp(sc - m)
                out[r, i, h] = (e @ v[r, keys, kh] if keys else 0) / (e.sum() + np.exp(sinks[h] - m))
    return out


@pytest.mark.parametrize("window", [None, 2])
def test_cache_attention_tree_mask(window):
    from pjax.kernels.cache_attention import TreeMask, cache_attention
    attend = jax.jit(cache_attention, static_argnames=("scale", "window", "implementation"), compiler_options=FAST)
    b, s, nh, nkv, hd = 2, 16, 4, 2, 8
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (b, 5, nh, hd))
    k, v = (jax.random.normal(x, (b, s, nkv, hd)) for x in ks[1:3])
    sinks = jax.random.normal(ks[3], (nh,))
    start = np.array([5, 9])
    parent = np.array([[-1, -1, 0, 2], [-1, 0, 1, 0]])  # root + 4 nodes
    depth = np.zeros((b, 4), int)
    vis = np.zeros((b, 5, 5), bool)
    vis[:, :, 0] = True
    for r in range(b):
        for i in range(4):
            p = parent[r, i]
            depth[r, i] = 1 if p < 0 else depth[r, p] + 1
            vis[r, i + 1] = vis[r, p + 1] if p >= 0 else vis[r, 0]
            vis[r, i + 1, i + 1] = True
    q_pos = np.concatenate([start[:, None], start[:, None] + depth], axis=1)
    kv_len = np.array([s, 12])
    got = attend(q, k, v, jnp.asarray(q_pos, jnp.int32), scale=0.3, window=window, sinks=sinks,
                 kv_len=jnp.asarray(kv_len, jnp.int32), tree=TreeMask(jnp.asarray(start, jnp.int32), jnp.asarray(vis)))
    want = brute_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), q_pos, start, vis, window,
                           np.asarray(sinks, np.float64), kv_len, 0.3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # a chain (lower-triangular mask, positions = slots) is the position rule of tree=None
    chain_pos = jnp.asarray(start[:, None] + np.arange(5), jnp.int32)
    tri = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (b, 5, 5))
    kw = dict(scale=0.3, window=window, sinks=sinks, kv_len=jnp.asarray(kv_len, jnp.int32))
    np.testing.assert_allclose(attend(q, k, v, chain_pos, tree=TreeMask(jnp.asarray(start, jnp.int32), tri), **kw),
                               attend(q, k, v, chain_pos, **kw), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- decoding

DK, NEW = 3, 12
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 33, 8, 90, 12, 4], [30, 31, 32, 33, 34, 35]]  # ragged


@pytest.fixture(scope="module")
def pair():
    """A tiny llama target and a random P-EAGLE head with a draft vocabulary (trees map ids through d2t) and a
    confident lm_head (peaked distributions: trees several levels deep)."""
    target = tiny_llama(97)
    d = make_drafter(target, draft_vocab_size=48)
    return target, dataclasses.replace(d, params={**d.params, "lm_head": {"kernel": d.params["lm_head"]["kernel"] * 6}})


@pytest.fixture(scope="module")
def heads(pair):
    """The head of each drafting mode: `pair`'s P-EAGLE head, and an EAGLE-3 head with the same draft vocabulary."""
    target, drafter = pair
    return {"parallel": drafter, "sequential": make_eagle3(target, draft_vocab_size=48)}


@pytest.fixture(scope="module")
def chain_run(pair):
    """Chain decoding of PROMPTS: plain greedy's tokens (tests/test_engine_greedy.py holds the chain to them)."""
    return pjax.generate(*pair, PROMPTS, max_new_tokens=NEW + DK, drafting="parallel", num_speculative_tokens=DK,
                         compiler_options=FAST)


@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_tree_rounds_commit_the_accepted_path(pair, heads, chain_run, drafting):
    """Rounds driven with injected trees (the engine's own tree shape, the true continuation placed along the path
    to a chosen node, every other node wrong): the accepted count is that node's depth, the output is plain greedy's,
    and before each round the engine's tree equals the tree a fresh prefill over everything accepted so far drafts
    (so the accepted path's K/V, features and tokens were committed in chain form, and a sequential tree's scratch
    K/V from earlier rounds is never read)."""
    target, drafter = pair[0], heads[drafting]
    ref = chain_run.tokens
    n_tree, cap, lp, new = 8, 64, 48, NEW
    spec = pjax.decode.make_spec(target, drafter, pjax.decode.EngineConfig(
        drafting=drafting, num_speculative_tokens=DK, tree_budget=n_tree), max_new_tokens=new)
    b = len(PROMPTS)
    samp, run_prefill, round_ = round_programs(target, drafter, spec, b, lp, cap)

    state = run_prefill(PROMPTS)
    rng = np.random.default_rng(0)
    seen, r = set(), 0
    while not np.asarray(state.done).all():
        live, num_out = ~np.asarray(state.done), np.asarray(state.num_out)
        fresh = run_prefill([PROMPTS[i] + ref[i][:num_out[i] - 1] for i in range(b)])
        for f in ("tokens", "parent", "depth", "visible"):
            np.testing.assert_array_equal(np.asarray(getattr(state.tree, f))[live],
                                          np.asarray(getattr(fresh.tree, f))[live])
        tok = np.array(state.tree.tokens)
        dep, vis = np.asarray(state.tree.depth), np.asarray(state.tree.visible)
        want = np.zeros(b, int)
        for i in range(b):
            truth = ref[i][num_out[i]:num_out[i] + DK]
            at = np.flatnonzero(dep[i] == (r + i) % (DK + 1))  # a path of each depth in turn (0: none accepted)
            chosen = int(rng.choice(at)) if len(at) else -1 if (r + i) % (DK + 1) == 0 else int(np.argmax(dep[i]))
            on = set(np.flatnonzero(vis[i, chosen + 1, 1:])) if chosen >= 0 else set()
            for j in range(n_tree):
                t = truth[dep[i, j] - 1]
                tok[i, j] = t if j in on else (t + 1 + rng.integers(0, 96)) % 97
            want[i] = dep[i, chosen] if chosen >= 0 else 0
        before = np.asarray(state.accepted)
        state = round_(target, drafter, dataclasses.replace(
            state, tree=dataclasses.replace(state.tree, tokens=jnp.asarray(tok))), samp, spec=spec)
        got = np.asarray(state.accepted) - before
        np.testing.assert_array_equal(got[live], want[live])
        seen.update(got[live].tolist())
        r += 1
    out = np.asarray(state.out)
    assert [out[i, :new].tolist() for i in range(b)] == [r[:new] for r in ref]
    assert seen == set(range(DK + 1))


# trees ranked by their weakest depth through generate with --full (built exactly: test_build_tree_is_exact_best_n)
@pytest.mark.parametrize("drafting,cases", [
    ("parallel", ((DK, "product"), (10, "product"))), pytest.param("parallel", ((10, "min"),), marks=pytest.mark.full),
    ("sequential", ((DK, "product"),)),
    # a sequential tree of N > K: in the default run, decoded by hand above and by generate on a second family
    # (tests/test_tree_sequential.py)
    pytest.param("sequential", ((10, "product"),), marks=pytest.mark.full)])
def test_generate_with_a_tree_equals_plain_greedy(pair, heads, chain_run, drafting, cases):
    """generate(tree_budget=N): plain greedy's tokens (ragged batch) for N = K and N > K (the acceptance lengths of
    chain and trees are printed: a random head's trees rarely meet the target, so they are recorded, not compared)."""
    chain = [t[:NEW] for t in chain_run.tokens]
    als = {}
    for n, score in cases:
        res = pjax.generate(pair[0], heads[drafting], PROMPTS, max_new_tokens=NEW, drafting=drafting,
                            num_speculative_tokens=DK, tree_budget=n, tree_score=score, compiler_options=FAST)
        assert res.tokens == chain
        st = res.stats
        assert st["stop_reasons"] == ["length"] * len(PROMPTS) and len(st["acceptance_rates"]) == DK
        assert st["num_draft_tokens"] >= n * st["num_drafts"] - 2 * n  # every round verifies the whole tree
        als[n, score] = st["mean_acceptance_length"]
    chain_al = chain_run.stats["mean_acceptance_length"]
    print(f"acceptance length: chain {chain_al:.3f}, trees {als}")


def test_tree_chunks_do_not_branch_on_the_device(pair):
    """An engine's tree rounds take the greedy or the sampled acceptance (with or without top-k / top-p) as the host
    picks per chunk (`Engine._needs`), with no branch on the device: on a GPU a branch's predicate is read back to the
    host every round."""
    eng = pjax.decode.Engine(*pair, pjax.decode.EngineConfig(max_slots=2, max_len=64, num_speculative_tokens=DK,
                                                             tree_budget=6, compiler_options=FAST))
    for mode in ("greedy", "filtered"):
        assert "conditional(" not in eng._chunk_program(True, None, mode).as_text()


def test_tree_settings_errors(pair):
    target, drafter = pair
    gen = lambda **kw: pjax.generate(target, drafter, PROMPTS, max_new_tokens=4,  # noqa: E731
                                     **{"num_speculative_tokens": DK, "tree_budget": 8, **kw})
    for kw, match in [(dict(drafting="none"), "tree_budget needs drafting='parallel' or 'sequential'"),
                      (dict(tree_budget=2), "tree_budget=2 must be >= num_speculative_tokens=3"),
                      (dict(tree_budget=0), "tree_budget must be an integer >= 1"),
                      (dict(tree_score="max"), r"tree_score='max': expected one of \('product', 'min'\)"),
                      (dict(draft_sampling="sample"), "tree_budget needs draft_sampling='argmax'")]:
        with pytest.raises(ValueError, match=match):
            gen(**kw)
    cfg = pjax.decode.EngineConfig(num_speculative_tokens=DK, tree_budget=8)
    pjax.decode.make_spec(target, drafter, dataclasses.replace(cfg, temperature=1.0), max_new_tokens=4)  # sampled: ok
    with pytest.raises(ValueError, match="acceptance rule"):
        pjax.decode.make_spec(target, drafter, cfg, max_new_tokens=4, acceptance=lambda *a: None)
    with pytest.raises(ValueError, match="tree_budget=20 exceeds the 14 paths"):  # 2 + 4 + 8
        pjax.decode.make_spec(target, make_drafter(target, draft_vocab_size=2),
                              dataclasses.replace(cfg, tree_budget=20), max_new_tokens=4)
    with pytest.raises(ValueError, match="tree_budget=20 exceeds the 10 nodes a sequential tree"):  # 2 + 2 x 2^2
        pjax.decode.make_spec(target, make_drafter(target, draft_vocab_size=2),
                              dataclasses.replace(cfg, tree_budget=20, drafting="sequential"), max_new_tokens=4)


def test_bench_sweeps_tree_budgets():
    """`pjax bench --tree-budget`: each speculative mode also runs a tree of each N >= K per K (after the chains),
    each row and request line says which, bench.md labels the K cell; the settings' errors name the flag."""
    from pjax.bench.errors import BenchError
    from pjax.bench.report import markdown
    from pjax.bench.runner import BenchSettings, run_bench
    from tests.test_bench_parts import StandIn, prompt_set
    s = BenchSettings(drafting=("parallel", "sequential", "none"), ks=(1, 3), tree_budgets=(2, 4),
                      concurrency=(1,), max_new_tokens=4)
    backend = StandIn()
    res = run_bench(backend, [prompt_set()], s, meta={}, progress=False)
    assert [(r["drafting"], r["k"], r["tree_budget"]) for r in res.rows] == [
        ("none", 0, None), ("sequential", 1, None), ("parallel", 1, None), ("sequential", 1, 2), ("sequential", 1, 4),
        ("parallel", 1, 2), ("parallel", 1, 4), ("sequential", 3, None), ("parallel", 3, None), ("sequential", 3, 4),
        ("parallel", 3, 4)]
    # prompt + new + max K + a sequential tree's drafter scratch at K = 3, N = 4: (K - 1) x 4 frontier slots > N
    assert {c[4] for c in backend.calls if c[0] == "prepare"} == {3 + 4 + 3 + 8}
    assert {line["tree_budget"] for line in res.requests} == {None, 2, 4}
    md = markdown(res, {}, plots={})
    assert "| parallel | 1, tree 2 | 1 |" in md and "| sequential | 3, tree 4 | 1 |" in md
    base = dict(drafting=("parallel", "none"), ks=(3,), tree_budgets=(4,))
    BenchSettings(**base, temperature=0.5).validate()  # trees sample too
    for kw, needle in [(dict(tree_budgets=(2,)), "no budget is >= a K"), (dict(drafting=("none",)), "parallel"),
                       (dict(tree_budgets=(4, 4)), "distinct"),
                       (dict(simulate_acceptance=(0.5,) * 3), "chains only")]:
        with pytest.raises(BenchError, match="--tree-budget"):
            BenchSettings(**{**base, **kw}).validate()
        with pytest.raises(BenchError, match=needle):
            BenchSettings(**{**base, **kw}).validate()
