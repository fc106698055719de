"""Drafter parity against speculators 0.9.0 (PEagleDraftModel / Eagle3DraftModel), the vLLM-native
layout, and checkpoint round trips through speculators `from_pretrained`.

speculators computes its training logits inside `forward` from a randomly sampled COD layout and
returns only a loss; we feed it a fixed layout by replacing the module-level sampler and capture
the logits by replacing the module-level `compute_metrics`. Everything in between (embedding,
mask token / mask_hidden selection, combine, fused first layer, FlexAttention masks, lm_head) is
speculators' own code.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import speculators.models.eagle3.core as ecore
import speculators.models.peagle.core as pcore
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.models.peagle.attention import create_peagle_mask_mod
from speculators.proposals.greedy import GreedyTokenProposalConfig
from torch.nn.attention.flex_attention import create_mask

import pjax
from pjax.train import draft_logits
from pjax.train.cod import layout_from_arrays
from pjax.train.masks import cod_dense_mask
from tests.hf_utils import rel_err

V, H, VD = 64, 32, 40
AUX = (1, 3, 5)
S = 24
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 50000.0}


def llama_tl(layers=3, sliding=(1,), window=5, rope=LLAMA3):
    types = ["sliding_attention" if i in sliding else "full_attention" for i in range(layers)]
    return tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, layer_types=types,
                          sliding_window=window if sliding else None, rope_parameters=dict(rope))


def qwen3_tl(layers=2, window=4):
    return tf.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                          use_sliding_window=True, sliding_window=window, max_window_layers=1)


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A tiny verifier: speculators' from_pretrained reads its config and embedding / lm_head."""
    path = tmp_path_factory.mktemp("verifier")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def spec_model(kind, tl, verifier, *, vd=VD, nbr=False, nbf=False, fcn=False, mask_id=5, seed=0):
    """A speculators draft model with random weights (norm gains around 1) and a random draft vocab."""
    cls, cfg_cls = (PEagleDraftModel, PEagleSpeculatorConfig) if kind == "peagle" else \
        (Eagle3DraftModel, Eagle3SpeculatorConfig)
    kw = dict(transformer_layer_config=tl, draft_vocab_size=vd, norm_before_residual=nbr, norm_before_fc=nbf,
              fc_norm=fcn, eagle_aux_hidden_state_layer_ids=list(AUX),
              speculators_config=SpeculatorsConfig(
                  algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)],
                  default_proposal_method="greedy",
                  verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])))
    if kind == "peagle":
        kw["mask_token_id"] = mask_id
    torch.manual_seed(seed)
    model = cls(cfg_cls(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name == "mask_hidden":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        if vd < V:
            sel = torch.sort(torch.randperm(V)[:vd])[0]
            model.d2t.copy_(sel - torch.arange(vd))
            model.t2d.zero_()
            model.t2d[sel] = True
    return model.float().eval()


def inputs(doc, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(1, S, len(AUX) * H, generator=g)
    ids = torch.randint(0, V, (1, S), generator=g)
    return hs, ids, torch.tensor([doc])


def cod_layout(seed, extra=()):
    """A real speculators COD layout (its own sampler, seeded), plus optional hand-made elements."""
    torch.manual_seed(seed)
    loss_mask = torch.ones(1, S)
    loss_mask[0, :3] = 0
    a, d = pcore.generate_cod_sample_indices(seq_length=S, loss_mask=loss_mask, num_depths=4)
    if extra:
        a = torch.cat([a, torch.tensor([e[0] for e in extra])])
        d = torch.cat([d, torch.tensor([e[1] for e in extra])])
    return a, d


def speculators_logits(model, monkeypatch, hs, ids, doc, anchor, depth):
    cap = {}
    if isinstance(model, PEagleDraftModel):
        monkeypatch.setattr(pcore, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
        monkeypatch.setattr(pcore, "compute_metrics", lambda **kw: (cap.update(kw), (torch.tensor(0.0), {}))[1])
        with torch.no_grad():
            model(hidden_states=hs, input_ids=ids, document_ids=doc, verifier_last_hidden_states=torch.zeros(1, S, H),
                  num_depths=4)
    else:
        assert bool((depth == 0).all()) and torch.equal(anchor, torch.arange(S))
        monkeypatch.setattr(ecore, "compute_metrics",
                            lambda logits, *a, **k: (cap.update(logits=logits), (torch.tensor(0.0), {}))[1])
        with torch.no_grad():
            model(hidden_states=hs, input_ids=ids, document_ids=doc, position_ids=torch.arange(S)[None],
                  loss_mask=torch.ones(1, S), verifier_last_hidden_states=torch.zeros(1, S, H), ttt_steps=1)
    return cap["logits"][0].float().numpy()


def compare(model, drafter, monkeypatch, doc, anchor, depth, seed=0):
    hs, ids, doc_t = inputs(doc, seed)
    ref = speculators_logits(model, monkeypatch, hs, ids, doc_t, anchor, depth)
    got = np.asarray(draft_logits(drafter, hs.numpy(), ids.numpy(), doc_t.numpy(), anchor.numpy(), depth.numpy()))
    assert got.shape == ref.shape
    keep = np.asarray(doc)[anchor.numpy()] != -1  # padding rows see nothing (undefined in both)
    assert keep.sum() > S // 2
    err = rel_err(got[keep], ref[keep])
    assert err <= 1e-4, err
    return got


DOC2 = [0] * 11 + [1] * 10 + [-1] * 3
DOC3 = [0] * 7 + [1] * 9 + [2] * 8

CASES = {
    # llama, d2t, norm_before_residual, per-chunk fc_norm, llama3 rope, one sliding layer of three
    "peagle_llama": dict(kind="peagle", tl=lambda: llama_tl(), nbr=True, fcn=True, doc=DOC2, extra=()),
    # qwen3 (q/k norms), Vd == V, raw residual, norm_before_fc, qwen3 sliding layer; anchor -1 element
    "peagle_qwen3": dict(kind="peagle", tl=lambda: qwen3_tl(), vd=V, nbf=True, doc=DOC3, extra=((-1, 1), (20, 3))),
    # EAGLE-3 head: depth-0 layout only, one fused layer, sliding window
    "eagle3_llama": dict(kind="eagle3", tl=lambda: llama_tl(layers=1, sliding=(0,), window=6), nbr=True,
                         doc=DOC2, extra=()),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, verifier_dir):
    c = dict(CASES[request.param])
    model = spec_model(c["kind"], c["tl"](), verifier_dir, vd=c.get("vd", VD), nbr=c.get("nbr", False),
                       nbf=c.get("nbf", False), fcn=c.get("fcn", False))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    c.update(name=request.param, model=model, path=path, drafter=pjax.load_drafter(path, dtype=jnp.float32))
    return c


def test_logits_match_speculators(case, monkeypatch):
    if case["kind"] == "peagle":
        anchor, depth = cod_layout(1, case["extra"])
        assert int(depth.max()) >= 2
    else:
        anchor, depth = torch.arange(S), torch.zeros(S, dtype=torch.long)
    compare(case["model"], case["drafter"], monkeypatch, case["doc"], anchor, depth)


def test_config_read(case):
    cfg = case["drafter"].config
    assert cfg.model_kind == case["kind"] and cfg.aux_layer_ids == AUX and cfg.num_aux == 3
    assert cfg.draft_vocab_size == case.get("vd", VD) and cfg.vocab_size == V
    assert cfg.has_mask_hidden == (case["kind"] == "peagle")
    windows = [s.sliding_window for s in cfg.layer.layers]
    assert windows == {"peagle_llama": [None, 5, None], "peagle_qwen3": [None, 4], "eagle3_llama": [6]}[case["name"]]
    model = case["model"]
    if model.d2t is not None:
        np.testing.assert_array_equal(np.asarray(case["drafter"].d2t), model.d2t.numpy())
        ids = np.arange(cfg.draft_vocab_size)
        np.testing.assert_array_equal(np.asarray(pjax.models.draft_to_target(case["drafter"], jnp.asarray(ids))),
                                      np.nonzero(model.t2d.numpy())[0])
    else:
        assert case["drafter"].d2t is None


@pytest.mark.full  # test_train_cod.py::test_mask_builder_matches_speculators checks these masks (anchor -1 too)
def test_cod_mask_matches_speculators():
    anchor, depth = cod_layout(3, ((-1, 1),))
    doc = torch.tensor(DOC2)
    for window in (None, 3):
        mod = create_peagle_mask_mod(anchor, depth, doc, sliding_window=window)
        ref = create_mask(mod, None, None, len(anchor), len(anchor), device="cpu")[0, 0].numpy()
        got = np.asarray(cod_dense_mask(layout_from_arrays(anchor.numpy(), depth.numpy()), doc.numpy(), window))
        np.testing.assert_array_equal(got, ref)


def _write_vllm_native(src, dst, model):
    """Rewrite a speculators checkpoint in the amazon / vLLM-native layout (midlayer.*, ptd_token_id)."""
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd.pop("t2d")  # vLLM ignores t2d; d2t alone must suffice
    save_file(sd, dst / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    cfg = dict(hf["transformer_layer_config"], architectures=["LlamaForCausalLMEagle3"],
               draft_vocab_size=hf["draft_vocab_size"], ptd_token_id=model.mask_token_id,
               norm_before_residual=hf["norm_before_residual"], fc_norm=hf["fc_norm"],
               eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(AUX)})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_vllm_native_layout_loads_identically(case, tmp_path):
    if case["name"] != "peagle_llama":
        pytest.skip("one native-layout case is enough")
    native = pjax.load_drafter(_write_vllm_native(case["path"], tmp_path / "native", case["model"]),
                                  dtype=jnp.float32)
    ref = case["drafter"]
    assert native.config.layer == ref.config.layer
    for f in ("num_aux", "target_hidden_size", "draft_vocab_size", "mask_token_id", "aux_layer_ids", "fc_norm",
              "norm_before_residual", "norm_before_fc", "has_mask_hidden", "model_kind"):
        assert getattr(native.config, f) == getattr(ref.config, f), f
    assert jax.tree.structure(native.params) == jax.tree.structure(ref.params)
    for a, b in zip(jax.tree.leaves(native.params), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(native.d2t), np.asarray(ref.d2t))


def test_roundtrip_speculators_pjax_bit_identical(case, tmp_path):
    """speculators -> pjax -> save -> load: identical params (float32 and the bf16 default)."""
    for dtype, name in ((jnp.float32, "float32"), (jnp.bfloat16, "bfloat16")):
        first = pjax.load_drafter(case["path"], dtype=dtype)
        out = pjax.save_drafter(first, tmp_path / name, dtype=name)
        again = pjax.load_drafter(out, dtype=dtype)
        assert again.config.layer == first.config.layer
        assert jax.tree.structure(again.params) == jax.tree.structure(first.params)
        for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(first.params)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        if first.d2t is None:
            assert again.d2t is None
        else:
            np.testing.assert_array_equal(np.asarray(again.d2t), np.asarray(first.d2t))


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_roundtrip_pjax_to_speculators(kind, tmp_path, verifier_dir, monkeypatch):
    """A head made in pjax, written with save_drafter, loads in speculators with the same logits."""
    src = tmp_path / "spec"
    if kind == "peagle":  # qwen3 layers, sliding layer, fc_norm, d2t
        spec_model(kind, qwen3_tl(), verifier_dir, fcn=True).save_pretrained(src)
    else:  # llama layers, llama3 rope, norm_before_fc, Vd == V
        spec_model(kind, llama_tl(layers=2), verifier_dir, vd=V, nbf=True).save_pretrained(src)
    cfg = pjax.load_drafter(src, dtype=jnp.float32).config
    drafter = pjax.init_drafter(cfg, jax.random.key(7), jnp.float32, scale=0.15)
    out = pjax.save_drafter(drafter, tmp_path / "out", dtype="float32")
    model = (PEagleDraftModel if kind == "peagle" else Eagle3DraftModel).from_pretrained(str(out)).float().eval()
    if kind == "peagle":
        anchor, depth = cod_layout(5)
        assert model.mask_token_id == cfg.mask_token_id
    else:
        anchor, depth = torch.arange(S), torch.zeros(S, dtype=torch.long)
    compare(model, drafter, monkeypatch, DOC3, anchor, depth, seed=2)
    # the default bf16 export loads too and matches the bf16-rounded head
    out16 = pjax.save_drafter(drafter, tmp_path / "out16")
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    model16 = type(model).from_pretrained(str(out16)).float().eval()
    compare(model16, pjax.load_drafter(out16, dtype=jnp.float32), monkeypatch, DOC3, anchor, depth, seed=2)
