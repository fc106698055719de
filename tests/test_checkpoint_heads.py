"""A drafter head is recognised wherever a path is given: `convert inspect HEAD_DIR` validates it fully (both
layouts) and reports kind, layers, vocabularies, mask id and aux ids; `load_target` on a head and
`load_drafter` on a target say what the directory is and which loader to use."""
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import pjax
from pjax.checkpoint.cli import main as cli_main
from pjax.checkpoint.safetensors import SafetensorsFile, save_file
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig

V, VD, H = 61, 40, 32


def make_drafter(kind="peagle", vd=VD, layers=2):
    layer = ModelConfig("llama", V, H, 40, 4, (LayerSpec(8, 2, RopeSpec(theta=10000.0)),) * layers,
                        rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=24, draft_vocab_size=vd,
                        mask_token_id=60 if kind == "peagle" else None, aux_layer_ids=(1, 4, 7), model_kind=kind,
                        has_mask_hidden=kind == "peagle", norm_before_residual=True)
    return pjax.init_drafter(cfg, jax.random.key(0), jnp.float32, scale=0.2)


def vllm_layout(src: Path, dst: Path) -> Path:
    """A one-layer speculators head rewritten in the vLLM-native layout (midlayer.*, llama config + draft keys)."""
    dst.mkdir()
    f = SafetensorsFile(src / "model.safetensors")
    t = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): np.array(f.get(k)) for k in f.keys()}
    save_file(t, dst / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    cfg = dict(hf["transformer_layer_config"], architectures=["LlamaForCausalLMEagle3"],
               draft_vocab_size=hf["draft_vocab_size"], target_hidden_size=hf["target_hidden_size"],
               norm_before_residual=True, ptd_token_id=hf.get("mask_token_id"),
               eagle_config={"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"]})
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    spec = pjax.save_drafter(make_drafter("peagle"), root / "peagle", dtype="float32")
    eagle3 = pjax.save_drafter(make_drafter("eagle3", vd=V), root / "eagle3")
    one = pjax.save_drafter(make_drafter("peagle", layers=1), root / "one", dtype="float32")
    return {"peagle": spec, "eagle3": eagle3, "vllm": vllm_layout(one, root / "vllm")}


def inspect_json(path, capsys, *extra):
    assert cli_main(["inspect", str(path), "--json", *extra]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_inspect_speculators_head(heads, capsys):
    rep = inspect_json(heads["peagle"], capsys)
    assert rep["format"] == "speculators" and rep["kind"] == "peagle" and rep["valid"] is True
    assert rep["num_layers"] == 2 and rep["vocab_size"] == V and rep["draft_vocab_size"] == VD
    assert rep["mask_token_id"] == 60 and rep["aux_layer_ids"] == [1, 4, 7]
    assert rep["hidden_size"] == H and rep["target_hidden_size"] == 24
    assert rep["dtypes"]["F32"]["tensors"] > 0 and rep["dtypes"]["I64"]["tensors"] == 1  # d2t
    d = pjax.load_drafter(heads["peagle"], dtype=jnp.float32)
    assert rep["num_params"] == sum(x.size for x in jax.tree.leaves(d.params))
    rep = inspect_json(heads["eagle3"], capsys)
    assert rep["kind"] == "eagle3" and rep["mask_token_id"] is None and rep["draft_vocab_size"] == V
    assert set(rep["dtypes"]) == {"BF16"}


def test_inspect_vllm_native_head(heads, capsys):
    rep = inspect_json(heads["vllm"], capsys)
    assert rep["format"] == "vllm-native" and rep["kind"] == "peagle" and rep["num_layers"] == 1
    assert rep["mask_token_id"] == 60 and rep["aux_layer_ids"] == [1, 4, 7] and rep["draft_vocab_size"] == VD
    capsys.readouterr()
    assert cli_main(["inspect", str(heads["vllm"])]) == 0
    assert "kind: peagle" in capsys.readouterr().out.replace("  ", "")


def edited(src: Path, dst: Path, tensors_fn=None, config_fn=None) -> Path:
    dst.mkdir()
    f = SafetensorsFile(src / "model.safetensors")
    t = {k: np.array(f.get(k)) for k in f.keys()}
    if tensors_fn:
        tensors_fn(t)
    save_file(t, dst / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    if config_fn:
        config_fn(hf)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


@pytest.mark.parametrize("tensors_fn, config_fn, match", [
    (lambda t: t.update({"layers.1.mlp.up_proj.weight": np.zeros((40, 16), np.float32)}), None,
     r"tensor 'layers\.1\.mlp\.up_proj\.weight' has shape \[40, 16\], expected \[40, 32\]"),
    (lambda t: t.update({"fc.weight": t["fc.weight"].astype(np.int32)}), None,
     r"tensor 'fc\.weight' has dtype int32, expected a floating dtype"),
    (lambda t: t.update(d2t=np.full(VD, V, np.int64)), None,
     r"d2t maps draft id 0 to target id 61, outside \[0, 61\)"),
    (lambda t: t.pop("t2d"), lambda hf: hf.update(draft_vocab_size=VD + 1),
     r"tensor 'lm_head\.weight' has shape \[40, 32\], expected \[41, 32\]"),
    (lambda t: t.update({"layers.0.extra": np.zeros(2, np.float32)}), None, r"unexpected tensor.*layers\.0\.extra"),
    (lambda t: t.update({"norm.weight": np.full(H, np.nan, np.float32)}), None,
     r"tensor 'norm\.weight' has 32 non-finite"),
])
def test_inspect_head_validates_every_tensor(heads, tmp_path, capsys, tensors_fn, config_fn, match):
    bad = edited(heads["peagle"], tmp_path / "bad", tensors_fn, config_fn)
    assert cli_main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.search(match, err), err


@pytest.mark.parametrize("name, what", [("peagle", "a P-EAGLE drafter head"), ("eagle3", "an EAGLE-3 drafter head"),
                                        ("vllm", "a P-EAGLE drafter head")])
def test_load_target_on_a_head(heads, name, what):
    with pytest.raises(pjax.CheckpointError, match=rf"{heads[name]} is {what} \(\w[\w-]* layout\), not a target; "
                                                   r"load it with load_drafter"):
        pjax.load_target(heads[name])


def test_load_drafter_on_a_target(tmp_path):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(tmp_path / "t")
    with pytest.raises(pjax.CheckpointError, match=r"t is a Hugging Face 'llama' target, not a drafter head; "
                                                   r"load it with load_target"):
        pjax.load_drafter(tmp_path / "t")
