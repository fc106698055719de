"""Low-bit weights kept packed (`pjax.kernels.quantized`): the jnp dequantisation equals the checkpoint loader's
(transformers-tested) one; the expert-matmul and grouped-matmul kernels dequantising MXFP4 / FP8 tiles in registers
(interpret mode) equal dequantise-then-matmul, for expert stacks, ragged groups and a dense FP8 linear (one
expert), and lower to Triton."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pjax.checkpoint.quant import dequant_fp8_block, dequant_mxfp4
from pjax.kernels.expert_matmul import expert_matmul
from pjax.kernels.expert_matmul import pallas as em_pallas
from pjax.kernels.grouped_matmul import grouped_matmul
from pjax.kernels.grouped_matmul import pallas as gm_pallas
from pjax.kernels.grouped_matmul.config import GroupedMatmulConfig
from pjax.kernels.quantized import QuantizedWeight, dequantize
from tests.gpu_lowering import lower_for_gpu
from tests.kernel_jaxpr import pallas_kernel_names


def mxfp4_weight(rs, e, din, dout):
    return QuantizedWeight(jnp.asarray(rs.integers(0, 256, (e, dout, din // 2), dtype=np.uint8)),
                           jnp.asarray(rs.integers(118, 132, (e, dout, din // 32), dtype=np.uint8)))


def fp8_weight(rs, e, din, dout, block):
    data = (rs.standard_normal((e, dout, din)) * 40).astype(ml_dtypes.float8_e4m3fn)
    scales = rs.random((e, -(-dout // block[0]), -(-din // block[1]))).astype(np.float32) / 40
    return QuantizedWeight(jnp.asarray(data), jnp.asarray(scales), "fp8", block)


def test_dequantize_equals_the_checkpoint_loader():
    rs = np.random.default_rng(0)
    w = mxfp4_weight(rs, 3, 64, 40)
    blocks = np.asarray(w.data).reshape(3, 40, 2, 16)
    want = np.stack([dequant_mxfp4(blocks[e], np.asarray(w.scales)[e]).T for e in range(3)])
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)
    assert w.shape == (3, 64, 40) and w.nbytes == 3 * 40 * (32 + 2)
    w = fp8_weight(rs, 2, 300, 200, (128, 128))  # partial blocks on both axes
    want = dequant_fp8_block(np.asarray(w.data), np.asarray(w.scales), (128, 128)).transpose(0, 2, 1)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)


LOWBIT_SHAPES = [(1, 64, 48, 4, 1, jnp.bfloat16), (8, 96, 32, 3, 4, jnp.float32), (24, 256, 128, 16, 8, jnp.bfloat16),
                 (100, 32, 64, 40, 1, jnp.float32)]


# The default run keeps each format with each dtype, with and without repeated rows, and every shape once (MXFP4 on the
# first two, FP8 on the last two); --full runs every format on every shape.
@pytest.mark.parametrize("fmt,p,din,dout,e,repeat,dtype", [
    pytest.param(fmt, *shape, marks=() if (fmt == "mxfp4") == (i < 2) else pytest.mark.full)
    for fmt in ("mxfp4", "fp8") for i, shape in enumerate(LOWBIT_SHAPES)])
def test_lowbit_expert_kernel_equals_dequantise_then_matmul(fmt, p, din, dout, e, repeat, dtype):
    rs = np.random.default_rng(p + din)
    w = mxfp4_weight(rs, e, din, dout) if fmt == "mxfp4" else fp8_weight(rs, e, din, dout, (32, 32))
    x = jnp.asarray(rs.standard_normal((p // repeat, din)), dtype)
    ids = jnp.asarray(rs.integers(0, e, p), jnp.int32)
    rows = np.repeat(np.asarray(x, np.float32), repeat, 0)
    want = np.einsum("pf,pfo->po", rows, np.asarray(dequantize(w))[np.asarray(ids)])
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    c = jnp.asarray(rs.standard_normal((p, dout)), jnp.float32)  # a linear loss: dx does not depend on rounding
    loss = lambda impl: lambda x_: jnp.sum(c * expert_matmul(x_, ids, w, repeat=repeat, implementation=impl))
    # one program (op by op, each op compiles its own): (output, dx) of each implementation
    (out, dx), (out_pallas, dx_pallas) = jax.jit(lambda x_: [
        (expert_matmul(x_, ids, w, repeat=repeat, implementation=impl), jax.grad(loss(impl))(x_))
        for impl in ("xla", "pallas")])(x)
    for got in (out, out_pallas):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())
    assert pallas_kernel_names(lambda: expert_matmul(x, ids, w, repeat=repeat, implementation="pallas")) == [
        f"pjax_expert_matmul_{fmt}"]
    dx = np.asarray(dx, np.float32)
    np.testing.assert_allclose(np.asarray(dx_pallas, np.float32), dx, rtol=tol, atol=tol * np.abs(dx).max())


def test_fp8_dense_linear_is_one_expert_and_kernels_lower():
    """A dense FP8 linear [din, dout] is the expert matmul with one expert (every row's id 0): 128 x 128 blocks with
    partial tiles; both low-bit kernels lower to Triton at GPT-OSS-20B / Qwen3-30B-A3B shapes."""
    rs = np.random.default_rng(3)
    w = fp8_weight(rs, 1, 384, 320, (128, 128))
    x = jnp.asarray(rs.standard_normal((5, 384)), jnp.bfloat16)
    ids = jnp.zeros((5,), jnp.int32)
    want = np.asarray(x, np.float32) @ np.asarray(dequantize(w))[0]
    got = np.asarray(expert_matmul(x, ids, w, implementation="pallas"), np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    sd = jax.ShapeDtypeStruct
    mx = QuantizedWeight(sd((32, 5760, 1440), jnp.uint8), sd((32, 5760, 90), jnp.uint8))
    lower_for_gpu(lambda x_, i, w_: em_pallas.expert_matmul(x_, i, w_, repeat=4, interpret=False),
                  sd((1, 2880), jnp.bfloat16), sd((4,), jnp.int32), mx)
    f8 = QuantizedWeight(sd((128, 1536, 2048), jnp.float8_e4m3fn), sd((128, 12, 16), jnp.float32), "fp8", (128, 128))
    lower_for_gpu(lambda x_, i, w_: em_pallas.expert_matmul(x_, i, w_, repeat=8, interpret=False),
                  sd((8, 2048), jnp.bfloat16), sd((64,), jnp.int32), f8)
    odd = QuantizedWeight(jnp.zeros((1, 16, 24), jnp.uint8), jnp.zeros((1, 16, 1), jnp.uint8))  # din 48
    assert "multiples of 32" in em_pallas.unsupported_reason(jnp.ones((2, 48), jnp.bfloat16), odd)


def test_auto_takes_the_kernel_where_measured_faster_and_tiles_fit():
    """"auto" (on a GPU) runs the low-bit expert kernel for MXFP4 weights; FP8 runs the reference. Low-bit tiles:
    MXFP4 steps of mxfp4_block_k inputs with smaller tail steps for the rest of din, FP8 k tiles inside the input
    block, fewer unrolled FP8 k tiles as the padded pairs grow (shared memory)."""
    rs = np.random.default_rng(0)
    assert em_pallas.measured_faster(jnp.zeros((2, 64, 32)))
    assert em_pallas.measured_faster(mxfp4_weight(rs, 2, 64, 128))
    assert em_pallas.measured_faster(mxfp4_weight(rs, 2, 128, 64))
    assert not em_pallas.measured_faster(fp8_weight(rs, 2, 128, 256, (128, 128)))
    sd = jax.ShapeDtypeStruct
    w = QuantizedWeight(sd((32, 5760, 1440), jnp.uint8), sd((32, 5760, 90), jnp.uint8))
    assert em_pallas.k_plan(2880, w, 16) == (256, 1, 11, ((2816, 64),))  # 11 steps of 256, then 64
    w96 = QuantizedWeight(sd((2, 8, 48), jnp.uint8), sd((2, 8, 3), jnp.uint8))
    assert em_pallas.k_plan(96, w96, 16) == (64, 1, 1, ((64, 32),))
    f8 = fp8_weight(rs, 1, 384, 64, (128, 128))
    assert em_pallas.k_plan(384, f8, 16) == (128, 3, 1, ())
    assert em_pallas.k_steps(2048, fp8_weight(rs, 1, 2048, 16, (128, 128)), 64) == 1
    assert em_pallas.k_tile(96, fp8_weight(rs, 1, 96, 64, (32, 32))) == 32


GROUPED = GroupedMatmulConfig(block_m=16, block_k=32, block_n=32)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_lowbit_grouped_kernel_equals_dequantise_then_ragged_dot(fmt):
    """Ragged groups (an empty expert, one expert taking most rows, rows past the groups), odd output width: the
    grouped kernel dequantising per tile equals ragged_dot over the dequantised stack, forward and dx (through the
    dequantised stack); small tiles and the default ones."""
    rs = np.random.default_rng(7)
    e, k, n, m = 4, 96, 40, 45
    w = mxfp4_weight(rs, e, k, n) if fmt == "mxfp4" else fp8_weight(rs, e, k, n, (64, 64))  # partial blocks
    x = jnp.asarray(rs.standard_normal((m, k)), jnp.float32)
    gs = jnp.asarray([5, 0, 31, 6], jnp.int32)  # 42 rows: 3 past the groups
    want = jax.lax.ragged_dot(x, dequantize(w), gs, preferred_element_type=jnp.float32)
    c = jnp.asarray(rs.standard_normal((m, n)), jnp.float32)
    dx = jax.grad(lambda x_: jnp.sum(c * grouped_matmul(x_, w, gs, implementation="xla")))(x)
    got = jax.jit(lambda x_: [gm_pallas.grouped_matmul(x_, w, gs, config=cfg) for cfg in (GROUPED, None)] + [
        jax.grad(lambda a: jnp.sum(c * grouped_matmul(a, w, gs, implementation="pallas")))(x_)])(x)
    for out in got[:2]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.any(np.asarray(got[0])[42:])
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(dx), rtol=1e-5, atol=1e-5 * np.abs(dx).max())
    assert pallas_kernel_names(lambda: grouped_matmul(x, w, gs, implementation="pallas")) == [
        f"pjax_grouped_matmul_{fmt}"]


def test_lowbit_grouped_kernel_errors_and_lowering():
    """A packed stack takes no transpose_rhs; tiles the format cannot take run the reference; the kernels lower to
    Triton at the GPT-OSS-20B (MXFP4) and Qwen3-30B-A3B (FP8) expert shapes, and with partial FP8 tiles."""
    rs = np.random.default_rng(1)
    w = mxfp4_weight(rs, 2, 64, 32)
    x, gs = jnp.ones((8, 64), jnp.float32), jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="QuantizedWeight is .G, K, N.*no transpose_rhs"):
        gm_pallas.grouped_matmul(x, w, gs, transpose_rhs=True)
    assert "multiples of 32" in gm_pallas.unsupported_reason(x, w, GroupedMatmulConfig(block_k=16))
    assert "must divide the input block" in gm_pallas.unsupported_reason(
        x, fp8_weight(rs, 2, 64, 32, (32, 32)), GroupedMatmulConfig(block_k=64))
    sd = jax.ShapeDtypeStruct
    mx = QuantizedWeight(sd((32, 5760, 1440), jnp.uint8), sd((32, 5760, 90), jnp.uint8))
    lower_for_gpu(lambda x_, g_, w_: gm_pallas.grouped_matmul(x_, w_, g_, interpret=False),
                  sd((1024, 2880), jnp.bfloat16), sd((32,), jnp.int32), mx)
    f8 = QuantizedWeight(sd((128, 1536, 2048), jnp.float8_e4m3fn), sd((128, 12, 16), jnp.float32), "fp8", (128, 128))
    lower_for_gpu(lambda x_, g_, w_: gm_pallas.grouped_matmul(x_, w_, g_, interpret=False),
                  sd((8192, 2048), jnp.bfloat16), sd((128,), jnp.int32), f8)
    partial = QuantizedWeight(sd((8, 136, 200), jnp.float8_e4m3fn), sd((8, 2, 2), jnp.float32), "fp8", (128, 128))
    lower_for_gpu(lambda x_, g_, w_: gm_pallas.grouped_matmul(x_, w_, g_, interpret=False),  # masked FP8 tiles
                  sd((100, 200), jnp.bfloat16), sd((8,), jnp.int32), partial)
