"""P-EAGLE / EAGLE-3 training loss and gradient parity against speculators 0.9.0 (torch autograd).

The reference runs speculators' own `PEagleDraftModel.forward` / `Eagle3DraftModel.forward` (eager
attention, eager KL) on a tiny random head; the COD layout is speculators' own sampler output, fed
to both sides. The only change to the reference: its dense float mask uses the most negative finite
float instead of -inf, so fully padded query rows give finite values instead of NaN (they carry no
loss either way)."""
import numpy as np
import pytest
import torch

speculators = pytest.importorskip("speculators")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

import speculators.models.peagle.core as peagle_core  # noqa: E402
from pjax.checkpoint import load_drafter  # noqa: E402
from pjax.checkpoint.heads import tensor_name  # noqa: E402
from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.models.paths import param_path  # noqa: E402
from pjax.models.target import init_target  # noqa: E402
from pjax.train.eagle3 import eagle3_row_loss  # noqa: E402
from pjax.train.losses import peagle_loss, peagle_loss_and_metrics, with_params  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig  # noqa: E402
from speculators.models.peagle.data import generate_cod_sample_indices  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

V, H, S = 64, 32, 24
FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these tiny programs


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def finite_float_mask(mask_mod, B=None, H=None, Q_LEN=0, KV_LEN=0, device=None):  # noqa: N803
    bm = create_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=device)
    return torch.zeros(bm.shape).masked_fill(~bm, torch.finfo(torch.float32).min)


def layer_config(arch):
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)
    if arch == "qwen3":  # speculators' default draft arch, with one sliding layer (window 4 < row length)
        tl = Qwen3Config(**common, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                         use_sliding_window=True)
    else:
        tl = LlamaConfig(**common)
    tl._attn_implementation = "eager"
    return tl


def build(kind, arch, vd, tmp_path, **flags):
    """(torch model, pjax drafter, pjax target, draft ids) with identical random weights."""
    spec = SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    common = dict(transformer_layer_config=layer_config(arch), draft_vocab_size=vd,
                  eagle_aux_hidden_state_layer_ids=[0, 1, 2], speculators_config=spec, **flags)
    if kind == "peagle":
        model = PEagleDraftModel(PEagleSpeculatorConfig(mask_token_id=5, **common)).float()
    else:
        model = Eagle3DraftModel(Eagle3SpeculatorConfig(**common)).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_((1.0 if n == "mask_hidden" else 0.2) * torch.randn(p.shape, generator=gen))
        ids = torch.sort(torch.randperm(V, generator=gen)[:vd])[0]
        if vd < V:
            model.d2t.copy_(ids - torch.arange(vd))
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[ids] = True
            model.t2d.copy_(t2d)
    model.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path, dtype=jnp.float32)
    tcfg = ModelConfig("llama", V, H, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(3)))
    target = init_target(tcfg, jax.random.key(1), scale=0.3)
    with torch.no_grad():
        model.verifier_norm.weight.copy_(torch.tensor(np.asarray(target.params["norm"]["weight"])))
        model.verifier_lm_head.weight.copy_(
            torch.tensor(np.asarray(target.params["lm_head"]["kernel"])[:, ids.numpy()].T))
    model._create_mask_fn = finite_float_mask
    return model, drafter, target


def row_data():
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, V, (1, S))
    hs = rng.normal(size=(1, S, 3 * H)).astype(np.float32)
    vl = rng.normal(size=(1, S, H)).astype(np.float32)
    doc = np.array([[0] * 9 + [1] * 12 + [-1] * 3])
    lm = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]], np.float32)
    return input_ids, hs, vl, doc, lm


def grad_errors(model, grads):
    tgrads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    errs, seen = {}, set()
    for kp, leaf in jax.tree.flatten_with_path(grads)[0]:
        name, tr = tensor_name(param_path(kp))
        arr = np.asarray(leaf)
        arr = arr.T if tr else arr
        if name in tgrads:
            errs[name] = rel(arr, tgrads[name].numpy().reshape(arr.shape))
            seen.add(name)
        else:  # frozen in speculators: must be frozen here too (or get a zero gradient)
            assert name in ("lm_head.weight", "embed_tokens.weight"), name
    assert seen == set(tgrads), set(tgrads) ^ seen
    return errs


