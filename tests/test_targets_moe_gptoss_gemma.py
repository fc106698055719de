"""Qwen3-MoE, GPT-OSS (plain and MXFP4 experts) and Gemma 4 parity against transformers: logits, both
MoE code paths, aux hidden states, cached extend with ragged rows (sliding windows, sinks, k_eq_v)."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import pjax
from pjax.checkpoint.safetensors import SafetensorsFile, save_file
from pjax.models.moe import MOE_FEW_PAIRS
from tests.hf_utils import check_cached_extend, hf_hidden_states, pjax_full_forward, randomize, rel_err

V = 97
QWEN3_MOE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, mlp_only_layers=[1])
GPT_OSS = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_local_experts=4,
               num_experts_per_tok=2, head_dim=16, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
               swiglu_limit=1.0, max_position_embeddings=256,  # limit 1.0: the clamps are active
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
GEMMA4 = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=3.0, sliding_window=6,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"])


def mxfp4_experts(model, seed=0):
    """Replace GPT-OSS expert matrices by MXFP4-representable values; returns the on-disk blocks/scales."""
    rng = np.random.default_rng(seed)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                e, din, dout = getattr(ex, name).shape
                blocks = rng.integers(0, 256, (e, dout, din // 32, 16), dtype=np.uint8)
                scales = rng.integers(122, 126, (e, dout, din // 32), dtype=np.uint8)
                w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
                getattr(ex, name).copy_(w)  # transformers' dequantisation: [E, in, out]
                packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)
    return packed


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "gemma4"])
def pair(request, tmp_path_factory):
    """(transformers model, pjax target, checkpoint dir, extras); both models run once on IDS, with the
    pjax forward also returning the aux hidden states of AUX(L)."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    extra = {}
    if request.param == "qwen3_moe":
        model = randomize(tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**QWEN3_MOE)).float().eval())
    elif request.param == "gpt_oss":
        model = randomize(tf.GptOssForCausalLM(tf.GptOssConfig(**GPT_OSS)).float().eval())
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
        extra["mxfp4"] = mxfp4_experts(model)
    else:
        model = randomize(tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**GEMMA4)).float().eval())
    model.save_pretrained(path)
    target = pjax.load_target(path, dtype=jnp.float32)
    extra["hf_hidden"], extra["hf_logits"] = hf_hidden_states(model, IDS)
    extra["logits"], extra["aux"], extra["final_normed"] = pjax_full_forward(target, IDS, aux_ids(target))
    return model, target, path, extra


IDS = np.random.default_rng(0).integers(0, V, (2, 40))


def aux_ids(target):
    return (0, 1, target.config.num_layers - 1)


def test_logits_match_transformers(pair):
    _, target, _, extra = pair
    if target.config.moe is not None:  # many tokens: sorted ragged_dot path
        assert IDS.size * target.config.moe.top_k > MOE_FEW_PAIRS
    assert rel_err(extra["logits"], extra["hf_logits"]) <= 1e-4


def test_aux_hidden_states_match_transformers(pair):
    _, target, _, extra = pair
    ref = np.concatenate([extra["hf_hidden"][k] for k in aux_ids(target)], axis=-1)
    assert rel_err(extra["aux"], ref) <= 1e-5
    assert rel_err(extra["final_normed"], extra["hf_hidden"][-1]) <= 1e-5  # HF's last entry is post-norm


def test_config_geometry(pair):
    _, target, _, _ = pair
    cfg = target.config
    if cfg.model_type == "gpt_oss":
        assert [s.sliding_window for s in cfg.layers] == [6, None, 6] and cfg.sinks
        assert cfg.layers[0].rope.kind == "yarn" and not cfg.layers[0].rope.truncate
    elif cfg.model_type == "qwen3_moe":
        assert [s.moe for s in cfg.layers] == [True, False, True] and cfg.moe.norm_topk_prob
    else:  # a global k_eq_v layer with its own head_dim / kv heads exists
        glob = [i for i, s in enumerate(cfg.layers) if s.k_eq_v]
        assert glob == [2, 5] and cfg.layers[2].head_dim == 32 and cfg.layers[2].num_kv_heads == 1
        assert cfg.layers[2].rope.kind == "proportional" and cfg.layers[0].sliding_window == 6


def test_cached_extend_matches_full_forward(pair):
    """Ragged prefixes, then chunks of 1 and K+1 = 4 tokens. For MoE families the few-token steps take the few-pair
    path (<= MOE_FEW_PAIRS and <= 2 x experts token-expert pairs) and are also checked against transformers
    directly; the full forward they are compared with took the ragged_dot path."""
    _, target, _, extra = pair
    if target.config.moe is not None:
        moe = target.config.moe  # at least the one-token chunks take the few-pair path
        assert IDS.shape[0] * moe.top_k <= min(MOE_FEW_PAIRS, 2 * moe.num_experts)
    # Gemma 4 attends with scale 1.0 over normalised q/k: peaked softmaxes amplify float32 rounding a bit.
    tol = 5e-5 if target.config.model_type == "gemma4_text" else 1e-5
    check_cached_extend(target, IDS, extra["logits"], prefix=(5, 11), chunks=(1, 4), hf_full=extra["hf_logits"],
                        tol=tol)


