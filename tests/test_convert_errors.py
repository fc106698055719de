"""convert: bad inputs give clear errors (file, tensor, expected vs found); pjax-native round trip;
the `python -m convert` CLI."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import pjax
from pjax.checkpoint.cli import main as cli_main
from pjax.checkpoint.native import load_native_target, save_native_target
from pjax.checkpoint.safetensors import SafetensorsFile, save_file
from pjax.config import ConfigError
from pjax.models.families import config_from_hf

ROOT = Path(__file__).resolve().parents[1]
EMB = "model.embed_tokens.weight"
QK = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(path)
    return path


def mutate(src, dst, *, drop=(), replace=None, config=None):
    """Copy a checkpoint dir, dropping / replacing tensors or updating config.json keys."""
    dst.mkdir(exist_ok=True)
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys() if k not in drop}
    tensors.update(replace or {})
    save_file(tensors, dst / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (dst / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return dst


def load(path):
    return pjax.load_target(path, dtype=jnp.float32)


def test_truncated_safetensors(hf_dir, tmp_path):
    d = mutate(hf_dir, tmp_path / "t")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(pjax.CheckpointError, match=r"model\.safetensors: tensors need \d+ bytes but the file "
                                                      r"has \d+ \(truncated"):
        load(d)
    f.write_bytes(b"\x10\x00")
    with pytest.raises(pjax.CheckpointError, match="too short for a safetensors header"):
        load(d)


def test_missing_tensor(hf_dir, tmp_path):
    with pytest.raises(pjax.CheckpointError, match=rf"tensor '{QK}' is missing \(expected shape \[32, 32\]\)"):
        load(mutate(hf_dir, tmp_path / "m", drop=[QK]))


def test_wrong_shape(hf_dir, tmp_path):
    d = mutate(hf_dir, tmp_path / "w", replace={QK: np.zeros((32, 16), np.float32)})
    with pytest.raises(pjax.CheckpointError, match=rf"model\.safetensors: tensor '{QK}' has shape \[32, 16\], "
                                                      r"expected \[32, 32\]"):
        load(d)


def test_unexpected_tensor(hf_dir, tmp_path):
    d = mutate(hf_dir, tmp_path / "u", replace={"model.layers.0.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(pjax.CheckpointError, match=r"1 unexpected tensor\(s\) for model_type 'llama': "
                                                      r"\['model.layers.0.extra.weight'\]"):
        load(d)


def test_missing_shard(hf_dir, tmp_path):
    d = mutate(hf_dir, tmp_path / "s")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {EMB: "model-00002.safetensors"}}))
    with pytest.raises(pjax.CheckpointError, match=r"index.json: shard 'model-00002.safetensors' is missing"):
        load(d)


def test_unknown_model_type(hf_dir, tmp_path):
    with pytest.raises(pjax.CheckpointError, match=r"config.json: model_type 'bert' is not supported "
                                                      r"\(supported: \[.*'gemma4'.*'gpt_oss'.*\]\)"):
        load(mutate(hf_dir, tmp_path / "b", config={"model_type": "bert"}))


def test_unsupported_quantization(hf_dir, tmp_path):
    d = mutate(hf_dir, tmp_path / "q", config={"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(pjax.CheckpointError, match=r"config.json: quantization_config.quant_method 'gptq' is "
                                                      r"not supported"):
        load(d)
    d = mutate(hf_dir, tmp_path / "q2", config={"quantization_config": {"quant_method": "fp8",
                                                                         "activation_scheme": "static"}})
    with pytest.raises(pjax.CheckpointError, match="activation_scheme 'static' is not supported"):
        load(d)


def test_fp8_tensor_without_scale(hf_dir, tmp_path):
    import ml_dtypes
    d = mutate(hf_dir, tmp_path / "f", replace={QK: np.zeros((32, 32), ml_dtypes.float8_e4m3fn)},
               config={"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(pjax.CheckpointError, match=rf"FP8 tensor '{QK}' has no '{QK}_scale_inv'"):
        load(d)


@pytest.mark.parametrize("bad, match", [
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries, expected num_hidden_layers=2"),
    ({"hidden_act": "relu"}, r"hidden_act 'relu' is not supported"),
    ({"num_hidden_layers": None}, r"required key 'num_hidden_layers' is missing"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type 'dynamic' is not supported"),
    ({"rms_norm_eps": "abc"}, r"config\.json: rms_norm_eps must be a number, got 'abc'"),
    ({"num_attention_heads": [4]}, r"config\.json: num_attention_heads must be a number, got \[4\]"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "two"}}, r"config\.json: a field of the llama config has a "
                                                                 r"value of the wrong type \(ValueError: could not"),
])
def test_inconsistent_config(hf_dir, tmp_path, bad, match):
    hf = json.loads((hf_dir / "config.json").read_text())
    hf.pop("rope_parameters", None)
    hf.update(bad)
    d = tmp_path / "c"
    shutil.copytree(hf_dir, d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    with pytest.raises(pjax.CheckpointError, match=match):
        load(d)


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8},
     r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
    ({"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 0,
      "layer_types": ["sliding_attention", "full_attention"]}, r"layer 0 is sliding_attention but sliding_window"),
    ({"model_type": "gemma4_text", "hidden_size_per_layer_input": 256}, r"per-layer embeddings \(PLE\)"),
    ({"model_type": "gemma4_text", "enable_moe_block": True}, r"Gemma 4 MoE block"),
    ({"model_type": "gemma4_text", "per_layer_config": {"7": {"head_dim": 8}}}, r"names layer 7, outside \[0, 2\)"),
    ({"model_type": "gemma4", "vocab_size": 11}, r"model_type 'gemma4' needs a 'text_config'"),
])
def test_family_config_errors(hf, match):
    base = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    with pytest.raises(ConfigError, match=match):
        config_from_hf({k: v for k, v in {**base, **hf}.items() if v is not None})


# ------------------------------------------------------------------------------------ native format
def test_native_round_trip(hf_dir, tmp_path):
    ref = load(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    out = save_native_target(ref, hf, tmp_path / "native")
    assert sorted(os.listdir(tmp_path)) == ["native"]  # no temporary directories left behind
    for t in (load_native_target(out, jnp.float32), pjax.load_target(out, dtype=jnp.float32)):
        assert t.config == ref.config
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(t.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert pjax.load_target(out).dtype == jnp.bfloat16
    with pytest.raises(pjax.OutputError, match="already exists"):
        save_native_target(ref, hf, out)
    (out / "pjax_target.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(pjax.CheckpointError, match=r"pjax_target.json: format 'other'"):
        pjax.load_target(out)


# -------------------------------------------------------------------------------------------- CLI
def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_inspect_and_target(hf_dir, tmp_path):
    r = run_cli("inspect", hf_dir, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    ref = load(hf_dir)
    assert rep["model_type"] == "llama" and rep["valid"] and rep["dtypes"]["F32"]["tensors"] == 21  # 2 x 9 per layer + embed, norm, lm_head
    assert rep["num_params"] == sum(x.size for x in jax.tree.leaves(ref.params))
    r = run_cli("target", hf_dir, tmp_path / "out", "--dtype", "f32")
    assert r.returncode == 0, r.stderr
    got = pjax.load_target(tmp_path / "out", dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_errors_in_process(hf_dir, tmp_path, capsys):
    d = mutate(hf_dir, tmp_path / "bad", drop=[QK])
    assert cli_main(["inspect", str(d)]) == 2
    assert f"tensor '{QK}' is missing" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    assert cli_main(["target", str(hf_dir), str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    nan = mutate(hf_dir, tmp_path / "nan", replace={QK: np.full((32, 32), np.nan, np.float32)})
    assert cli_main(["inspect", str(nan)]) == 2
    assert "non-finite" in capsys.readouterr().err
    assert cli_main(["inspect", str(nan), "--no-finite-check"]) == 0


def test_cli_finds_one_nan_in_a_large_tensor(tmp_path, capsys):
    """A single NaN in a float32 tensor of 8,192 elements (a size where a max-reduction check misses it) stops
    `convert inspect`, `convert target` and `convert drafter`."""
    import jax.random
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    from pjax.models.drafter import DrafterConfig
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(tmp_path / "good")
    emb = np.array(SafetensorsFile(tmp_path / "good" / "model.safetensors").get(EMB))
    emb[128, 5] = np.nan
    nan = mutate(tmp_path / "good", tmp_path / "nan", replace={EMB: emb})
    assert cli_main(["inspect", str(nan)]) == 2
    assert f"tensor '{EMB}' has 1 non-finite" in capsys.readouterr().err
    assert cli_main(["target", str(nan), str(tmp_path / "out"), "--dtype", "f32"]) == 2
    assert f"tensor '{EMB}' has 1 non-finite" in capsys.readouterr().err and not (tmp_path / "out").exists()
    layer = ModelConfig("llama", 256, 32, 40, 4, (LayerSpec(8, 2, RopeSpec(theta=10000.0)),), rms_norm_eps=1e-5)
    dcfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=32, draft_vocab_size=256, mask_token_id=255,
                         aux_layer_ids=(0, 1, 2))
    d = pjax.init_drafter(dcfg, jax.random.key(0), jnp.float32, scale=0.2)
    head = pjax.save_drafter(d, tmp_path / "good_head", dtype="float32")
    lm = np.array(SafetensorsFile(head / "model.safetensors").get("lm_head.weight"))
    lm[100, 16] = np.nan
    head = mutate(head, tmp_path / "head", replace={"lm_head.weight": lm})
    assert cli_main(["drafter", str(head), str(tmp_path / "head2")]) == 2
    assert "tensor 'lm_head.weight' has 1 non-finite" in capsys.readouterr().err
    assert cli_main(["inspect", str(head)]) == 2
    assert "tensor 'lm_head.weight' has 1 non-finite" in capsys.readouterr().err