@pytest.mark.parametrize("arch,vd,flags", [
    ("qwen3", 48, dict(norm_before_residual=True, norm_before_fc=True)),
    ("llama", V, dict(norm_before_residual=False, fc_norm=True)),
])
def test_peagle_loss_and_grad_parity(tmp_path, arch, vd, flags, monkeypatch):
    model, drafter, target = build("peagle", arch, vd, tmp_path, **flags)
    input_ids, hs, vl, doc, lm = row_data()
    torch.manual_seed(3)
    anchor, depth = generate_cod_sample_indices(S, torch.tensor(lm), num_depths=4)
    assert int(depth.max()) >= 2
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
    _, tloss, tmet = model(hidden_states=torch.tensor(hs), input_ids=torch.tensor(input_ids),
                           document_ids=torch.tensor(doc), loss_mask=torch.tensor(lm),
                           verifier_last_hidden_states=torch.tensor(vl), num_depths=4,
                           loss_config=resolve_loss_config("kl_div", "eager"))
    tloss.backward()
    args = (input_ids, hs, vl, lm, doc, anchor.numpy(), depth.numpy())
    loss_fn = jax.value_and_grad(lambda p: peagle_loss(with_params(drafter, p), target, *args, num_depths=4))
    loss, grads = jax.jit(loss_fn, compiler_options=FAST)(drafter.params)
    assert rel(loss, tloss.item()) <= 1e-4
    errs = grad_errors(model, grads)
    assert max(errs.values()) <= 1e-3, errs
    if arch == "qwen3":  # metrics, and the query- and element-chunked path (dense mask: test_train_cod)
        chunked, met = jax.jit(lambda p: peagle_loss_and_metrics(
            with_params(drafter, p), target, *args, num_depths=4, attn_chunk=7, loss_chunk=5),
            compiler_options=FAST)(drafter.params)
        assert rel(chunked, loss) <= 1e-5
        for d in range(4):
            assert float(met["correct"][d]) == tmet[f"position_{d}_acc_sum"].item()
            assert float(met["total"][d]) == tmet[f"position_{d}_acc_total"].item()


def test_eagle3_ttt_loss_and_grad_parity(tmp_path):
    model, drafter, target = build("eagle3", "qwen3", 48, tmp_path, norm_before_residual=True)
    input_ids, hs, vl, doc, lm = row_data()
    _, tloss, tmet = model(hidden_states=torch.tensor(hs), input_ids=torch.tensor(input_ids),
                           document_ids=torch.tensor(doc), loss_mask=torch.tensor(lm),
                           verifier_last_hidden_states=torch.tensor(vl), ttt_steps=3, ttt_step_loss_decay=0.8,
                           loss_config=resolve_loss_config("kl_div", "eager"))
    tloss.backward()

    def f(params):
        return eagle3_row_loss(with_params(drafter, params), target, input_ids[0], hs[0], vl[0], lm[0], doc[0],
                               ttt_steps=3, ttt_step_loss_decay=0.8, attn_chunk=10)

    (loss, met), grads = jax.jit(jax.value_and_grad(f, has_aux=True), compiler_options=FAST)(drafter.params)
    assert rel(loss, tloss.item()) <= 1e-4
    errs = grad_errors(model, grads)
    assert max(errs.values()) <= 1e-3, errs
    for t in range(3):  # speculators' full_acc counts drafts whose whole chain so far is correct
        assert float(met["cond_correct"][t]) == tmet[f"full_acc_{t}_sum"].item()
        assert float(met["total"][t]) == tmet[f"full_acc_{t}_total"].item()
        assert float(met["cond_total"][t]) == tmet[f"cond_acc_{t}_total"].item()
