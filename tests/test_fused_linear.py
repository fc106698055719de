"""The fused few-row linear kernels (`pjax.kernels.fused_linear`, interpret mode on CPU) against their jnp references,
their Triton lowering for CUDA, and the decoder layers that take them: a tiny Llama / Qwen3 target's cached forward
and greedy generation equal the XLA path's.

Inputs are chosen so that a dropped norm weight, swapped RoPE halves, a wrong multiply mode or an unrounded
activation input each move the outputs past the tolerance (each test asserts that its inputs tell those apart).
Shapes are small and not powers of two (K = 48 / 80: several K steps; N = 96 / 112: several column blocks; head_dim 96:
three programs per head).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.decode import Sampling, make_spec, prefill, spec_round
from pjax.kernels import fused_linear
from pjax.kernels.fused_linear import pallas, reference
from pjax.kernels.fused_linear.config import DEFAULT
from pjax.models.cache import init_cache
from pjax.models.drafter import DrafterConfig, init_drafter
from pjax.models.target import forward
from tests.engine_utils import FAST
from tests.gpu_lowering import triton_modules
from tests.kernel_jaxpr import kernel_dot_precisions, pallas_kernel_names

FUSED = {"pjax_norm_qkv", "pjax_norm_swiglu", "pjax_linear_residual"}
ROWS = [1, 3, 8, 16]


def _rand(rs, shape, dtype, scale=1.0, offset=0.0):
    return jnp.asarray(rs.normal(size=shape) * scale + offset, dtype)


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _ulps(a, b):
    """Distance in units in the last place of a 16-bit float dtype between same-dtype arrays a and b."""
    def ordered(x):
        bits = np.asarray(x).view(np.int16).astype(np.int32)
        return np.where(bits < 0, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


def _close(got, want, dtype, max_ulps=1):
    """float32: tight. 16-bit: within `max_ulps` of the reference run op by op (`want`: each of its casts rounds, as
    written; the kernels' sums over K run in another order), or, where a sum cancels to near zero, within an ulp of the
    output's largest value (what the rounding of the terms leaves). Compared with the reference jitted whole, XLA's excess-precision rewrites skip roundings the
    kernels make (e.g. the normalised row at one row), so the reference is not jitted here."""
    if dtype == jnp.float32:
        np.testing.assert_allclose(_f32(got), _f32(want), rtol=2e-5, atol=2e-5)
    else:
        assert got.dtype == want.dtype == dtype
        err = np.abs(_f32(got) - _f32(want))
        bad = (_ulps(got, want) > max_ulps) & (err > np.abs(_f32(want)).max() / 128)
        assert not bad.any(), (err.max(), _ulps(got, want).max())


def _precision(dtype):
    """float32 products at full precision (the kernels follow JAX's default matmul precision, as XLA does)."""
    return jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default")


def _far(a, b, dtype):
    """a and b differ by far more than `_close` allows (the inputs tell a mutation apart)."""
    return np.abs(_f32(a) - _f32(b)).max() > (1e-3 if dtype == jnp.float32 else 0.1)


def _linear_case(m, k, n, dtype, seed=0):
    rs = np.random.default_rng(seed)
    return (_rand(rs, (m, k), dtype), _rand(rs, (k,), dtype, 0.5, 1.0), _rand(rs, (k, n), dtype, k ** -0.5),
            _rand(rs, (k, n), dtype, k ** -0.5), _rand(rs, (m, n), dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_norm_linear_swiglu_residual_equal_reference(m, dtype):
    x, nw, w, w2, res = _linear_case(m, 80, 112, dtype, seed=m)
    ops = {  # (kernel, reference run op by op, max ulps in 16 bits: the activation rounds once in the kernel)
        "norm_linear": (lambda n=nw, **k: fused_linear.norm_linear(x, n, w, eps=1e-5, **k, implementation="pallas"),
                        lambda n=nw, **k: reference.norm_linear(x, n, w, eps=1e-5, **k), 1),
        "norm_swiglu": (lambda n=nw, **k: fused_linear.norm_swiglu(x, n, w, w2, eps=1e-5, **k,
                                                                   implementation="pallas"),
                        lambda n=nw, **k: reference.norm_swiglu(x, n, w, w2, eps=1e-5, **k), 3),
    }
    with _precision(dtype):
        for name, (kernel, ref, ulps) in ops.items():
            for f32m in (False, True):
                got, want = kernel(fp32_multiply=f32m), ref(fp32_multiply=f32m)
                assert got.shape == (m, 112)
                _close(got, want, dtype, max_ulps=ulps)
            assert _far(ref(n=jnp.ones_like(nw)), want, dtype)  # a dropped norm weight would fail
        got = fused_linear.linear_residual(x, w, res, implementation="pallas")
        _close(got, reference.linear_residual(x, w, res), dtype)
        assert _far(got, res, dtype) and _far(got, reference.project(x, w), dtype)


def _qkv_case(m, hd, dtype, qk_norm=False, seed=0, k=48, nh=4, nkv=2):
    rs = np.random.default_rng(seed)
    x, nw = _rand(rs, (m, k), dtype), _rand(rs, (k,), dtype, 0.5, 1.0)
    ws = [_rand(rs, (k, n * hd), dtype, k ** -0.5) for n in (nh, nkv, nkv)]
    angles = rs.uniform(0, 6.3, (m, hd // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    qk = dict(q_norm=_rand(rs, (hd,), dtype, 0.5, 1.0), k_norm=_rand(rs, (hd,), dtype, 0.5, 1.0)) if qk_norm else {}
    return (x, nw, *ws, cos, sin), qk


# every row count twice, every head geometry (head_dim 64 / 96, q/k-norm) in both dtypes: 8 of the 24 combinations
QKV_CASES = [(1, jnp.bfloat16, 64, False), (16, jnp.float32, 64, False), (3, jnp.float32, 96, False),
             (8, jnp.bfloat16, 96, False), (1, jnp.float32, 64, True), (16, jnp.bfloat16, 64, True),
             (3, jnp.bfloat16, 64, True), (8, jnp.float32, 64, False)]


@pytest.mark.parametrize("m,dtype,hd,qk_norm", QKV_CASES)
def test_norm_qkv_equals_reference(m, dtype, hd, qk_norm):
    args, qk = _qkv_case(m, hd, dtype, qk_norm, seed=m + hd)
    ref = lambda a=args, **kw: reference.norm_qkv(*a, head_dim=hd, eps=1e-5, **qk, **kw)  # noqa: E731
    with _precision(dtype):
        for f32m in (False, True):
            got = fused_linear.norm_qkv(*args, head_dim=hd, eps=1e-5, fp32_multiply=f32m, **qk, implementation="pallas")
            want = ref(fp32_multiply=f32m)
            for g, w, ulps in zip(got, want, (3, 3, 1)):  # RoPE (and q/k-norm) round once in the kernel
                assert g.shape == w.shape
                _close(g, w, dtype, max_ulps=ulps)
        # the inputs tell apart swapped RoPE halves (sin -> -sin), RoPE dropped, a dropped norm weight
        x, nw, wq, wk, wv, cos, sin = args
        for mutated in ((x, nw, wq, wk, wv, cos, -sin), (x, nw, wq, wk, wv, jnp.ones_like(cos), jnp.zeros_like(sin)),
                        (x, jnp.ones_like(nw), wq, wk, wv, cos, sin)):
            other = ref(mutated, fp32_multiply=True)
            assert _far(other[0], want[0], dtype) and _far(other[1], want[1], dtype)
        np.testing.assert_array_equal(_f32(want[2]), _f32(ref((x, nw, wq, wk, wv, cos, -sin), fp32_multiply=True)[2]))


def test_bf16_rounding_steps_are_the_reference_ones():
    """The roundings the kernels claim, checked where the products are exact (identity weights or small binary
    fractions): the normalised row equals `rms_norm`'s in each multiply mode (and the modes differ); the residual add
    rounds the product first; gate and up are rounded to bf16 before silu(gate) * up (computed in float32, rounded
    once); the residual add takes the product rounded to bf16."""
    rs = np.random.default_rng(0)
    bf = jnp.bfloat16
    k = 64
    x, nw = _rand(rs, (8, k), bf, 3.0), _rand(rs, (k,), bf, 0.5, 1.0)
    eye = jnp.eye(k, dtype=bf)
    for f32m in (False, True):
        got = fused_linear.norm_linear(x, nw, eye, eps=1e-5, fp32_multiply=f32m, implementation="pallas")
        np.testing.assert_array_equal(_f32(got), _f32(reference.rms_norm(x, nw, 1e-5, f32m)))
    assert not np.array_equal(_f32(reference.rms_norm(x, nw, 1e-5, False)), _f32(reference.rms_norm(x, nw, 1e-5, True)))
    # swiglu: rows of +-1 (rms exactly 1 with eps = 0), weights in 1/16 steps: gate and up are exact in float32 and
    # need more bits than bf16 has
    xs = jnp.asarray(rs.choice([-1.0, 1.0], (16, k)), bf)
    wg, wu = (jnp.asarray(rs.integers(-40, 41, (k, 96)) / 16, bf) for _ in range(2))
    got = _f32(fused_linear.norm_swiglu(xs, jnp.ones((k,), bf), wg, wu, eps=0.0, implementation="pallas"))
    g, u = _f32(xs) @ _f32(wg), _f32(xs) @ _f32(wu)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    r16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    rounded_first, unrounded = r16(silu(r16(g)) * r16(u)), r16(silu(g) * u)
    assert np.mean(got == rounded_first) > 0.99
    assert np.mean(got != unrounded) > 0.05  # ~9% of these elements tell the two orders apart
    res = _rand(rs, (16, 96), bf, 30.0)
    got = _f32(fused_linear.linear_residual(xs, wg, res, implementation="pallas"))
    np.testing.assert_array_equal(got, r16(_f32(res) + r16(g)))  # the product rounds before the add
    assert np.mean(got != r16(_f32(res) + g)) > 0.01  # ~3% tell them apart


def test_unsupported_shapes_fall_back_or_raise():
    """Past 16 rows, K or widths not multiples of 16, head_dim / 2 not a multiple of 16 or mixed dtypes: "pallas"
    runs the reference (no kernel), the kernel entry points raise naming the shape; bad block_n raises."""
    x, nw, w, w2, res = _linear_case(17, 48, 96, jnp.float32)
    cases = {
        "rows": lambda: fused_linear.norm_swiglu(x, nw, w, w2, eps=1e-5, implementation="pallas"),
        "K": lambda: fused_linear.linear_residual(x[:4, :40], w[:40], res[:4], implementation="pallas"),
        "dtype": lambda: fused_linear.norm_linear(x[:4], nw.astype(jnp.bfloat16), w, eps=1e-5,
                                                  implementation="pallas"),
    }
    for name, call in cases.items():
        assert pallas_kernel_names(call) == [], name
        call()
    args, _ = _qkv_case(2, 16, jnp.float32)
    assert pallas_kernel_names(lambda: fused_linear.norm_qkv(*args, head_dim=16, eps=1e-5,
                                                             implementation="pallas")) == []
    with pytest.raises(ValueError, match="17 rows: at most 16"):
        pallas.norm_swiglu(x, nw, w, w2, eps=1e-5)
    with pytest.raises(ValueError, match="K=40"):
        pallas.linear_residual(x[:4, :40], w[:40], res[:4])
    with pytest.raises(ValueError, match="head_dim=16"):
        pallas.norm_qkv(*args, head_dim=16, eps=1e-5)
    with pytest.raises(ValueError, match="block_n=48"):
        pallas.linear_residual(x[:4], w, res[:4], block_n=48)
    with pytest.raises(ValueError, match=r"expected residual \[M=4, 96\]"):
        fused_linear.linear_residual(x[:4], w, res[:3])
    for impl in ("xla", "auto"):  # off a GPU "auto" is "xla"
        assert pallas_kernel_names(lambda: fused_linear.linear_residual(x[:4], w, res[:4], implementation=impl)) == []


def test_gradients_are_the_references():
    """The ops are differentiable through the kernels (their VJP is the reference's), as a few-row training step
    through layers that take them needs: gradients equal the XLA path's."""
    x, nw, w, w2, res = _linear_case(3, 48, 96, jnp.float32)
    args, qk = _qkv_case(3, 64, jnp.float32, qk_norm=True)
    losses = {
        "norm_swiglu": (lambda i: lambda x_, n_, g_: jnp.sum(jnp.sin(fused_linear.norm_swiglu(
            x_, n_, g_, w2, eps=1e-5, implementation=i))), (x, nw, w)),
        "linear_residual": (lambda i: lambda x_, w_, r_: jnp.sum(jnp.sin(fused_linear.linear_residual(
            x_, w_, r_, implementation=i))), (x, w, res)),
        "norm_qkv": (lambda i: lambda x_, q_, qn_: sum(jnp.sum(jnp.sin(o)) for o in fused_linear.norm_qkv(
            x_, args[1], q_, *args[3:], head_dim=64, eps=1e-5, q_norm=qn_, k_norm=qk["k_norm"], implementation=i)),
                     (args[0], args[2], qk["q_norm"])),
    }
    with jax.default_matmul_precision("highest"):
        for name, (loss, primals) in losses.items():
            assert pallas_kernel_names(jax.grad(loss("pallas"), (0, 1, 2)), *primals), name
            for got, want in zip(jax.grad(loss("pallas"), (0, 1, 2))(*primals),
                                 jax.grad(loss("xla"), (0, 1, 2))(*primals)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("m", [1, 16])
def test_kernels_lower_to_triton(m):
    """The kernels lower for CUDA at the benchmark's 445M Llama shape (bf16), a Qwen3-8B-like q/k-norm shape and a
    float32 one (block shapes, power-of-two array ops, the dot's 16-row minimum), and the float32 dots take JAX's
    default matmul precision."""
    sd = jax.ShapeDtypeStruct
    bf = lambda *s: sd(s, jnp.bfloat16)  # noqa: E731
    f32 = lambda *s: sd(s, jnp.float32)  # noqa: E731
    h, inter, nh, hd = 1024, 3840, 16, 64
    triton_modules(lambda *a: pallas.norm_qkv(*a, head_dim=hd, eps=1e-5, interpret=False), bf(m, h), bf(h),
                   bf(h, nh * hd), bf(h, nh * hd), bf(h, nh * hd), f32(m, hd // 2), f32(m, hd // 2))
    triton_modules(lambda *a: pallas.norm_qkv(*a[:7], head_dim=128, eps=1e-6, q_norm=a[7], k_norm=a[8],
                                              interpret=False),
                   bf(m, 4096), bf(4096), bf(4096, 4096), bf(4096, 1024), bf(4096, 1024), f32(m, 64), f32(m, 64),
                   bf(128), bf(128))
    triton_modules(lambda *a: pallas.norm_swiglu(*a, eps=1e-5, interpret=False), bf(m, h), bf(h), bf(h, inter),
                   bf(h, inter))
    triton_modules(lambda *a: pallas.linear_residual(*a, interpret=False), bf(m, inter), bf(inter, h), bf(m, h))
    fn = lambda *a: pallas.norm_linear(*a, eps=1e-5, fp32_multiply=True, interpret=False)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        triton_modules(fn, f32(m, 256), f32(256), f32(256, 96))
        assert set(kernel_dot_precisions(fn, f32(m, 256), f32(256), f32(256, 96))) == {(jax.lax.Precision.HIGHEST,) * 2}


def test_tiles_cover_the_gpu():
    """At the 445M shape the column tiles shrink to min_block_n (32, measured fastest) toward two programs per SM,
    to 16 (the dot's minimum) when asked, whole heads with q/k-norm, and the pipelined tiles fit in shared memory."""
    assert pallas.column_block(3840) == 32  # gate / up: 120 programs
    assert pallas.column_block(1024) == 32  # o / down: 32 programs, the narrowest tile
    assert pallas.half_block(32, 16 + 2 * 16, False) == 32  # q/k/v: 48 programs of 2 x 32 columns
    narrow = dataclasses.replace(DEFAULT, min_block_n=16)
    assert pallas.column_block(3840, narrow) == 16 and pallas.half_block(32, 48, False, narrow) == 16
    assert pallas.half_block(64, 48, True) == 64  # q/k-norm: whole heads
    bk = pallas.block_k(3840, 16, 32, 2)
    assert 3840 % bk == 0 and DEFAULT.stages * bk * (16 + 32) * 2 <= 227 * 1024 - DEFAULT.smem_reserve


# ----------------------------------------------------------------------------------------------- the model path


def _llama(qk_norm=False, layers=2, mlp_act="silu"):
    """A float32 target whose layers the kernels take (head_dim 32: RoPE halves of 16), random norm weights."""
    cfg = ModelConfig("qwen3" if qk_norm else "llama", 97, 64, 96, 4,
                      tuple(LayerSpec(32, 2, RopeSpec(theta=10000.0)) for _ in range(layers)), rms_norm_eps=1e-5,
                      qk_norm=qk_norm, mlp_act=mlp_act)
    target = pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    rs = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a * jnp.asarray(rs.uniform(0.5, 1.5, a.shape), a.dtype) if "norm" in jax.tree_util.keystr(p)
        else a, target.params)
    return dataclasses.replace(target, params=params)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_forward_pallas_equals_xla(qk_norm):
    target = _llama(qk_norm)
    cache = init_cache(target.config, 2, 32, jnp.float32)
    tokens = jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32)
    positions = jnp.array([[4, 5, 6], [10, 11, 12]], jnp.int32)
    run = lambda impl: lambda t, c: forward(t, tokens, positions, c, implementation=impl)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want, got = jax.jit(run("xla"))(target, cache), jax.jit(run("pallas"))(target, cache)
        np.testing.assert_allclose(np.asarray(got.hidden), np.asarray(want.hidden), rtol=1e-4, atol=1e-5)
        for a, b in zip(got.cache, want.cache):
            np.testing.assert_allclose(np.asarray(a.k), np.asarray(b.k), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(a.v), np.asarray(b.v), rtol=1e-4, atol=1e-5)
        assert FUSED <= set(pallas_kernel_names(run("pallas"), target, cache))
        assert not FUSED & set(pallas_kernel_names(run("auto"), target, cache))  # off a GPU
        big = jnp.zeros((2, 9), jnp.int32)  # 18 rows: XLA's products, the attention kernel still runs
        names = pallas_kernel_names(lambda t, c: forward(t, big, big, c, implementation="pallas"), target, cache)
        assert not FUSED & set(names) and "pjax_cache_attention" in names
    gelu = _llama(mlp_act="gelu_tanh")  # a layer the kernels do not cover
    assert not FUSED & set(pallas_kernel_names(run("pallas"), gelu, init_cache(gelu.config, 2, 32, jnp.float32)))


def _head(target):
    """A 2-layer random P-EAGLE head whose second layer (a DecoderLayer) the kernels take."""
    layer = ModelConfig("llama", 97, 64, 128, 4, tuple(LayerSpec(32, 2, RopeSpec(theta=10000.0)) for _ in range(2)),
                        rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=64, draft_vocab_size=97, mask_token_id=96,
                        aux_layer_ids=(0, 1, 2))
    return init_drafter(cfg, jax.random.key(2), jnp.float32, scale=0.2)


def test_generate_greedy_pallas_equals_xla():
    """Greedy generation (float32) with the fused kernels equals the XLA path's for plain and parallel drafting; the
    decode round runs them (2 rows: verify 2 x 4, drafting 2 x 6 rows, both within 16)."""
    target = _llama()
    head = _head(target)
    prompts = [[5, 17, 3, 9], [9, 1, 44, 60, 2, 71]]
    for drafting in ("none", "parallel"):
        kw = dict(max_new_tokens=10, num_speculative_tokens=3, drafting=drafting, compiler_options=FAST)
        drafter = head if drafting == "parallel" else None
        want = pjax.generate(target, drafter, prompts, implementation="xla", **kw).tokens
        assert pjax.generate(target, drafter, prompts, implementation="pallas", **kw).tokens == want
    spec = make_spec(target, head, max_new_tokens=10, num_speculative_tokens=3, drafting="parallel",
                     implementation="pallas")
    sampling = Sampling(jnp.ones((2,)), jnp.zeros((2,), jnp.int32), jnp.ones((2,)), jnp.zeros((2,), jnp.uint32))
    state = jax.eval_shape(lambda t, d: prefill(t, d, jnp.ones((2, 4), jnp.int32), jnp.full((2,), 4, jnp.int32),
                                                sampling, spec=spec, capacity=32), target, head)
    names = pallas_kernel_names(lambda *a: spec_round(*a, spec=spec), target, head, state, sampling)
    # 2 target layers + the head's second layer, each 1 norm_qkv, 1 norm_swiglu, 2 linear_residual
    assert sorted(n for n in names if n in FUSED) == sorted(["pjax_norm_qkv"] * 3 + ["pjax_norm_swiglu"] * 3
                                                            + ["pjax_linear_residual"] * 6)
