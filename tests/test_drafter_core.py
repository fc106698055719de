"""Drafter: the cached inference layout equals the training layout, vocabulary helpers, and
strict-loader errors on malformed heads."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.checkpoint import CheckpointError
from pjax.checkpoint.safetensors import Checkpoint, save_file
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig, logits_to_target_vocab
from pjax.train import draft_logits
from tests.hf_utils import rel_err

V, H, HT, A, VD, K = 48, 32, 24, 3, 30, 4
MASK_ID = 3
FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these tiny programs


def config(**kw):
    rope = RopeSpec(theta=10000.0)
    spec = LayerSpec(head_dim=16, num_kv_heads=2, rope=rope)
    layer = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=40, num_heads=4,
                        layers=(spec, dataclasses.replace(spec, sliding_window=6), spec), rms_norm_eps=1e-5)
    base = dict(layer=layer, num_aux=A, target_hidden_size=HT, draft_vocab_size=VD, mask_token_id=MASK_ID,
                aux_layer_ids=(1, 2, 4), norm_before_residual=True, fc_norm=True, num_depths=K)
    base.update(kw)
    return DrafterConfig(**base).validate()


@pytest.fixture(scope="module")
def drafter():
    return pjax.init_drafter(config(), jax.random.key(0), jnp.float32, scale=0.2)


def test_inference_layout_equals_training_layout(drafter):
    """Prefill, then two parallel rounds through the KV cache (accepted + bonus + K-1 masks, padded
    to 2K slots; round 2 overwrites round 1's mask KV) == draft_logits on single-chain layouts."""
    rng = np.random.default_rng(0)
    s = 24
    ids = rng.integers(0, V, (2, s))
    hs = rng.normal(size=(2, s, A * HT)).astype(np.float32)
    comb = np.asarray(pjax.models.combine(drafter, hs))
    mfeat = np.asarray(pjax.models.mask_feature(drafter))
    fwd = jax.jit(pjax.models.drafter_forward, compiler_options=FAST)
    cache = pjax.models.init_drafter_cache(drafter, 2, 32, jnp.float32)

    prefix = np.array([5, 8])  # ragged prefill, then (accepted n, bonus) per round and row
    t0 = int(prefix.max())
    pos = np.minimum(np.arange(t0)[None], prefix[:, None] - 1)
    valid = np.arange(t0)[None] < prefix[:, None]
    rows = np.arange(2)[:, None]
    _, _, cache = fwd(drafter, jnp.asarray(ids[rows, pos]), jnp.asarray(comb[rows, pos]), jnp.asarray(pos), cache,
                      valid=jnp.asarray(valid))
    start = prefix.copy()  # first position of this round's slots
    for accepted in ([2, 0], [1, 3]):
        n = np.array(accepted)
        toks = np.zeros((2, 2 * K), np.int64)
        feats = np.zeros((2, 2 * K, H), np.float32)
        p = np.zeros((2, 2 * K), np.int64)
        ok = np.zeros((2, 2 * K), bool)
        for b in range(2):
            m = n[b] + 1 + K - 1
            p[b, :m] = start[b] + np.arange(m)
            real = np.arange(m) <= n[b]
            toks[b, :m] = np.where(real, ids[b, p[b, :m]], MASK_ID)
            feats[b, :m] = np.where(real[:, None], comb[b, p[b, :m]], mfeat)
            ok[b, :m] = True
            p[b, m:] = 0  # padding slots: position 0, write nothing
        normed, _, cache = fwd(drafter, jnp.asarray(toks), jnp.asarray(feats), jnp.asarray(p), cache,
                               valid=jnp.asarray(ok))
        got = np.asarray(pjax.models.draft_logits_from_hidden(drafter, normed))
        for b in range(2):
            bonus = start[b] + n[b]
            anchor = np.concatenate([np.arange(s), np.full(K - 1, bonus)])
            depth = np.concatenate([np.zeros(s, int), np.arange(1, K)])
            doc = np.zeros((1, s), int)
            ref = np.asarray(draft_logits(drafter, hs[b:b + 1], ids[b:b + 1], doc, anchor, depth))
            want = ref[[bonus] + list(range(s, s + K - 1))]
            have = got[b, n[b]:n[b] + K]
            assert rel_err(have, want) <= 1e-5
        start = start + n + 1


def test_draft_logits_ignores_padding_slots(drafter):
    """A cod_sample layout pads each depth block with invalid slots at anchor 0: with `valid` they change nothing
    (without it they would join the chain of the real anchor-0 element)."""
    from pjax.train import CodConfig, cod_sample
    rng = np.random.default_rng(1)
    s = 16
    ids, hs = rng.integers(0, V, (1, s)), rng.normal(size=(1, s, A * HT)).astype(np.float32)
    doc = np.zeros((1, s), np.int32)
    lm = np.zeros(s, np.int32)
    lm[[1, 2, 3, 4]] = 1  # few loss positions (the depth blocks are mostly padding), one chain at anchor 0
    lay = jax.jit(cod_sample, static_argnums=2, compiler_options=FAST)(  # op by op: ~100 programs
        jax.random.key(0), lm, CodConfig(num_depths=K, max_anchors=None))
    ok = np.asarray(lay.valid)
    a, d = np.asarray(lay.anchor_pos), np.asarray(lay.depth)
    assert not ok.all() and ((a == 0) & (d > 0) & ok).any()  # without `valid`, the logits differ by ~2
    got = np.asarray(draft_logits(drafter, hs, ids, doc, a, d, valid=ok))[ok]
    want = np.asarray(draft_logits(drafter, hs, ids, doc, a[ok], d[ok]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vocab_helpers(drafter):
    d2t = np.asarray(drafter.d2t)
    ids = np.arange(VD) + d2t
    assert np.all(np.diff(ids) > 0) and ids.max() < V
    np.testing.assert_array_equal(np.asarray(pjax.models.draft_to_target(drafter, jnp.arange(VD))), ids)
    logits = np.random.default_rng(1).normal(size=(2, VD)).astype(np.float32)
    full = np.asarray(logits_to_target_vocab(drafter, jnp.asarray(logits)))
    want = np.full((2, V), -np.inf, np.float32)
    want[:, ids] = logits
    np.testing.assert_array_equal(full, want)
    # greedy over the draft vocab then d2t == argmax over the scattered target vocab
    np.testing.assert_array_equal(ids[logits.argmax(-1)], full.argmax(-1))


def test_combine_matches_numpy(drafter):
    x = np.random.default_rng(2).normal(size=(5, A * HT)).astype(np.float32)
    p = drafter.params
    chunks = np.split(x, A, axis=-1)
    normed = [c / np.sqrt(np.mean(c * c, -1, keepdims=True) + 1e-5) * np.asarray(p["fc_norm"][j]["weight"])
              for j, c in enumerate(chunks)]
    want = np.concatenate(normed, -1) @ np.asarray(p["fc"]["kernel"])
    assert rel_err(pjax.models.combine(drafter, x), want) <= 1e-5
    mh = np.asarray(p["mask_hidden"])
    assert rel_err(pjax.models.mask_feature(drafter), np.asarray(pjax.models.combine(drafter, mh[None]))[0]) == 0.0


# ------------------------------------------------------------------------------------- bad inputs

@pytest.fixture()
def ckpt(tmp_path, drafter):
    """A valid float32 speculators-format head and helpers to corrupt it."""
    path = pjax.save_drafter(drafter, tmp_path / "head", dtype="float32")
    c = Checkpoint(path)
    tensors = {k: np.array(c.get(k)) for k in c.keys()}
    original = json.loads((path / "config.json").read_text())

    def edit(tensors_fn=None, config_fn=None):
        t = dict(tensors)
        if tensors_fn:
            tensors_fn(t)
        save_file(t, path / "model.safetensors")
        hf = json.loads(json.dumps(original))
        if config_fn:
            config_fn(hf)
        (path / "config.json").write_text(json.dumps(hf))
        return path
    return path, tensors, edit


def test_valid_head_loads(ckpt, drafter):
    path, _, _ = ckpt
    again = pjax.load_drafter(path, dtype=jnp.float32, parallel_drafting=True)
    assert again.config == drafter.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_mask_hidden(ckpt):
    path, _, edit = ckpt
    edit(lambda t: t.pop("mask_hidden"))
    with pytest.raises(CheckpointError, match="parallel drafting requested.*mask_hidden"):
        pjax.load_drafter(path, dtype=jnp.float32, parallel_drafting=True)
    d = pjax.load_drafter(path, dtype=jnp.float32)  # sequential use is still possible
    assert not d.config.has_mask_hidden
    with pytest.raises(ValueError, match="mask_hidden"):
        pjax.models.mask_feature(d)
    s = 6
    args = (np.zeros((1, s, A * HT), np.float32), np.zeros((1, s), int), np.zeros((1, s), int))
    with pytest.raises(ValueError, match="mask_hidden"):
        draft_logits(d, *args, np.array([0, 1, 2, 2]), np.array([0, 0, 0, 1]))
    assert draft_logits(d, *args, np.arange(s), np.zeros(s, int)).shape == (s, VD)


def test_wrong_fc_width(ckpt):
    path, tensors, edit = ckpt
    edit(lambda t: t.update({"fc.weight": np.zeros((H, A * HT - 8), np.float32)}))
    with pytest.raises(CheckpointError, match=r"fc\.weight.*\[32, 64\].*expected \[32, 72\]"):
        pjax.load_drafter(path)


def test_d2t_inconsistent_with_t2d(ckpt):
    path, tensors, edit = ckpt
    ids = np.nonzero(tensors["t2d"])[0]
    free = np.nonzero(~tensors["t2d"])[0]

    def corrupt(t):
        t2d = t["t2d"].copy()
        t2d[ids[3]], t2d[free[0]] = False, True
        t["t2d"] = t2d
    edit(corrupt)
    with pytest.raises(CheckpointError, match="d2t is inconsistent with t2d"):
        pjax.load_drafter(path)
    edit(lambda t: t.update(d2t=np.full(VD, V, np.int64)))
    with pytest.raises(CheckpointError, match="outside"):
        pjax.load_drafter(path)


def test_mask_id_out_of_range(ckpt):
    path, _, edit = ckpt
    edit(config_fn=lambda hf: hf.update(mask_token_id=V))
    with pytest.raises(CheckpointError, match=f"mask_token_id={V} is outside the vocabulary"):
        pjax.load_drafter(path)


def test_unknown_norm_flag_combination(ckpt):
    path, _, edit = ckpt
    edit(config_fn=lambda hf: hf.update(norm_before_fc=True, fc_norm=True))
    with pytest.raises(CheckpointError, match="unknown norm flag combination"):
        pjax.load_drafter(path)
    edit(config_fn=lambda hf: hf.update(fc_norm="yes"))
    with pytest.raises(CheckpointError, match="fc_norm"):
        pjax.load_drafter(path)
    # flag off but the tensors are there: strict key set
    edit(config_fn=lambda hf: hf.update(fc_norm=False))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*fc_norm\.0\.weight.*fc_norm is false"):
        pjax.load_drafter(path)


def test_missing_tensor_and_target_checks(ckpt):
    path, _, edit = ckpt
    edit(lambda t: t.pop("layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.up_proj\.weight.*missing"):
        pjax.load_drafter(path)
    edit()
    small = ModelConfig(model_type="llama", vocab_size=V, hidden_size=HT, intermediate_size=8, num_heads=2,
                        layers=(LayerSpec(12, 2, RopeSpec()),) * 3)
    with pytest.raises(CheckpointError, match=r"aux_hidden_state_layer_ids \[1, 2, 4\].*\[4\].*\[0, 3\]"):
        pjax.load_drafter(path, target_config=small)
    ok = dataclasses.replace(small, layers=small.layers * 2)
    assert pjax.load_drafter(path, target_config=ok).config.aux_layer_ids == (1, 2, 4)
    with pytest.raises(CheckpointError, match="hidden_size"):
        pjax.load_drafter(path, target_config=dataclasses.replace(ok, hidden_size=H))


def test_embedding_falls_back_to_target(tmp_path):
    """A head without embed_tokens shares the target's (only possible when H == Ht)."""
    d = pjax.init_drafter(config(target_hidden_size=H), jax.random.key(2), jnp.float32)
    path = pjax.save_drafter(d, tmp_path / "head", dtype="float32")
    c = Checkpoint(path)
    save_file({k: np.array(c.get(k)) for k in c.keys() if k != "embed_tokens.weight"}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="embed_tokens.weight.*missing.*target"):
        pjax.load_drafter(path)
    tcfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=8, num_heads=2,
                       layers=(LayerSpec(16, 2, RopeSpec()),) * 6)
    abstract = pjax.models.abstract_target(tcfg)  # random numpy fill (init_target compiles an RNG per leaf)
    rng = np.random.default_rng(1)
    target = dataclasses.replace(abstract, params=jax.tree.map(
        lambda l: jnp.asarray(rng.standard_normal(l.shape, np.float32)), abstract.params))
    got = pjax.load_drafter(path, dtype=jnp.float32, target=target)
    np.testing.assert_array_equal(np.asarray(got.params["embed_tokens"]["embedding"]),
                                  np.asarray(target.params["embed_tokens"]["embedding"]))


def test_cli_drafter_subcommand(ckpt, tmp_path, capsys):
    from pjax.checkpoint.cli import main
    path, _, _ = ckpt
    out = tmp_path / "copy"
    assert main(["drafter", str(path), str(out), "--dtype", "f32"]) == 0
    a, b = pjax.load_drafter(path, dtype=jnp.float32), pjax.load_drafter(out, dtype=jnp.float32)
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert main(["drafter", str(path), str(out)]) == 2  # exists, no --force
    assert "already exists" in capsys.readouterr().err