def test_gpt_oss_mxfp4_checkpoint(pair, tmp_path):
    """Experts stored as MXFP4 blocks/scales (quant_method mxfp4) load to exactly the weights that
    transformers' dequantisation produced (and that the plain checkpoint holds)."""
    _, target, path, extra = pair
    if target.config.model_type != "gpt_oss":
        pytest.skip("MXFP4 is a GPT-OSS checkpoint format")
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys() if k not in extra["mxfp4"]}
    for name, (blocks, scales) in extra["mxfp4"].items():
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    q = pjax.load_target(out, dtype=jnp.float32)
    for (p, a), b in zip(jax.tree.flatten_with_path(target.params)[0], jax.tree.leaves(q.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
    # without the quantization_config the blocks are rejected with a clear error
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pjax.CheckpointError, match=r"_proj_blocks.*is MXFP4.*expected .mxfp4."):
        pjax.load_target(out, dtype=jnp.float32)


def test_fused_qwen3_moe_layout_and_multimodal_gemma4_prefix(pair, tmp_path):
    """Alternative on-disk layouts load to identical params: Qwen3-MoE fused `experts.gate_up_proj
    [E, 2I, H]` / `experts.down_proj [E, H, I]`; Gemma 4 multimodal (`model_type gemma4`, text stack
    under model.language_model., other towers ignored)."""
    _, target, path, _ = pair
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    cfg = json.loads((path / "config.json").read_text())
    if target.config.model_type == "qwen3_moe":
        e = cfg["num_local_experts"]
        for i in (0, 2):
            b = f"model.layers.{i}.mlp.experts"
            gu = [np.concatenate([tensors.pop(f"{b}.{x}.gate_proj.weight"), tensors.pop(f"{b}.{x}.up_proj.weight")])
                  for x in range(e)]
            tensors[f"{b}.gate_up_proj"] = np.stack(gu)
            tensors[f"{b}.down_proj"] = np.stack([tensors.pop(f"{b}.{x}.down_proj.weight") for x in range(e)])
    elif target.config.model_type == "gemma4_text":
        tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        tensors["model.vision_tower.patch_embedder.weight"] = np.zeros((4, 4), np.float32)
        cfg = {"model_type": "gemma4", "text_config": cfg, "tie_word_embeddings": True}
    else:
        pytest.skip("no alternative layout")
    out = tmp_path / "alt"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))
    alt = pjax.load_target(out, dtype=jnp.float32)
    assert alt.config == target.config
    for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(alt.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shutil.rmtree(out)


@pytest.mark.parametrize("family, norm_topk", [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", False)])
def test_router_matches_transformers(family, norm_topk):
    """pjax MoE.route (weights, expert ids) == the transformers router module, both routing rules."""
    from flax import nnx

    from pjax.models.families import config_from_hf
    from pjax.models.moe import MoE
    torch.manual_seed(1)
    if family == "qwen3_moe":
        hf_cfg = tf.Qwen3MoeConfig(**dict(QWEN3_MOE, norm_topk_prob=norm_topk))
        router = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(hf_cfg)
    else:
        hf_cfg = tf.GptOssConfig(**GPT_OSS)
        router = tf.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(hf_cfg)
    randomize(router, std=1.0)
    cfg = config_from_hf(hf_cfg.to_dict())
    moe = MoE(cfg, cfg.moe, dtype=jnp.float32, rngs=nnx.Rngs(0))
    moe.router.kernel[...] = jnp.asarray(router.weight.detach().numpy().T)
    if cfg.moe.router_bias:
        moe.router.bias[...] = jnp.asarray(router.bias.detach().numpy())
    x = np.random.default_rng(4).normal(size=(16, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, ref_w, ref_idx = router(torch.from_numpy(x))
    w, idx = moe.route(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(idx), ref_idx.numpy())
    np.testing.assert_allclose(np.asarray(w), ref_w.numpy(), rtol=2e-5, atol=1e-6)


def test_gemma4_released_config_keys():
    """Released Gemma 4 configs name the global geometry `global_head_dim` / `num_global_key_value_heads`
    instead of transformers 5.19's `per_layer_config`: both parse to the same model."""
    from pjax.models.families import config_from_hf
    new = tf.Gemma4TextConfig(**GEMMA4).to_dict()
    assert new["per_layer_config"] == {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                       "5": {"head_dim": 32, "num_key_value_heads": 1}}
    old = {k: v for k, v in new.items() if k != "per_layer_config"}
    old.update(global_head_dim=32, num_global_key_value_heads=1)
    assert config_from_hf(old) == config_from_hf(new)
    wrapped = {"model_type": "gemma4", "text_config": old, "tie_word_embeddings": True}
    assert config_from_hf(wrapped) == config_from_hf(new)
