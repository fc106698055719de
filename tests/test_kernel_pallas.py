"""Pallas kernels (interpret mode on CPU) vs their jnp references, plus Pallas -> Triton lowering for CUDA
(tests/gpu_lowering.py), the dot precision the kernels take from JAX's default matmul precision, the output
contract shared by interpret mode and the GPU, and the hardware facts the kernels size themselves by.

Small shapes with small tiles so that the vocabulary / KV loops, the tails (vocab not a multiple of the
tile) and the split merges are all exercised while interpret mode stays fast.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax import _compat
from pjax.kernels import dispatch, hardware
from pjax.kernels.acceptance import accept
from pjax.kernels.acceptance import pallas as acc_pallas
from pjax.kernels.acceptance.config import AcceptanceConfig
from pjax.kernels.cache_attention import cache_attention
from pjax.kernels.cache_attention import pallas as attn_pallas
from pjax.kernels.expert_matmul import expert_matmul
from pjax.kernels.expert_matmul import pallas as em_pallas
from pjax.kernels.metadata import build_draft_inputs
from pjax.kernels.metadata import pallas as meta_pallas
from tests.gpu_lowering import lower_for_gpu, triton_modules
from tests.kernel_jaxpr import kernel_dot_precisions, pallas_kernel_names


def _eq(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# The default run keeps one draft, a K past the batch and a batch past K; --full adds (5, 3).
@pytest.mark.parametrize("b,k", [(1, 1), pytest.param(5, 3, marks=pytest.mark.full), (19, 7), (3, 11)])
def test_metadata_kernel_equals_reference(b, k):
    rs = np.random.default_rng(b * k)
    args = (jnp.asarray(rs.integers(0, k + 1, b), jnp.int32), jnp.asarray(rs.integers(0, 5000, (b, k + 1)), jnp.int32),
            jnp.asarray(rs.integers(0, 5000, b), jnp.int32), jnp.asarray(rs.integers(0, 9000, b), jnp.int32))
    for s in {2 * k, 2 * k + 3}:
        kw = dict(num_slots=s, mask_token_id=17)
        _eq(*jax.jit(lambda *a: [build_draft_inputs(*a, **kw, implementation=impl) for impl in ("xla", "pallas")])(
            *args))  # one program (op by op, each op compiles its own)


def _accept_case(seed, b, k, v, dtype, with_q, trunc):
    rs = np.random.default_rng(seed)
    logits = jnp.asarray(rs.normal(size=(b, k + 1, v)) * 2, dtype)
    am = np.asarray(jnp.argmax(logits.astype(jnp.float32), -1))
    prefix = rs.integers(0, k + 1, b)
    drafts = np.where(np.arange(k)[None] < prefix[:, None], am[:, :k], rs.integers(-1, v + 1, (b, k))).astype(np.int32)
    q = jnp.asarray(rs.dirichlet(np.ones(v) * 0.5, size=(b, k)), jnp.float32) if with_q else None
    kw = dict(temperature=jnp.asarray(rs.choice([0.0, 0.7, 1.0, 1.5], b), jnp.float32),
              seeds=jnp.asarray(rs.integers(0, 2 ** 32, b, dtype=np.uint64).astype(np.uint32)),
              positions=jnp.asarray(rs.integers(0, 5000, b), jnp.int32),
              num_drafts=jnp.asarray(rs.integers(0, k + 1, b), jnp.int32),
              top_k=jnp.asarray(rs.choice([0, 3, 20], b), jnp.int32) if trunc else None,
              top_p=jnp.asarray(rs.choice([1.0, 0.7], b), jnp.float32) if trunc else None)
    return logits, jnp.asarray(drafts), q, kw


# The default run keeps each dtype, with and without draft probabilities and truncation; --full adds (3, 7, 257).
@pytest.mark.parametrize("b,k,v,dtype,with_q,trunc", [
    (8, 1, 300, jnp.float32, False, False),
    (6, 3, 1000, jnp.bfloat16, False, True),
    pytest.param(3, 7, 257, jnp.bfloat16, True, False, marks=pytest.mark.full),
    (2, 11, 130, jnp.float32, True, True),
])
def test_acceptance_kernel_equals_reference(b, k, v, dtype, with_q, trunc):
    config = AcceptanceConfig(tile=64, target_programs=64)  # several tiles, a ragged tail and vocabulary splits
    logits, drafts, q, kw = _accept_case(b * 100 + k, b, k, v, dtype, with_q, trunc)
    ref, out = jax.jit(lambda *a: (accept(*a, **kw, implementation="xla"), acc_pallas.accept(*a, **kw, config=config)))(
        logits, drafts, q)
    _eq(ref, out)


@pytest.mark.parametrize("b,t,nh,nkv,hd,s,dtype,window,sinks,kv_len", [
    (2, 4, 8, 2, 32, 150, jnp.float32, None, False, False),  # verify K=3, GQA 4
    (3, 12, 4, 1, 16, 97, jnp.bfloat16, None, True, True),  # K=11 verify, MQA, sinks, ragged lengths
    (2, 6, 6, 3, 24, 80, jnp.bfloat16, 16, False, True),  # draft 2K=6, head_dim not a power of two, window
    (1, 22, 2, 2, 64, 70, jnp.float32, 8, True, False),  # draft 2K=22, MHA, window + sinks
    (2, 22, 8, 2, 32, 320, jnp.bfloat16, None, False, True),  # 88 GQA rows; unmasked loads, mask-free tiles
    (1, 12, 8, 2, 16, 200, jnp.float32, 40, True, True),  # window with mask-free tiles inside it
])
def test_cache_attention_kernel_matches_reference(b, t, nh, nkv, hd, s, dtype, window, sinks, kv_len):
    rs = np.random.default_rng(s)
    q = jnp.asarray(rs.normal(size=(b, t, nh, hd)), dtype)
    k = jnp.asarray(rs.normal(size=(b, s, nkv, hd)), dtype)
    v = jnp.asarray(rs.normal(size=(b, s, nkv, hd)), dtype)
    start = rs.integers(0, s - t, b)
    q_pos = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
    kw = dict(scale=hd ** -0.5, window=window,
              sinks=jnp.asarray(rs.normal(size=nh), jnp.float32) if sinks else None,
              kv_len=jnp.asarray(np.minimum(start + t + rs.integers(0, 4, b), s), jnp.int32) if kv_len else None)
    ref, out = jax.jit(lambda *a: (cache_attention(*a, **kw, implementation="xla").astype(jnp.float32),
                                   attn_pallas.cache_attention(*a, **kw, block_k=16).astype(jnp.float32)))(q, k, v, q_pos)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=tol, rtol=tol)


def test_cache_attention_block_size_fits_shared_memory():
    """128-key tiles for bf16 head_dim 128 (verify and 22-query draft shapes); halved for f32, head_dim 256, or 128
    rows of head_dim 128 (tree blocks: 128 x 3 asked Triton for 256 KiB on an H200)."""
    for rows, hdp, itemsize, want in ((32, 128, 2, 128), (128, 128, 2, 64), (32, 128, 4, 64), (128, 128, 4, 32),
                                      (128, 256, 2, 32), (16, 64, 2, 128)):
        bk = attn_pallas.block_size(128, 16384, hdp, rows, itemsize, 3)
        assert bk == want and ((3 * 2 * bk + rows) * hdp + rows * bk) * itemsize <= attn_pallas.smem_budget()
    assert attn_pallas.smem_budget() == 224 * 1024  # off GPU: the reference H200's 227 KiB less Triton's scratch
    assert attn_pallas.block_size(128, 40, 128, 32, 2, 3) == 64  # short caches: next power of two of the length
    # default tiles: 128 keys x 3 stages; 64 x 4 for 64-row programs; 64 x 3 where 128-key blocks are too few to
    # fill the GPU or programs are short and many
    assert [attn_pallas.default_tiles(b, 8, s, rows) for b, s, rows in (
        (1, 16384, 32), (1, 16384, 64), (1, 1024, 32), (8, 1024, 32), (64, 1024, 32), (64, 1024, 128),
        (64, 16384, 16))] == [(128, 3), (64, 4), (64, 3), (128, 3), (64, 3), (128, 3), (128, 3)]


def test_kernels_lower_to_triton_for_cuda():
    """Runs the Pallas -> Triton IR lowering (power-of-two shapes, supported primitives) on a CPU host."""
    logits, drafts, q, kw = _accept_case(0, 3, 3, 1000, jnp.bfloat16, True, True)
    lower_for_gpu(lambda *a: acc_pallas.accept(*a, **kw, interpret=False), logits, drafts, q)
    i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
    lower_for_gpu(lambda *a: meta_pallas.build_draft_inputs(*a, num_slots=6, mask_token_id=3, interpret=False), i32,
                  jax.ShapeDtypeStruct((4, 4), jnp.int32), i32, i32)
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    lower_for_gpu(lambda q_, k_, v_, p_, l_, sk: attn_pallas.cache_attention(
        q_, k_, v_, p_, scale=0.1, window=64, sinks=sk, kv_len=l_, interpret=False),
        bf(2, 8, 32, 128), bf(2, 512, 8, 128), bf(2, 512, 8, 128), jax.ShapeDtypeStruct((2, 8), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.float32))


# The default run keeps P = 1, each dtype, the repeated rows and the accumulator cap; --full adds (8, 64, 96, 16).
@pytest.mark.parametrize("p,din,dout,e,dtype", [(1, 32, 48, 4, jnp.float32),
                                                pytest.param(8, 64, 96, 16, jnp.float32, marks=pytest.mark.full),
                                                (24, 128, 80, 5, jnp.bfloat16), (64, 48, 2880 // 36, 128, jnp.float32),
                                                (40, 2880 // 45, 64, 3, jnp.bfloat16),
                                                (100, 32, 256, 40, jnp.float32)])
def test_expert_matmul_kernel_equals_reference(p, din, dout, e, dtype):
    """Rows sharing an expert (few experts) and rows that do not; din / dout not powers of two; P not one."""
    rs = np.random.default_rng(p + din)
    x = jnp.asarray(rs.standard_normal((p, din)), dtype)
    w = jnp.asarray(rs.standard_normal((e, din, dout)), dtype)
    ids = jnp.asarray(rs.integers(0, e, p), jnp.int32)
    repeat = 4 if p % 4 == 0 else 1  # token rows feeding top-4 pairs each: out[q] = x[q // 4] @ w[ids[q]]

    @jax.jit  # one program (op by op, each op compiles its own)
    def products(x, ids, w):
        return [expert_matmul(x_, ids, w, repeat=r, implementation=impl)
                for x_, r in ((x, 1), (x[:p // repeat], repeat)) for impl in ("xla", "pallas")]
    want, got, want_repeated, got_repeated = (np.asarray(a, np.float32) for a in products(x, ids, w))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    too_wide = [128] if p > 64 and dout % 128 == 0 else []  # 128 rows x 128 columns: over the accumulator cap
    for bad in [24, 48 if dout % 48 == 0 and dout != 48 else 24, 2 * dout] + too_wide:
        with pytest.raises(ValueError, match=f"block_n={bad} must be a power of two >= 16 dividing dout"):
            em_pallas.expert_matmul(x, ids, w, block_n=bad)
    with pytest.raises(ValueError, match=r"expected x \[P / repeat, din\], expert_ids \[P\]"):
        expert_matmul(x, ids[:-1], w)
    if repeat == 4:
        want = want_repeated
        np.testing.assert_allclose(np.repeat(np.asarray(x[:p // 4], np.float32), 4, 0)[:, None, :] @ np.asarray(
            w, np.float32)[np.asarray(ids)], want[:, None, :], rtol=tol, atol=tol * np.abs(want).max())
        np.testing.assert_allclose(got_repeated, want, rtol=tol, atol=tol * np.abs(want).max())


def test_expert_matmul_ids_out_of_range_gradient_and_mixed_dtypes():
    """Ids index like `w[ids]` (negative wrap, too large clamp: normalised before the kernel, which would otherwise
    read outside w on a GPU); gradients go through the reference's VJP; mixed dtypes are not the kernel's."""
    rs = np.random.default_rng(1)
    x = jnp.asarray(rs.standard_normal((6, 32)), jnp.float32)
    w = jnp.asarray(rs.standard_normal((4, 32, 64)), jnp.float32)
    ids = jnp.asarray([-1, 4, 9, 0, -4, 2], jnp.int32)
    loss = lambda impl, ids_, r: lambda x_, w_: jnp.sum(jnp.sin(expert_matmul(x_, ids_, w_, repeat=r,
                                                                            implementation=impl)))

    @jax.jit  # one program (op by op, each op compiles its own)
    def outputs_and_gradients(x, ids, w):
        out = [expert_matmul(x, ids, w, implementation=impl) for impl in ("xla", "pallas")]
        # token rows feeding 2 pairs each: their gradients sum over the pairs
        grads = [[jax.grad(loss(impl, ids % 4, r), (0, 1))(xs, w) for impl in ("pallas", "xla")]
                 for xs, r in ((x, 1), (x[:3], 2))]
        return out, grads
    (want, got), grads = outputs_and_gradients(x, ids, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for pallas_grads, xla_grads in grads:
        for got, ref in zip(pallas_grads, xla_grads):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert "one dtype" in em_pallas.unsupported_reason(x.astype(jnp.bfloat16), w)


def test_expert_matmul_lowers_to_triton_and_moe_uses_it(monkeypatch):
    """The kernel lowers for CUDA; pjax.models.moe.MoE's decode path goes through it (implementation="pallas";
    "auto" on a GPU) and matches."""
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    for p, r in ((16, 8), (96, 1)):  # 16 and 128 padded rows; token rows feeding 8 pairs each
        lower_for_gpu(lambda x, i, w: em_pallas.expert_matmul(x, i, w, repeat=r, interpret=False), bf(p // r, 2048),
                      jax.ShapeDtypeStruct((p,), jnp.int32), bf(128, 2048, 1536))
    from flax import nnx

    from pjax.models import moe as nn
    from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec
    from pjax.kernels.expert_matmul.config import DEFAULT
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=11, hidden_size=64, intermediate_size=64, num_heads=2,
                      layers=(LayerSpec(32, 1, RopeSpec(theta=1e4), moe=True),), moe=MoeSpec(8, 3, 48))
    moe = nn.MoE(cfg, cfg.moe, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 64))
    graph, state = nnx.split(moe)
    calls = []
    kernel = em_pallas.expert_matmul
    monkeypatch.setattr(em_pallas, "expert_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    jax.clear_caches()
    # one program (op by op, each op compiles its own); the kernel calls are counted as it is traced
    want, auto, got = jax.jit(lambda s, x_: [nnx.merge(graph, s)(x_, implementation=impl)
                                            for impl in ("xla", "auto", "pallas")])(state, x)
    jax.clear_caches()
    assert np.array_equal(np.asarray(auto), np.asarray(want))  # "auto" off GPU: no kernel
    assert len(calls) == 2  # gate_up and down, for "pallas" only
    assert nn.MOE_FEW_PAIRS <= DEFAULT.max_rows  # every few-pair MoE call fits the kernel
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_target_cached_forward_with_attention_kernel():
    """pjax.models.attention.Attention's cached path dispatches to the kernel (implementation="pallas", interpret mode
    here; "auto" on a GPU); the target's logits match the XLA path's."""
    from pjax.models import forward, init_cache, init_target, logits_from_hidden
    from pjax.config import LayerSpec, ModelConfig, RopeSpec

    cfg = ModelConfig("llama", 64, 32, 64, 4, (LayerSpec(8, 2, RopeSpec(), sliding_window=6),), rms_norm_eps=1e-5)
    target = init_target(cfg, jax.random.key(0), scale=0.2)
    tokens = jax.random.randint(jax.random.key(1), (2, 4), 0, 64)
    pos = jnp.array([[3, 4, 5, 6], [9, 10, 11, 12]], jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)  # one program each (eager, every op compiles on its own)
    def run(impl):
        cache = init_cache(cfg, 2, 16, jnp.float32)
        prefix = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
        cache = forward(target, jnp.ones((2, 9), jnp.int32), prefix, cache, implementation=impl).cache
        return logits_from_hidden(target, forward(target, tokens, pos, cache, implementation=impl).hidden)

    ref = run("xla")
    out = run("pallas")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-4, rtol=2e-4)


# ---------------------------------------------------------------- Mosaic GPU cache attention
MOSAIC_CASES = [  # (b, t, nh, nkv, hd, s, window, kv_len, splits, block_k, stages, swap)
    # draft 2K=22, 88 GQA rows, mask-free interior tiles; rows 64..87 as wgmma columns (head_dim 128)
    (1, 22, 8, 2, 128, 256, None, False, None, 64, 2, None),
    (2, 22, 8, 2, 128, 384, 100, True, 2, 64, 2, None),  # window, ragged lengths
    (2, 12, 16, 2, 128, 512, 40, True, 4, 64, 2, None),  # verify K=11 with g=8 (96 rows), window edges at both ends
    (1, 40, 4, 2, 64, 640, None, True, 16, 64, 2, None),  # g=2, 80 rows; programs past the visible range stay empty
    (3, 22, 8, 2, 64, 192, 30, False, 3, 64, 3, None),  # head_dim 64: both consumers on 64 rows each
    (2, 22, 8, 2, 128, 384, 100, True, 2, 64, 2, False),  # 88 rows on the rows path at head_dim 128
    (1, 30, 16, 4, 128, 256, None, True, 2, 64, 2, None),  # 120 rows: past SWAP_COLS, rows path
    # no window: each split's first 3 of its 8 / 7 strided tiles (15 visible at this seed) go out before the
    # positions are read, the rest through the 3-slot ring, reusing every slot
    (1, 22, 8, 2, 128, 1024, None, True, 2, 64, 3, None),
]


def _mosaic_case(b, t, nh, nkv, hd, s, window, kv_len, seed):
    rs = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rs.normal(size=sh), jnp.bfloat16) for sh in ((b, t, nh, hd), (b, s, nkv, hd), (b, s, nkv, hd)))
    start = rs.integers(0, s - t, b)
    q_pos = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
    kw = dict(scale=hd ** -0.5, window=window, sinks=jnp.asarray(rs.normal(size=nh), jnp.float32),
              kv_len=jnp.asarray(np.minimum(start + t + rs.integers(0, 4, b), s), jnp.int32) if kv_len else None)
    return q, k, v, q_pos, kw


@pytest.mark.skipif(not _compat.mosaic_gpu_interpret_runs(),
                    reason="Mosaic GPU interpret mode needs JAX >= 0.11 (layout_cast has no CPU rule in 0.10); the "
                           "kernel is checked on the GPU by examples/benchmarks/bench_kernels.py")
@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_mosaic_cache_attention_matches_reference(case):
    """GPU interpret mode on CPU: simulated warpgroups, TMA and barriers (the producer / consumer hand-offs and
    the turn-taking), with the tile ranges, edge masks, partial layout and the shared merge."""
    from pjax.kernels.cache_attention import mosaic
    *shape, splits, bk, stages, swap = case
    q, k, v, q_pos, kw = _mosaic_case(*shape, seed=sum(shape[:6]))
    ref = cache_attention(q, k, v, q_pos, **kw, implementation="xla").astype(jnp.float32)
    out = mosaic.cache_attention(q, k, v, q_pos, **kw, splits=splits, block_k=bk, stages=stages, swap=swap,
                                 interpret=True)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=2e-2, rtol=2e-2)


def test_mosaic_cache_attention_lowers_for_cuda(monkeypatch):
    """Pallas -> Mosaic GPU lowering on a CPU host: layout inference, TMA tiling of dynamic key offsets, the
    shared-memory budget of the default 128-key x 2-stage ring (fails when any of them breaks)."""
    from pjax.kernels.cache_attention import mosaic
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    text = lower_for_gpu(lambda q_, k_, v_, p_, l_, sk: mosaic.cache_attention(
        q_, k_, v_, p_, scale=0.1, window=4096, sinks=sk, kv_len=l_, interpret=False),
        bf(2, 22, 32, 128), bf(2, 16384, 8, 128), bf(2, 16384, 8, 128), i32(2, 22), i32(2),
        jax.ShapeDtypeStruct((32,), jnp.float32))
    assert "mosaic_gpu_v2" in text
    lower_for_gpu(lambda q_, k_, v_, p_: mosaic.cache_attention(q_, k_, v_, p_, scale=0.1, interpret=False),
                  bf(1, 12, 64, 64), bf(1, 8192, 8, 64), bf(1, 8192, 8, 64), i32(1, 12))
    # batch 1: the swapped second consumer (96 partial rows: the Triton merge must tile them in powers of two);
    # batch 64: the rows path, one split per KV head
    for batch in (1, 64):
        lower_for_gpu(lambda q_, k_, v_, p_: mosaic.cache_attention(q_, k_, v_, p_, scale=0.1, interpret=False),
                      bf(batch, 22, 32, 128), bf(batch, 16384, 8, 128), bf(batch, 16384, 8, 128), i32(batch, 22))
    # past pjax's own estimate (a device with 1 MiB per block): Mosaic's check must still fire
    monkeypatch.setattr(hardware, "gpu", lambda: dataclasses.replace(hardware.REFERENCE, smem_per_block=1 << 20))
    assert mosaic.unsupported_reason(bf(1, 22, 32, 128), bf(1, 16384, 8, 128), stages=4) is None
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_for_gpu(lambda q_, k_, v_, p_: mosaic.partials(q_, k_, v_, p_, scale=0.1, stages=4, interpret=False),
                      bf(1, 22, 32, 128), bf(1, 16384, 8, 128), bf(1, 16384, 8, 128), i32(1, 22))


def test_cache_attention_implementation_choice(monkeypatch):
    """'auto' on a Hopper GPU: Mosaic for 65..128 rows when programs stream >= mosaic_min_tiles tiles, else the
    Triton kernel (or XLA past 128 rows); 'mosaic' names why it cannot take a shape; off GPU: XLA. 'pallas' takes
    the Triton kernel on any device up to 128 rows, XLA past them; 'xla' is XLA everywhere."""
    from pjax.kernels.cache_attention import api, mosaic
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    q22, q8, k16, k1 = bf(8, 22, 32, 128), bf(8, 8, 32, 128), bf(8, 16384, 8, 128), bf(8, 1024, 8, 128)
    assert api.choose(q22, k16) == "xla"  # CPU
    assert not mosaic.available()
    for impl, want in (("pallas", "pallas"), ("xla", "xla"), ("mosaic", "mosaic")):
        assert api.choose(q22, k16, impl) == want
    assert api.choose(bf(8, 40, 32, 128), k16, "pallas") == "xla"  # 160 rows: past the kernel's rows
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(mosaic, "available", lambda: True)
    assert api.choose(q22, k16) == "mosaic"  # 2 splits x 64 tiles
    assert api.choose(bf(1, 22, 32, 128), bf(1, 16384, 8, 128)) == "mosaic"  # 16 splits x 8 tiles
    assert api.choose(q22, k1) == "pallas"  # 4 tiles per program
    assert api.choose(bf(1, 22, 32, 128), bf(1, 1024, 8, 128)) == "pallas"  # 1 tile
    assert api.choose(q8, k16) == "pallas"  # 32 rows
    assert api.choose(bf(8, 40, 32, 128), k16) == "xla"  # 160 rows: prefill-sized
    assert api.choose(q22, k16, "pallas") == "pallas" and api.choose(q22, k16, "xla") == "xla"
    assert api.choose(q22.update(dtype=jnp.float32), k16.update(dtype=jnp.float32)) == "pallas"
    assert "16-bit" in mosaic.unsupported_reason(q22.update(dtype=jnp.float32), k16.update(dtype=jnp.float32))
    assert "multiple of block_k" in mosaic.unsupported_reason(q22, bf(8, 1000, 8, 128))
    with pytest.raises(ValueError, match="rows"):
        mosaic.partials(q8, k16, k16, jnp.zeros((8, 8), jnp.int32), scale=0.1)
    with pytest.raises(ValueError, match="implementation must be one of"):
        api.choose(q22, k16, "triton")


# ---------------------------------------------------------------- one switch, one output contract, precision, hardware
def test_every_op_follows_the_switch():
    """"xla" and "auto" (off GPU) run no kernel; "pallas" runs each op's kernel, except where the kernel cannot take
    the inputs (the reference then: K = 0 acceptance, expert matmul past 128 pairs or with mixed dtypes, attention
    past 128 query rows); an unknown implementation is an error naming the op."""
    logits, drafts, q, kw = _accept_case(0, 2, 3, 300, jnp.float32, False, False)
    i32 = jnp.zeros((2,), jnp.int32)
    x, w = jnp.ones((4, 32)), jnp.ones((3, 32, 48))
    ids = jnp.zeros((4,), jnp.int32)
    qa, ka = jnp.ones((1, 4, 4, 16)), jnp.ones((1, 40, 2, 16))
    pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, 4))
    ops = {
        "accept": (lambda impl: lambda: accept(logits, drafts, q, **kw, implementation=impl), "pjax_accept"),
        "build_draft_inputs": (lambda impl: lambda: build_draft_inputs(i32, jnp.zeros((2, 4), jnp.int32), i32, i32,
                                                                       num_slots=6, mask_token_id=1,
                                                                       implementation=impl), "pjax_draft_inputs"),
        "expert_matmul": (lambda impl: lambda: expert_matmul(x, ids, w, implementation=impl), "pjax_expert_matmul"),
        "cache_attention": (lambda impl: lambda: cache_attention(qa, ka, ka, pos, scale=0.25, implementation=impl),
                            "pjax_cache_attention"),
    }
    for name, (make, kernel) in ops.items():
        assert pallas_kernel_names(make("xla")) == [] and pallas_kernel_names(make("auto")) == []
        assert any(n.startswith(kernel) for n in pallas_kernel_names(make("pallas"))), name
        with pytest.raises(ValueError, match=f"{name}: implementation must be one of"):
            make("triton")()
    logits0, drafts0 = logits[:, :1], drafts[:, :0]
    assert pallas_kernel_names(lambda: accept(logits0, drafts0, **kw, implementation="pallas")) == []
    for xx, ww, ii in ((jnp.ones((130, 32)), w, jnp.zeros((130,), jnp.int32)),
                       (x.astype(jnp.bfloat16), w, ids)):
        want = expert_matmul(xx, ii, ww, implementation="xla")
        assert pallas_kernel_names(lambda: expert_matmul(xx, ii, ww, implementation="pallas")) == []
        np.testing.assert_array_equal(np.asarray(expert_matmul(xx, ii, ww, implementation="pallas")), np.asarray(want))
    qp = jnp.ones((1, 70, 4, 16))  # 140 query rows per KV head
    pp = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (1, 70))
    assert pallas_kernel_names(lambda: cache_attention(qp, jnp.ones((1, 80, 2, 16)), jnp.ones((1, 80, 2, 16)), pp,
                                                        scale=0.25, implementation="pallas")) == []


def test_interpret_flag_and_one_output_contract():
    """Each kernel entry point takes `interpret`: None = interpret mode off GPU (here), False = the compiled kernel.
    Both give the same public outputs (shapes and dtypes): interpret-only padding stays inside the kernels."""
    assert dispatch.interpret() is True and dispatch.interpret(False) is False
    logits, drafts, q, kw = _accept_case(0, 3, 3, 300, jnp.bfloat16, True, True)
    i32 = jnp.zeros((3,), jnp.int32)
    bf = lambda *s: jnp.ones(s, jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(22, dtype=jnp.int32), (1, 22))
    from pjax.kernels.cache_attention import mosaic
    calls = {
        "accept": lambda **i: acc_pallas.accept(logits, drafts, q, **kw, **i),
        "metadata": lambda **i: meta_pallas.build_draft_inputs(i32, jnp.zeros((3, 4), jnp.int32), i32, i32,
                                                               num_slots=7, mask_token_id=1, **i),
        "expert_matmul": lambda **i: em_pallas.expert_matmul(bf(3, 32), i32, bf(2, 32, 64), **i),
        "attention": lambda **i: attn_pallas.cache_attention(bf(1, 5, 4, 16), bf(1, 40, 2, 16), bf(1, 40, 2, 16),
                                                             pos[:, :5], scale=0.25, sinks=jnp.ones(4), **i),
        "mosaic": lambda **i: mosaic.cache_attention(bf(1, 22, 8, 128), bf(1, 256, 2, 128), bf(1, 256, 2, 128), pos,
                                                     scale=0.1, **i),
    }
    for name, call in calls.items():
        shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), jax.eval_shape(lambda: call(interpret=i)))
                  for i in (None, True, False)]
        assert shapes[0] == shapes[1] == shapes[2], name
        flags = {e.params["interpret"] for e in jax.make_jaxpr(lambda: call(interpret=False))().jaxpr.eqns
                 if e.primitive.name == "pallas_call"}
        assert flags == {False}, name
    assert jax.eval_shape(calls["attention"]).shape == (1, 5, 4, 16)
    assert jax.eval_shape(calls["expert_matmul"]).shape == (3, 64)


@pytest.mark.parametrize("op", ["attention", "expert_matmul"])
def test_kernel_dots_follow_default_matmul_precision(op):
    """float32 kernels multiply at JAX's default matmul precision, read at trace time: "highest" -> full float32
    products (the Triton dot has no TF32 input precision), "tensorfloat32" / unset -> TF32 (as XLA's own float32
    dots on the GPU); bf16 kernels are unaffected (DEFAULT either way)."""
    sd = jax.ShapeDtypeStruct

    def make(dtype):
        if op == "attention":
            fn = lambda q_, k_, p_: attn_pallas.cache_attention(q_, k_, k_, p_, scale=0.1, interpret=False)
            return fn, (sd((1, 4, 8, 64), dtype), sd((1, 256, 2, 64), dtype), sd((1, 4), jnp.int32))
        fn = lambda x, i, w: em_pallas.expert_matmul(x, i, w, interpret=False)
        return fn, (sd((4, 64), dtype), sd((4,), jnp.int32), sd((8, 64, 128), dtype))

    tf32 = re.compile(r"tt\.dot [^\n]*inputPrecision = tf32")
    for setting, full in (("highest", True), ("float32", True), ("tensorfloat32", False), ("default", False)):
        with jax.default_matmul_precision(setting):
            fn, args = make(jnp.float32)
            precs = kernel_dot_precisions(fn, *args)
            assert precs and all(p == (jax.lax.Precision.HIGHEST,) * 2 if full else p != (jax.lax.Precision.HIGHEST,) * 2
                                 for p in precs), (setting, precs)
            ir = "\n".join(triton_modules(fn, *args))
            assert "tt.dot" in ir and bool(tf32.search(ir)) is not full, setting
            fn, args = make(jnp.bfloat16)
            assert set(kernel_dot_precisions(fn, *args)) == {(jax.lax.Precision.DEFAULT,) * 2}, setting


def test_hardware_facts():
    """Off a GPU the kernels are sized for the reference H200; shared memory per block follows the compute
    capability; one wave is a power of two of programs."""
    gpu = hardware.gpu()
    assert gpu == hardware.REFERENCE and gpu.sm_count == 132 and gpu.smem_per_block == 227 * 1024
    assert gpu.wave == 128 and dataclasses.replace(gpu, sm_count=108).wave == 64
    assert hardware.smem_per_block((8, 0)) == 163 * 1024 and hardware.smem_per_block((8, 9)) == 99 * 1024
    assert hardware.smem_per_block((5, 2)) == 48 * 1024  # unknown: the no-opt-in limit
    assert attn_pallas.num_splits(1, 8, 16384, 128) == 16 and attn_pallas.num_splits(8, 8, 16384, 128) == 2
    # block_n halved (down to 32) while pairs x dout / block_n < 2 x 128 programs
    assert em_pallas.tiles(8, 2048, 1536) == (128, 32) and em_pallas.tiles(64, 2048, 1536) == (128, 128)
