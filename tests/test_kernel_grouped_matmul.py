"""The grouped matmul (MoE prefill / training): the Pallas kernels in interpret mode equal `jax.lax.ragged_dot`
forward and backward for ragged groups, lower to Triton for CUDA, and the MoE layer's many-pair path uses them."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.kernels.grouped_matmul import grouped_matmul
from pjax.kernels.grouped_matmul import pallas as gm_pallas
from pjax.kernels.grouped_matmul import reference as gm_reference
from pjax.kernels.grouped_matmul.config import GroupedMatmulConfig
from tests.gpu_lowering import lower_for_gpu
from tests.kernel_jaxpr import pallas_kernel_names

SMALL = GroupedMatmulConfig(block_m=16, block_k=16, block_n=32, t_block_m=16, t_block_k=16, t_block_n=16)

CASES = [  # (m, k, n, group sizes): empty groups, one group taking every row, odd dims, rows past the groups
    (37, 48, 72, [0, 10, 0, 20, 7, 0]),
    (50, 33, 17, [50, 0, 0]),
    (40, 16, 80, [0, 0, 40]),
    (20, 24, 16, [3, 4]),
    (9, 40, 70, [0, 0, 0, 0]),
    (1, 32, 48, [0, 1]),
]


def _case(m, k, n, sizes, dtype, seed=0):
    rs = np.random.default_rng(seed + m + k)
    x = jnp.asarray(rs.standard_normal((m, k)), dtype)
    w = jnp.asarray(rs.standard_normal((len(sizes), k, n)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


# The default run keeps every case once, in float32 and bfloat16 by turns; --full runs each case in both dtypes.
@pytest.mark.parametrize("dtype,m,k,n,sizes", [
    pytest.param(dtype, *case, marks=() if (dtype == jnp.float32) == (i % 2 == 0) else pytest.mark.full)
    for dtype in (jnp.float32, jnp.bfloat16) for i, case in enumerate(CASES)])
def test_grouped_matmul_kernel_equals_ragged_dot(m, k, n, sizes, dtype):
    x, w, gs = _case(m, k, n, sizes, dtype)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    want, xla, t_want, kernels = _products(x, w, gs)
    if sum(sizes) < m:
        assert not np.any(np.asarray(want)[sum(sizes):])  # the contract: rows past the groups are zero
    _close(xla, want, tol)
    for got, t_got in kernels:  # several row / column / contraction tiles, and one
        _close(got[0], want, tol)
        _close(got[1], want, tol)
        _close(t_got, t_want, tol)


@jax.jit
def _products(x, w, gs):
    """ragged_dot, the switch's "xla" path, the reference's transposed product, and for each tiling (SMALL, DEFAULT)
    the kernels: ((x @ w, x @ w given transposed), transposed product). One program (op by op, each kernel call
    compiles its own)."""
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    dy = want.astype(x.dtype)
    kernels = [((gm_pallas.grouped_matmul(x, w, gs, config=config),
                 gm_pallas.grouped_matmul(x, jnp.swapaxes(w, 1, 2), gs, transpose_rhs=True, config=config)),
                gm_pallas.transposed_grouped_matmul(x, dy, gs, jnp.float32, config=config))
               for config in (SMALL, gm_pallas.DEFAULT)]
    return (want, grouped_matmul(x, w, gs, implementation="xla"),
            gm_reference.transposed_grouped_matmul(x, dy, gs, jnp.float32), kernels)


# The default run keeps each of the first four cases once, with and without transpose_rhs by turns.
@pytest.mark.parametrize("transpose_rhs,m,k,n,sizes", [
    pytest.param(t, *case, marks=() if t == (i % 2 == 1) else pytest.mark.full)
    for t in (False, True) for i, case in enumerate(CASES[:4])])
def test_grouped_matmul_gradient_equals_ragged_dot(m, k, n, sizes, transpose_rhs):
    """dx through the transposed grouped matmul, dw through the per-group transposed product (empty groups: 0)."""
    x, w, gs = _case(m, k, n, sizes, jnp.float32, seed=1)
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)
    loss = lambda impl: lambda x_, w_: jnp.sum(jnp.sin(grouped_matmul(x_, w_, gs, transpose_rhs=transpose_rhs,
                                                                       implementation=impl)))
    got, want = jax.jit(lambda x_, w_: [jax.grad(loss(impl), (0, 1))(x_, w_) for impl in ("pallas", "xla")])(x, w)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)
    assert not np.any(np.asarray(got[1])[np.asarray(sizes) == 0])


def test_grouped_matmul_switch_errors_and_lowering():
    """"pallas" runs the kernel, "xla" / "auto" off GPU do not, mixed dtypes go to the reference; malformed inputs
    are errors naming the shapes; the forward and both backward kernels lower to Triton at the GPT-OSS-20B shape."""
    x, w, gs = _case(20, 32, 48, [5, 15], jnp.float32)
    assert pallas_kernel_names(lambda: grouped_matmul(x, w, gs, implementation="pallas")) == ["pjax_grouped_matmul"]
    assert pallas_kernel_names(lambda: grouped_matmul(x, w, gs, implementation="auto")) == []
    mixed = lambda: grouped_matmul(x.astype(jnp.bfloat16), w, gs, implementation="pallas")
    assert pallas_kernel_names(mixed) == []
    with pytest.raises(ValueError, match=r"expected x \[M, K\], w \[G, K, N\], group_sizes \[G\]"):
        grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        grouped_matmul(x, w, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="grouped_matmul: implementation must be one of"):
        grouped_matmul(x, w, gs, implementation="triton")
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((32,), jnp.int32)
    lower_for_gpu(lambda x_, w_, g_: gm_pallas.grouped_matmul(x_, w_, g_, interpret=False), bf(1000, 2880),
                  bf(32, 2880, 5760), i32)
    lower_for_gpu(lambda x_, w_, g_: gm_pallas.grouped_matmul(x_, w_, g_, transpose_rhs=True, interpret=False),
                  bf(1000, 5760), bf(32, 2880, 5760), i32)
    lower_for_gpu(lambda a, b, g_: gm_pallas.transposed_grouped_matmul(a, b, g_, jnp.bfloat16, interpret=False),
                  bf(1000, 2880), bf(1000, 5760), i32)


def test_tiles_and_auto_threshold_follow_the_rows_per_group(monkeypatch):
    """Prefill-sized problems (>= 256 rows per group) take the large tiles; "auto" on a GPU runs the kernel from 16
    mean rows per group (below, ragged_dot measured faster)."""
    from pjax.kernels import dispatch
    from pjax.kernels.grouped_matmul import config
    assert config.for_shape(32768, 32) == config.LARGE and config.for_shape(1024, 32) == config.DEFAULT
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    jax.clear_caches()
    few, many = _case(40, 16, 16, [10, 10, 10, 10], jnp.float32), _case(64, 16, 16, [16, 16, 16, 16], jnp.float32)
    assert pallas_kernel_names(lambda: grouped_matmul(*few)) == []
    assert pallas_kernel_names(lambda: grouped_matmul(*many)) == ["pjax_grouped_matmul"]
    jax.clear_caches()


def test_mosaic_kernel_choice_reasons_and_lowering(monkeypatch):
    """JAX's Hopper kernel: "auto" takes it on Hopper for bf16 / f16 plain weights from 8 mean rows per group (the
    Triton kernel for packed weights, f32, transposed w; the reference below its thresholds); off Hopper "mosaic"
    is an error saying why; each unsupported input names its reason; it lowers to Mosaic GPU at the GPT-OSS-20B
    gate_up shape (layout inference, shared-memory check) on this CPU host."""
    from pjax.kernels import dispatch
    from pjax.kernels.grouped_matmul import api, mosaic
    from pjax.kernels.quantized import random_weight
    from tests.gpu_lowering import MOSAIC_CALL, export_for_gpu
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    x, w = jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((32, 64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="mosaic.*Hopper"):
        api.choose(x, w, "mosaic")
    assert api.choose(x, w, "auto") == "xla" and api.choose(x, w, "pallas") == "pallas"
    packed = random_weight(jax.random.key(0), (32, 64, 128), "mxfp4")
    assert "packed" in mosaic.unsupported_reason(x, packed)
    assert "16-bit" in mosaic.unsupported_reason(x.astype(jnp.float32), w.astype(jnp.float32))
    assert "contraction 96" in mosaic.unsupported_reason(x[:, :48].repeat(2, 1), w[:, :48].repeat(2, 1))
    assert "transpose_rhs" in mosaic.unsupported_reason(x, w, transpose_rhs=True)
    assert mosaic.unsupported_reason(x, w) is None
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(mosaic, "available", lambda: True)
    assert api.choose(x, w) == "mosaic" and api.choose(x, w, "mosaic") == "mosaic"
    assert api.choose(x[:200], w) == "xla"  # 6 rows per group
    assert api.choose(jnp.zeros((512, 64), jnp.bfloat16), packed) == "pallas"
    assert api.choose(jnp.zeros((64, 64), jnp.bfloat16), packed) == "pallas"  # the reference would unpack the stack
    assert api.choose(x.astype(jnp.float32)[:, :64].repeat(2, 0), w.astype(jnp.float32)) == "pallas"
    assert api.choose(x, w, "pallas") == "pallas"
    with pytest.raises(ValueError, match="implementation='mosaic': packed"):
        api.choose(x, packed, "mosaic")
    monkeypatch.undo()
    for rows in (1000, 333):  # its TMA takes a multiple of 8 rows: the wrapper pads 333
        text, _ = export_for_gpu(lambda x_, w_, g_: mosaic.grouped_matmul(x_, w_, g_), bf(rows, 2880),
                                 bf(32, 2880, 5760), jax.ShapeDtypeStruct((32,), jnp.int32))
        assert MOSAIC_CALL in text


def test_mosaic_path_under_vmap_and_grad(monkeypatch):
    """The Hopper kernel's wrapper under jax.vmap (its batching rule: one kernel per member, shared weights not
    copied; nested vmaps too) and jax.grad (the Triton backward), with ragged_dot standing in for the kernel on this
    CPU; and the real kernel lowers for CUDA under vmap."""
    import types

    import pjax._compat as compat
    from pjax.kernels import dispatch
    from pjax.kernels.grouped_matmul import mosaic
    from tests.gpu_lowering import MOSAIC_CALL, export_for_gpu
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    text, _ = export_for_gpu(jax.vmap(mosaic.grouped_matmul, in_axes=(0, None, 0)), bf(3, 256, 128),
                             bf(8, 128, 256), jax.ShapeDtypeStruct((3, 8), jnp.int32))
    assert MOSAIC_CALL in text
    calls = []

    def stand_in(x, w, group_sizes, **tiles):
        calls.append(x.shape)
        return jax.lax.ragged_dot(x, w, group_sizes)
    monkeypatch.setattr(compat, "ragged_dot_mgpu", lambda: types.SimpleNamespace(ragged_dot=stand_in))
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(mosaic, "available", lambda: True)
    jax.clear_caches()
    x = jax.random.normal(jax.random.key(0), (3, 50, 64)).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(jax.random.key(1), (4, 64, 128))).astype(jnp.bfloat16)
    gs = jnp.array([[10, 0, 20, 15], [45, 0, 0, 0], [5, 5, 5, 5]], jnp.int32)  # empty experts, rows past the groups
    f = lambda impl: lambda a, b, g: grouped_matmul(a, b, g, implementation=impl)
    got = jax.vmap(f("mosaic"), in_axes=(0, None, 0))(x, w, gs)
    assert calls and all(shape == (56, 64) for shape in calls)  # unbatched calls, rows padded to 8
    each = lambda a, b, g: jnp.stack([f("xla")(a[i], b[i] if b.ndim == 4 else b, g[i]) for i in range(len(a))])
    _close(got, each(x, w, gs), 1e-2)
    ws = jnp.stack([w, 2 * w, -w])
    nested = jax.vmap(jax.vmap(f("mosaic")))(x[None].repeat(2, 0), ws[None].repeat(2, 0), gs[None].repeat(2, 0))
    _close(nested[1], each(x, ws, gs), 1e-2)
    batched = lambda a, b: jax.vmap(f("mosaic"), in_axes=(0, None, 0))(a, b, gs)
    loss = lambda run: lambda a, b: jnp.sum(run(a, b).astype(jnp.float32) ** 2)
    for a, b in zip(jax.grad(loss(batched), (0, 1))(x, w), jax.grad(loss(lambda a, b: each(a, b, gs)), (0, 1))(x, w)):
        _close(a, b, 2e-2)
    jax.clear_caches()


def test_moe_many_pairs_use_the_grouped_kernel():
    """Past the few-pair threshold the MoE layer sorts pairs by expert and runs the grouped kernel ("pallas"),
    equal to the reference path, gradients included."""
    from flax import nnx

    from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec
    from pjax.models import moe as nn
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=11, hidden_size=32, intermediate_size=32, num_heads=2,
                      layers=(LayerSpec(16, 1, RopeSpec(theta=1e4), moe=True),), moe=MoeSpec(4, 2, 24))
    moe = nn.MoE(cfg, cfg.moe, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (9, 32))  # 18 pairs > 2 x 4 experts
    names = pallas_kernel_names(lambda: moe(x, implementation="pallas"))
    assert names == ["pjax_grouped_matmul"] * 2
    graph, state = nnx.split(moe)
    loss = lambda impl: lambda s, x_: jnp.sum(nnx.merge(graph, s)(x_, implementation=impl) ** 2)

    @jax.jit  # one program (eager: an op each)
    def outputs_and_gradients(s, x_):
        return [(nnx.merge(graph, s)(x_, implementation=impl), jax.grad(loss(impl), (0, 1))(s, x_))
                for impl in ("pallas", "xla")]
    (out, got), (out_ref, want) = outputs_and_gradients(state, x)
    _close(out, out_ref, 1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(a, b, 1e-4)


def test_vmap_of_a_many_pair_moe_layer_equals_each_sequence():
    """jax.vmap over sequences of a MoE layer past the few-pair threshold (its grouped matmul shares the experts
    across the batch, which ragged_dot alone cannot batch), forward and gradients, equals one call per sequence."""
    from flax import nnx

    from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec
    from pjax.models import moe as nn
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=11, hidden_size=32, intermediate_size=32, num_heads=2,
                      layers=(LayerSpec(16, 1, RopeSpec(theta=1e4), moe=True),), moe=MoeSpec(4, 2, 24))
    graph, state = nnx.split(nn.MoE(cfg, cfg.moe, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(0), (3, 9, 32))  # 18 pairs a sequence > 2 x 4 experts

    def loss(s, a, impl):
        return jnp.sum(jnp.sin(nnx.merge(graph, s)(a, implementation=impl)))

    @functools.partial(jax.jit, static_argnums=2)  # one program (eager: an op each)
    def batched_and_each(s, a, impl):
        forward = lambda a_: nnx.merge(graph, s)(a_, implementation=impl)
        return ((jax.vmap(forward)(a), jax.vmap(jax.grad(loss, (0, 1)), in_axes=(None, 0, None))(s, a, impl)),
                [(forward(a[i]), jax.grad(loss, (0, 1))(s, a[i], impl)) for i in range(len(a))])
    for impl in ("xla", "pallas"):
        (out, grads), each = batched_and_each(state, x, impl)
        for i, (out_i, grads_i) in enumerate(each):
            _close(out[i], out_i, 1e-5)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_i)):
                _close(a[i], b, 1e-4)

