"""FP8 block-scaled and MXFP4 dequantisation at load, against transformers' own dequantisation functions
and independent numpy decodings of the on-disk layouts."""
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers as tf
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import pjax
from pjax.checkpoint.safetensors import Checkpoint, SafetensorsFile, save_file
from pjax.checkpoint.hf import TensorSource
from pjax.models.target import consistent_target, forward, target_logits
from tests.hf_utils import randomize

FP8_MAX = 448.0


def quantize_fp8_blocks(w, block=(128, 128)):
    """Independent block quantiser: w [..., R, C] float32 -> (float8_e4m3fn [..., R, C], scale_inv
    [..., ceil(R/br), ceil(C/bc)] float32) with scale_inv = amax(block) / 448 (partial edge blocks)."""
    br, bc = block
    *lead, r, c = w.shape
    gr, gc = -(-r // br), -(-c // bc)
    q = np.zeros(w.shape, np.float32)
    s = np.ones((*lead, gr, gc), np.float32)
    for i in range(gr):
        for j in range(gc):
            blk = w[..., i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = np.abs(blk).max(axis=(-2, -1))
            s[..., i, j] = np.where(amax > 0, amax / FP8_MAX, 1.0)
            q[..., i * br:(i + 1) * br, j * bc:(j + 1) * bc] = blk / s[..., i, j, None, None]
    return q.astype(ml_dtypes.float8_e4m3fn), s


def dequant_loop(q, s, block=(128, 128)):
    """Reference dequantisation, one element block at a time."""
    br, bc = block
    out = np.asarray(q, np.float32).copy()
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            out[..., i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= s[..., i, j, None, None]
    return out


def source(tmp_path, tensors, quant):
    save_file(tensors, tmp_path / "model.safetensors")
    return TensorSource(Checkpoint(tmp_path), quant)


FP8_CFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.mark.parametrize("shape", [(256, 384), (2, 256, 128)])
def test_fp8_block_matches_transformers(tmp_path, shape):
    w = np.random.default_rng(0).normal(0, 0.05, shape).astype(np.float32)
    q, s = quantize_fp8_blocks(w)
    src = source(tmp_path, {"x.weight": q, "x.weight_scale_inv": s}, FP8_CFG)
    got = src.read("x.weight", shape)
    ref = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn),
                                              torch.from_numpy(s), output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got, dequant_loop(q, s))
    assert np.abs(got - w).max() <= 0.07 * np.abs(w).max()  # it is a quantisation of w


def test_fp8_partial_blocks_and_ue8m0_scales(tmp_path):
    """Edge blocks of non-multiple shapes use scale[r // 128, c // 128]; uint8 (UE8M0) scales = 2**(b-127)."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (200, 300)).astype(np.float32)
    q, s = quantize_fp8_blocks(w)
    e8 = rng.integers(118, 130, (2, 2)).astype(np.uint8)
    q2 = rng.normal(0, 1, (256, 256)).astype(ml_dtypes.float8_e4m3fn)
    src = source(tmp_path, {"a.weight": q, "a.weight_scale_inv": s, "b.weight": q2, "b.weight_scale_inv": e8},
                 FP8_CFG)
    np.testing.assert_array_equal(src.read("a.weight", (200, 300)), dequant_loop(q, s))
    ref = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(q2.view(np.uint8)).view(torch.float8_e4m3fn),
                                              torch.from_numpy(e8), output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(src.read("b.weight", (256, 256)), ref)
    np.testing.assert_array_equal(ref, dequant_loop(q2, 2.0 ** (e8.astype(np.float32) - 127)))


def test_fp8_scale_shape_is_checked(tmp_path):
    q, s = quantize_fp8_blocks(np.ones((256, 256), np.float32))
    src = source(tmp_path, {"x.weight": q, "x.weight_scale_inv": s[:1]}, FP8_CFG)
    with pytest.raises(pjax.CheckpointError, match=r"x.weight_scale_inv.*\[1, 2\], expected \[2, 2\]"):
        src.read("x.weight", (256, 256))


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    """A tiny Llama saved by transformers, then rewritten as a fine-grained FP8 checkpoint (every
    projection quantised in 128x128 blocks, lm_head kept dense via modules_to_not_convert)."""
    path = tmp_path_factory.mktemp("llama")
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    randomize(tf.LlamaForCausalLM(cfg).float().eval()).save_pretrained(path)
    f = SafetensorsFile(path / "model.safetensors")
    dense = {k: np.array(f.get(k)) for k in f.keys()}
    tensors, expect = {}, {}
    for k, v in dense.items():
        if k.endswith("_proj.weight"):
            tensors[k], tensors[k + "_scale_inv"] = quantize_fp8_blocks(v)
            expect[k] = dequant_loop(*quantize_fp8_blocks(v))
        else:
            tensors[k] = expect[k] = v
    save_file(tensors, path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = dict(FP8_CFG, modules_to_not_convert=["lm_head"])
    (path / "config.json").write_text(json.dumps(hf))
    return path, tensors, expect


def test_fp8_checkpoint_loads_dequantised(fp8_llama):
    path, _, expect = fp8_llama
    target = pjax.load_target(path, dtype=jnp.float32)
    p = target.params
    np.testing.assert_array_equal(p["layers"][1]["mlp"]["down_proj"]["kernel"],
                                  expect["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(p["layers"][0]["self_attn"]["k_proj"]["kernel"],
                                  expect["model.layers.0.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(p["lm_head"]["kernel"], expect["lm_head.weight"].T)
    assert sum(x.size for x in jax.tree.leaves(p)) == sum(v.size for v in expect.values())


def test_fp8_modules_to_not_convert_is_honoured(fp8_llama, tmp_path):
    """A module listed in modules_to_not_convert that is stored FP8 is an error naming it."""
    path, tensors, _ = fp8_llama
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.*.mlp"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(pjax.CheckpointError, match=r"model.layers.0.mlp.\w+_proj'? is listed in .*modules_to_not"):
        pjax.load_target(tmp_path, dtype=jnp.float32)


def decode_e2m1(nibble):
    """Independent FP4 E2M1 decoding: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; e=0 subnormal."""
    s, e, m = nibble >> 3, (nibble >> 1) & 3, nibble & 1
    mag = np.where(e == 0, 0.5 * m, (1 + 0.5 * m) * 2.0 ** (e.astype(np.float64) - 1))
    return np.where(s == 1, -mag, mag)


def test_mxfp4_matches_transformers(tmp_path):
    rng = np.random.default_rng(2)
    e, dout, din = 3, 8, 64
    blocks = rng.integers(0, 256, (e, dout, din // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (e, dout, din // 32), dtype=np.uint8)
    src = source(tmp_path, {"w_blocks": blocks, "w_scales": scales}, {"quant_method": "mxfp4"})
    got = src.read_mxfp4("w", (e, din, dout))  # runtime layout [E, in, out]
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(got, ref.numpy())
    # independent: element 2j of a block row is the low nibble of byte j, element 2j+1 the high one
    vals = np.stack([decode_e2m1(blocks & 15), decode_e2m1(blocks >> 4)], -1).reshape(e, dout, din // 32, 32)
    vals = vals * 2.0 ** (scales.astype(np.float64)[..., None] - 127)
    np.testing.assert_array_equal(got, vals.reshape(e, dout, din).transpose(0, 2, 1).astype(np.float32))
    with pytest.raises(pjax.CheckpointError, match=r"w_blocks.*shape \[3, 8, 2, 16\], expected \[3, 4, 2, 16\]"):
        src.read_mxfp4("w", (e, din, 4))


# ------------------------------------------------------------------------------------------- native (packed) weights
GPT_OSS_TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=6, swiglu_limit=7.0, max_position_embeddings=256)
QWEN3_MOE_TINY = dict(vocab_size=97, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True)


def _rewrite(path, tensors, quant):
    save_file(tensors, path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(hf))


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_moe"])
def quantised_moe(request, tmp_path_factory):
    """(family, checkpoint dir, tensors): a tiny GPT-OSS with MXFP4 experts, or a tiny Qwen3-MoE with every
    projection FP8 block-quantised (128 x 128)."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if request.param == "gpt_oss":
        randomize(tf.GptOssForCausalLM(tf.GptOssConfig(**GPT_OSS_TINY)).float().eval(), std=0.2).save_pretrained(path)
        f = SafetensorsFile(path / "model.safetensors")
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
        for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, din, dout = tensors.pop(k).shape
            tensors[k + "_blocks"] = rng.integers(0, 256, (e, dout, din // 32, 16), dtype=np.uint8)
            tensors[k + "_scales"] = rng.integers(121, 125, (e, dout, din // 32), dtype=np.uint8)
        quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                     "model.layers.*.mlp.router", "lm_head"]}
    else:
        randomize(tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**QWEN3_MOE_TINY)).float().eval(),
                  std=0.2).save_pretrained(path)
        f = SafetensorsFile(path / "model.safetensors")
        tensors = {}
        for k in f.keys():
            v = np.array(f.get(k))
            if k.endswith("_proj.weight"):
                tensors[k], tensors[k + "_scale_inv"] = quantize_fp8_blocks(v)
            else:
                tensors[k] = v
        quant = dict(FP8_CFG, modules_to_not_convert=["lm_head"])
    _rewrite(path, tensors, quant)
    return request.param, path, tensors


def _experts(target):
    return [layer["mlp"][n] for layer in target.params["layers"].values() for n in ("gate_up", "down")]


def test_native_forward_equals_dequantised(quantised_moe, request):
    """Packed experts (uint8 MXFP4 codes + E8M0 scales / float8_e4m3fn + float32 block scales) give the dequantised
    target's logits within bf16 tolerance: a prompt (grouped path) and few-token verify / decode shapes through
    both the reference and the low-bit kernels (interpret mode). The default run: verify rows through the reference
    (decode rows: test_native_greedy_speculative_equals_plain_greedy; the low-bit kernels against dequantise-then-
    matmul: tests/test_kernel_lowbit.py); --full: both shapes through both."""
    from pjax.kernels.quantized import QuantizedWeight
    family, path, _ = quantised_moe
    plain = pjax.load_target(path, dtype=jnp.bfloat16)  # the CPU default: dequantised
    native = pjax.load_target(path, dtype=jnp.bfloat16, weights="native")
    assert not any(isinstance(w, QuantizedWeight) for w in _experts(plain))
    packed = _experts(native)
    assert all(isinstance(w, QuantizedWeight) and w.format == ("mxfp4" if family == "gpt_oss" else "fp8")
               for w in packed)
    assert sum(w.nbytes for w in packed) < 0.6 * sum(w.nbytes for w in _experts(plain))
    assert native.astype(jnp.bfloat16).params["layers"][0]["mlp"]["gate_up"].data.dtype == packed[0].data.dtype
    assert consistent_target(native) is native
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 24)), jnp.int32)
    full = request.config.getoption("--full")
    rows = (1, 3) if full else (3,)  # decode / verify rows: the few-pair expert matmul
    impls = ("xla", "pallas") if full else ("xla",)

    @jax.jit  # one program (eager, every op compiles on its own; a program per forward, each compiles alone)
    def outputs(plain, native, ids):
        run = lambda target, t, impl: forward(target, ids[:, :t], jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32),
                                                                                   (2, t)),
                                              implementation=impl).hidden.astype(jnp.float32)
        return (target_logits(plain, ids), target_logits(native, ids),
                [(run(plain, t, "xla"), [run(native, t, impl) for impl in impls]) for t in rows])
    want, got, by_rows = outputs(plain, native, ids)
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=0.05 * np.abs(want).max())
    for want, gots in by_rows:
        for got in gots:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                       atol=0.03 * float(jnp.abs(want).max()))


