"""The Triton cache-attention kernel with a token-tree mask (interpret mode on CPU) vs a brute-force masked
attention: keys below the tree's first slot by the position rules, the tree's slots by the ancestor mask, none after;
a tree of more slots than queries (a tree drafted depth by depth: the last pass's nodes see the earlier passes').
Also the query-block programs (T x g past 128 rows) and the kernel's Pallas -> Triton lowering with a tree."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.kernels.cache_attention import pallas as attn_pallas
from pjax.kernels.flash_attention.reference import masked_softmax
from tests.gpu_lowering import lower_for_gpu


def _tree(rs, n):
    """Nodes 1..n (0 = root), parents sampled before them -> (depth [n + 1], ancestor-or-self [n + 1, n + 1])."""
    depth, vis = np.zeros(n + 1, np.int32), np.eye(n + 1, dtype=bool)
    for i in range(1, n + 1):
        p = rs.integers(0, i)
        depth[i], vis[i] = depth[p] + 1, vis[p]
        vis[i, i] = True
    return depth, vis


def _brute_force(q, k, v, q_pos, start, visible, *, scale, window, sinks, kv_len):
    """Explicit [B, T, S] mask over cache slots, then the library's one softmax (float32)."""
    b, t, nh, hd = q.shape
    s, nkv = k.shape[1:3]
    slot = np.arange(s)[None, None, :]
    committed = (slot < start[:, None, None]) & (slot <= np.asarray(q_pos)[:, :, None])
    if kv_len is not None:
        committed = committed & (slot < kv_len[:, None, None])
    if window is not None:
        committed = committed & (slot > np.asarray(q_pos)[:, :, None] - window)
    m = visible.shape[2]  # tree slots (>= T; M > T: no window below M, the slots' positions are not needed)
    j = slot - start[:, None, None]
    in_tree = (j >= 0) & (j < m)
    tree = in_tree & np.take_along_axis(visible, np.broadcast_to(np.clip(j, 0, m - 1), (b, t, s)), axis=2)
    vis = jnp.asarray(committed | tree)[:, None, None]  # [B, 1, 1, T, S]
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    qg = f32(q).reshape(b, t, nkv, nh // nkv, hd)
    sc = jnp.einsum("btkgd,bskd->bkgts", qg, f32(k)) * scale
    (w,), _ = masked_softmax([(sc, vis)], sinks)
    return jnp.einsum("bkgts,bskd->btkgd", w, f32(v)).reshape(b, t, nh, hd)


def _case(seed, b, n, nh, nkv, hd, s, dtype, starts, *, chain=False, kv_len=False, sinks=False, extra=0):
    """extra > 0: the tree has n + 1 + extra slots and the queries are its last n + 1 nodes."""
    rs = np.random.default_rng(seed)
    t = n + 1
    q, k, v = (jnp.asarray(rs.normal(size=sh), dtype) for sh in ((b, t, nh, hd), (b, s, nkv, hd), (b, s, nkv, hd)))
    trees = [(np.arange(t, dtype=np.int32), np.tril(np.ones((t, t), bool))) if chain else _tree(rs, n + extra)
             for _ in range(b)]
    start = np.asarray(starts, np.int32)
    q_pos = start[:, None] + np.stack([d[extra:] for d, _ in trees])
    visible = np.stack([m[extra:] for _, m in trees])
    # kv_len: the committed length start plus the tree (the row's cache holds the tree's K/V), or cut below start
    lens = np.where(rs.random(b) < 0.5, start + t, np.maximum(start - rs.integers(1, 9, b), 0)) if kv_len else None
    kw = dict(sinks=jnp.asarray(rs.normal(size=nh), jnp.float32) if sinks else None,
              kv_len=None if lens is None else jnp.asarray(lens, jnp.int32))
    return q, k, v, jnp.asarray(q_pos, jnp.int32), start, visible, kw


def _check(out, ref, dtype):
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_chain_tree_equals_no_tree():
    """A chain (lower-triangular visible, q_pos = slots) is today's causal verify: same result as tree=None."""
    q, k, v, q_pos, start, visible, kw = _case(0, 2, 4, 2, 2, 16, 64, jnp.bfloat16, [9, 40], chain=True, sinks=True)
    kw["kv_len"] = jnp.asarray(start + 5, jnp.int32)
    run = jax.jit(lambda *a: attn_pallas.cache_attention(*a[:4], scale=0.25, window=24, **kw, tree_start=a[4],
                                                         tree_visible=a[5], block_k=16))
    plain = attn_pallas.cache_attention(q, k, v, q_pos, scale=0.25, window=24, **kw, block_k=16)
    out = run(q, k, v, q_pos, jnp.asarray(start), jnp.asarray(visible))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    _check(out, _brute_force(q, k, v, q_pos, start, visible, scale=0.25, window=24, **kw), jnp.bfloat16)


# (seed, b, nodes, nh, nkv, hd, s, dtype, tree starts, window, kv_len, sinks, block_k, splits, extra tree slots)
TREE_CASES = [
    # GQA 4 (36 rows), float32: start near 0, starts not on a tile, mask-free tiles inside the window, kv_len
    # both past the tree and cut below its start, sinks
    (1, 3, 8, 8, 2, 16, 100, jnp.float32, [1, 37, 70], 40, True, True, 16, None, 0),
    # g = 8, 16 nodes: 136 rows in two query blocks; the tree at slot 0 and mid-cache, no window; 20 more tree slots
    # than queries (the tree reaches past the queries' tiles)
    (2, 2, 16, 8, 1, 16, 80, jnp.bfloat16, [0, 45], None, False, False, 16, None, 20),
    # extra coverage (--full): MHA, head_dim not a power of two, a tree ending at the cache end
    pytest.param(3, 2, 12, 4, 4, 24, 64, jnp.bfloat16, [51, 20], 8, True, True, 16, None, 0, marks=pytest.mark.full),
    # g = 8 with 64 nodes: 520 rows in five query blocks, float32, window
    pytest.param(4, 1, 64, 8, 1, 32, 200, jnp.float32, [101], 64, True, False, 16, None, 0, marks=pytest.mark.full),
    # g = 2 with 32 nodes (66 rows: one 128-row program), tiles of 32 keys, three splits
    pytest.param(5, 2, 32, 4, 2, 16, 160, jnp.bfloat16, [3, 97], None, True, True, 32, 3, 0, marks=pytest.mark.full),
]


@pytest.mark.parametrize("seed,b,n,nh,nkv,hd,s,dtype,starts,window,kv_len,sinks,bk,splits,extra", TREE_CASES)
def test_tree_kernel_matches_brute_force(seed, b, n, nh, nkv, hd, s, dtype, starts, window, kv_len, sinks, bk,
                                         splits, extra):
    q, k, v, q_pos, start, visible, kw = _case(seed, b, n, nh, nkv, hd, s, dtype, starts, kv_len=kv_len, sinks=sinks,
                                               extra=extra)
    assert (np.asarray(q_pos) - start[:, None]).max() < n + extra  # a tree, not a chain: some node has siblings
    out = jax.jit(lambda *a: attn_pallas.cache_attention(*a[:4], scale=hd ** -0.5, window=window, **kw,
                                                         tree_start=a[4], tree_visible=a[5], block_k=bk,
                                                         splits=splits))(q, k, v, q_pos, jnp.asarray(start),
                                                                         jnp.asarray(visible))
    _check(out, _brute_force(q, k, v, q_pos, start, visible, scale=hd ** -0.5, window=window, **kw), dtype)


def test_tree_arguments_are_checked():
    q, k = jnp.ones((2, 3, 4, 16)), jnp.ones((2, 32, 2, 16))
    pos, start = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    call = lambda **kw: attn_pallas.cache_attention(q, k, k, pos, scale=0.25, **kw)
    with pytest.raises(ValueError, match="tree_start and tree_visible must be given together"):
        call(tree_start=start)
    with pytest.raises(ValueError, match=r"tree_visible must be bool \(2, 3\) \+ \(n,\) with n >= 3"):
        call(tree_start=start, tree_visible=jnp.ones((2, 3, 2), bool))
    with pytest.raises(ValueError, match="tree_start must have shape"):
        call(tree_start=start[:1], tree_visible=jnp.ones((2, 3, 3), bool))
    # more tree slots than queries: the slots have no positions, so no window may hide one
    from pjax.kernels.cache_attention import TreeMask, reference
    wide = jnp.ones((2, 3, 5), bool)
    for check in (lambda: call(tree_start=start, tree_visible=wide, window=4),
                  lambda: reference.cache_attention(q, k, k, pos, scale=0.25, window=4, tree=TreeMask(start, wide))):
        with pytest.raises(ValueError, match="a tree of 5 slots seen by 3 queries needs window None or >= 5"):
            check()


def test_tree_kernel_lowers_for_cuda():
    """Pallas -> Triton IR on a CPU host for a 64-node tree at GQA 8 (520 rows: five 128-row query blocks) with a
    window, kv_len and sinks: the bool mask loads, the three-way tile switch and the query-block programs."""
    bf, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    lower_for_gpu(lambda q_, k_, v_, p_, l_, st, vis, sk: attn_pallas.cache_attention(
        q_, k_, v_, p_, scale=0.1, window=4096, sinks=sk, kv_len=l_, tree_start=st, tree_visible=vis,
        interpret=False), bf(2, 65, 32, 128), bf(2, 16384, 4, 128), bf(2, 16384, 4, 128), i32(2, 65), i32(2), i32(2),
        jax.ShapeDtypeStruct((2, 65, 65), jnp.bool_), jax.ShapeDtypeStruct((32,), jnp.float32))


@pytest.mark.full
def test_query_blocks_without_tree():
    """Past 128 rows without a tree (T = 40 causal queries at g = 4: two query blocks, each with its own key
    range) the kernel equals the reference."""
    from pjax.kernels.cache_attention import cache_attention
    rs = np.random.default_rng(6)
    q = jnp.asarray(rs.normal(size=(2, 40, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rs.normal(size=(2, 120, 2, 16)), jnp.float32) for _ in range(2))
    q_pos = jnp.asarray(np.array([[3], [70]]) + np.arange(40)[None], jnp.int32)
    kw = dict(scale=0.25, window=32, sinks=jnp.asarray(rs.normal(size=8), jnp.float32),
              kv_len=jnp.asarray([43, 105], jnp.int32))
    ref = cache_attention(q, k, v, q_pos, **kw, implementation="xla")
    _check(attn_pallas.cache_attention(q, k, v, q_pos, **kw, block_k=16), ref, jnp.float32)


def test_public_api_routes_trees():
    """`cache_attention(tree=)`: "pallas" runs the kernel where its tree rule is the reference's (no kv_len, no window
    below T) and equals the reference there; elsewhere it falls back to the reference; "mosaic" refuses a tree."""
    from pjax.kernels.cache_attention import TreeMask, cache_attention
    from pjax.kernels.cache_attention.api import choose
    q, k, v, q_pos, start, visible, kw = _case(7, 2, 6, 4, 2, 16, 48, jnp.float32, [5, 30])
    tree = TreeMask(jnp.asarray(start), jnp.asarray(visible))
    assert choose(q, k, "pallas", tree=True, window=None) == "pallas"
    assert choose(q, k, "pallas", tree=True, window=7) == "pallas"  # window >= T = 7: no ancestor hidden
    assert choose(q, k, "pallas", tree=True, window=6) == "xla"
    assert choose(q, k, "pallas", tree=True, has_kv_len=True) == "xla"
    assert choose(q, k, "auto", tree=True) == "xla"  # off GPU
    with pytest.raises(ValueError, match="mosaic' takes no tree mask"):
        choose(q, k, "mosaic", tree=True)
    ref = cache_attention(q, k, v, q_pos, scale=0.25, window=16, tree=tree, implementation="xla")
    _check(cache_attention(q, k, v, q_pos, scale=0.25, window=16, tree=tree, implementation="pallas"), ref,
           jnp.float32)
    _check(ref, _brute_force(q, k, v, q_pos, start, visible, scale=0.25, window=16, sinks=None, kv_len=None),
           jnp.float32)
