"""pjax.checkpoint.hf_export: a pjax target written as a Hugging Face checkpoint loads in transformers with the same
float32 logits and back into pjax bit for bit; shards, tokenizer files, the output rule, refusals."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

from pjax.checkpoint import CheckpointError, OutputError, load_target
from pjax.checkpoint.hf_export import hf_config, save_hf_target
from pjax.config import LayerSpec, ModelConfig, MoeSpec, RopeSpec
from pjax.models.families import config_from_hf
from pjax.models.target import init_target, target_logits
from tests.hf_utils import rel_err

LLAMA3 = RopeSpec(kind="llama3", theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=16)


def config(model_type="llama", *, tie=False, rope=RopeSpec(theta=10000.0), layers=3, **kw):
    spec = LayerSpec(head_dim=16, num_kv_heads=2, rope=rope)
    return ModelConfig(model_type, 96, 64, 112, 4, (spec,) * layers, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                       qk_norm=model_type == "qwen3", max_position_embeddings=64, **kw).validate()


def canonical(cfg):
    """The config as a Hugging Face checkpoint states it (unused rope fields and architectures filled in)."""
    return config_from_hf(hf_config(cfg))


def random_target(cfg, seed=0):
    """Random weights with norm gains away from 1 (a wrong norm convention shows)."""
    t = init_target(cfg, jax.random.key(seed), jnp.float32, scale=0.08)
    leaves, treedef = jax.tree.flatten_with_path(t.params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [x + 0.2 * jax.random.normal(k, x.shape) if str(getattr(p[-1], "key", "")) == "weight" else x
           for (p, x), k in zip(leaves, keys)]
    return dataclasses.replace(t, params=jax.tree.unflatten(treedef, out))


IDS = np.random.default_rng(0).integers(0, 96, (2, 19))

CASES = {
    "llama": dict(),
    "llama_tied_llama3_rope_bias": dict(tie=True, rope=LLAMA3, attention_bias=True, mlp_bias=True),
    "qwen3": dict(model_type="qwen3"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_logits_match(name, tmp_path):
    target = random_target(canonical(config(**CASES[name])))
    out = save_hf_target(target, tmp_path / "hf", dtype="float32", bos_token_id=1, eos_token_id=2)
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == hf_config(target.config)["architectures"][0]
    with torch.no_grad():
        ref = model(torch.as_tensor(IDS)).logits.numpy()
    got = np.asarray(target_logits(target, IDS))
    assert rel_err(got, ref) <= 1e-4, rel_err(got, ref)
    again = load_target(out, dtype=jnp.float32)
    assert again.config == target.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2 and "pad_token_id" not in gen


def test_bfloat16_shards_and_tokenizer_files(tmp_path):
    target = random_target(config())
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 5, "content": "<s>"},
                                                                     {"id": 6, "content": "</s>"}]}))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    out = save_hf_target(target, tmp_path / "hf", tokenizer_dir=tok, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["dtype"]) == (5, 6, None, "bfloat16")
    assert (out / "tokenizer.json").read_text() == (tok / "tokenizer.json").read_text()
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    loaded = load_target(out, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32))
    with torch.no_grad():
        ref = model(torch.as_tensor(IDS)).logits.numpy()
    assert rel_err(np.asarray(target_logits(loaded, IDS)), ref) <= 1e-4


def test_output_rule(tmp_path):
    target = random_target(config())
    out = save_hf_target(target, tmp_path / "hf", dtype="float32")
    with pytest.raises(OutputError, match="already exists"):
        save_hf_target(target, out, dtype="float32")
    save_hf_target(target, out, dtype="float32", overwrite=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not a pjax output"):
        save_hf_target(target, user, overwrite=True)
    assert (user / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        save_hf_target(target, tmp_path / "x", tokenizer_dir=user)


def test_refuses_what_it_cannot_write():
    with pytest.raises(CheckpointError, match="final_logit_softcap"):
        hf_config(dataclasses.replace(config(), final_logit_softcap=30.0))
    spec = LayerSpec(head_dim=16, num_kv_heads=2, rope=RopeSpec(), sliding_window=8)
    with pytest.raises(CheckpointError, match="sliding_window=8"):
        hf_config(dataclasses.replace(config(), layers=(spec,) * 3))
    with pytest.raises(CheckpointError, match="model_type 'qwen3_moe'"):
        hf_config(dataclasses.replace(config(), model_type="qwen3_moe", moe=MoeSpec(4, 2, 32)))
    with pytest.raises(CheckpointError, match="max_position_embeddings"):
        hf_config(dataclasses.replace(config(), max_position_embeddings=None))