def test_native_greedy_speculative_equals_plain_greedy(quantised_moe, request):
    """With packed experts, P-EAGLE and EAGLE-3 greedy output equals plain greedy decoding of the same target (the
    default run: P-EAGLE on MXFP4 experts, EAGLE-3 on FP8 ones; --full: both on both)."""
    from tests.engine_utils import FAST, PROMPTS, make_drafter
    family, path, _ = quantised_moe
    target = pjax.load_target(path, dtype=jnp.float32, weights="native")
    drafter = make_drafter(target)
    run = lambda drafting: pjax.generate(target, drafter, PROMPTS, max_new_tokens=8, num_speculative_tokens=3,
                                         drafting=drafting, compiler_options=FAST).tokens
    plain = run("none")
    modes = ("parallel", "sequential") if request.config.getoption("--full") else (
        "parallel" if family == "gpt_oss" else "sequential",)
    for drafting in modes:
        assert run(drafting) == plain, drafting


def test_native_malformed_blocks_and_scales_are_named(quantised_moe, tmp_path):
    """Wrong shape, wrong dtype or a missing scale in a packed checkpoint: a CheckpointError naming the tensor (and
    an unknown `weights` choice naming the flag)."""
    family, path, tensors = quantised_moe
    cfg = json.loads((path / "config.json").read_text())
    if family == "gpt_oss":
        name = "model.layers.1.mlp.experts.down_proj"
        cases = [({name + "_scales": tensors[name + "_scales"][:, 1:]}, rf"{name}_scales.*has shape"),
                 ({name + "_blocks": tensors[name + "_blocks"].astype(np.int8)}, rf"{name}_blocks.*dtype int8"),
                 ({name + "_scales": None}, rf"{name}_scales.*is missing")]
    else:
        name = "model.layers.1.mlp.experts.2.up_proj.weight"
        scale = name + "_scale_inv"
        cases = [({scale: tensors[scale][:1, :1][:, :0]}, rf"{scale}.*has shape \[1, 0\], expected \[1, 1\]"),
                 ({name: np.asarray(tensors[name], np.float32).astype(ml_dtypes.float8_e5m2)},
                  rf"{name}.*dtype float8_e5m2, expected float8_e4m3fn"),
                 ({scale: None}, rf"{name}'? has no '{scale}'")]
    for change, message in cases:
        bad = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        save_file(bad, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(pjax.CheckpointError, match=message):
            pjax.load_target(tmp_path, dtype=jnp.bfloat16, weights="native")
    with pytest.raises(pjax.CheckpointError, match="weights must be one of"):
        pjax.load_target(path, weights="packed")


def test_native_copy_of_a_quantised_target_is_dequantised(quantised_moe, tmp_path, monkeypatch):
    """`convert target` writes every weight in its dtype even where packed experts are the loading default (a GPU)."""
    from pjax.checkpoint.cli import main as cli_main
    from pjax.kernels import dispatch
    from pjax.kernels.quantized import QuantizedWeight
    _, path, _ = quantised_moe
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    assert isinstance(_experts(pjax.load_target(path, dtype=jnp.float32))[0], QuantizedWeight)
    assert cli_main(["target", str(path), str(tmp_path / "copy"), "--dtype", "f32"]) == 0
    copy = pjax.load_target(tmp_path / "copy", dtype=jnp.float32)
    want = pjax.load_target(path, dtype=jnp.float32, weights="dequantized")
    for a, b in zip(jax.tree.leaves(copy.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
