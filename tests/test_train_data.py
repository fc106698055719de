"""Training data: packing + EAGLE shift (spec D.1), draft vocabulary (spec A.8), chat loss masks,
online target features."""
import dataclasses
import json

import numpy as np
import pytest
import torch

speculators = pytest.importorskip("speculators")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pjax.config import LayerSpec, ModelConfig, RopeSpec  # noqa: E402
from pjax.models.target import forward, init_target  # noqa: E402
from pjax.train.data import (ByteTokenizer, DataError, Document, FeatureStream, RowStream,  # noqa: E402
                             build_vocab_mapping, chat_document, eagle_shift, load_documents, pack_documents,
                             save_feature_sample, shift_and_pack_features, token_frequencies)
from pjax.train.target_features import target_features  # noqa: E402
from speculators.models.eagle3.data import shift_batch  # noqa: E402
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these small programs


def samples(lengths, a=6, h=2, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        out.append(dict(input_ids=rng.integers(0, 50, n), loss_mask=(rng.random(n) < 0.7).astype(np.int64),
                        hidden_states=rng.normal(size=(n, a)).astype(np.float32),
                        verifier_last_hidden_states=rng.normal(size=(n, h)).astype(np.float32)))
    return out


def speculators_row(smps, total):
    """Per-sample speculators shift_batch, then concatenation (speculators CollateFn packing)."""
    cols = {k: [] for k in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states", "doc")}
    for i, s in enumerate(smps):
        b = {k: torch.tensor(v) for k, v in s.items()}
        n = len(s["input_ids"])
        b.update(lengths=torch.tensor([n]), position_ids=torch.arange(n))
        sh = shift_batch(b)
        for k in cols:
            if k != "doc":
                cols[k].append(sh[k].numpy())
        cols["doc"].append(np.full(n - 1, i))
    cat = {k: np.concatenate(v) for k, v in cols.items()}
    pad = total - len(cat["doc"])
    cat["doc"] = np.concatenate([cat["doc"], -np.ones(pad, int)])
    for k in ("input_ids", "loss_mask"):
        cat[k] = np.concatenate([cat[k], np.zeros(pad, int)])
    for k in ("hidden_states", "verifier_last_hidden_states"):
        cat[k] = np.concatenate([cat[k], np.zeros((pad,) + cat[k].shape[1:], np.float32)])
    return cat


def test_pack_and_shift_match_speculators():
    smps = samples([7, 12, 5])
    total = 30
    rows = pack_documents([Document(s["input_ids"], s["loss_mask"]) for s in smps], total)
    assert len(rows) == 1
    r = rows[0]
    aux = np.concatenate([s["hidden_states"] for s in smps] + [np.zeros((6, 6), np.float32)])
    fin = np.concatenate([s["verifier_last_hidden_states"] for s in smps] + [np.zeros((6, 2), np.float32)])
    ours = jax.jit(eagle_shift)(r.tokens, r.loss_mask, r.document_ids, aux, fin)
    ref = speculators_row(smps, total)
    np.testing.assert_array_equal(ours["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(ours["loss_mask"], ref["loss_mask"])
    np.testing.assert_array_equal(ours["document_ids"], ref["doc"])
    np.testing.assert_array_equal(ours["hidden_states"], ref["hidden_states"])
    np.testing.assert_array_equal(ours["verifier_last_hidden_states"], ref["verifier_last_hidden_states"])
    off = shift_and_pack_features(smps, total)  # offline path (features from disk)
    np.testing.assert_array_equal(off["input_ids"][0], ref["input_ids"])
    np.testing.assert_array_equal(off["document_ids"][0], ref["doc"])
    np.testing.assert_array_equal(off["hidden_states"][0], ref["hidden_states"])


def test_feature_stream_packs_splits_and_reads_files(tmp_path):
    """Offline features: files round-trip, vLLM's [n, A+1, Ht] capture equals the split layout, samples longer than
    a row are cut into pieces (no position lost), batches are deterministic, bad files fail naming the tensor."""
    smps = samples([7, 12, 5, 40, 9], a=6, h=3)
    paths = []
    for i, smp in enumerate(smps):
        paths.append(str(tmp_path / f"s{i}.safetensors"))
        if i % 2:  # vLLM capture layout: A = 2 aux layers of Ht = 3, then the verifier's last state
            smp = dict(input_ids=smp["input_ids"], loss_mask=smp["loss_mask"], hidden_states=np.concatenate(
                [smp["hidden_states"].reshape(-1, 2, 3), smp["verifier_last_hidden_states"][:, None]], axis=1))
        save_feature_sample(paths[-1], smp)
    mem, disk = FeatureStream(smps, 16, 2, seed=4), FeatureStream(paths, 16, 2, seed=4)
    assert mem.batches_per_epoch == disk.batches_per_epoch >= 2
    for i in (0, 1, mem.batches_per_epoch + 1):
        b1, b2 = mem.batch(i), disk.batch(i)
        assert set(b1) == {"input_ids", "loss_mask", "document_ids", "hidden_states", "verifier_last_hidden_states"}
        for k in b1:
            np.testing.assert_array_equal(b1[k], b2[k])
        assert b1["hidden_states"].shape == (2, 16, 6) and b1["verifier_last_hidden_states"].shape == (2, 16, 3)
    # every shifted position of every sample lands in exactly one row of an epoch
    assert sum(n for row in mem._plan(0) for _, _, n in row) == sum(len(s["input_ids"]) - 1 for s in smps)
    # one row holding everything equals the one-row packer (which is checked against speculators above)
    one = FeatureStream(smps[:3], 32, 1, shuffle=False).batch(0)
    ref = shift_and_pack_features(smps[:3], 32)
    for k in ref:
        np.testing.assert_array_equal(one[k], ref[k])
    bad = tmp_path / "bad.safetensors"
    from pjax.checkpoint.safetensors import save_file
    save_file(dict(input_ids=np.arange(5, dtype=np.int32), hidden_states=np.zeros((4, 6), np.float32)), bad)
    with pytest.raises(DataError, match="bad.safetensors.*hidden_states"):
        FeatureStream([str(bad)], 16, 1).batch(0)
    with pytest.raises(DataError, match="no such feature file"):
        FeatureStream([str(tmp_path / "missing.safetensors")], 16, 1)


def test_packing_splits_and_stream_is_deterministic():
    docs = [Document(np.arange(n) % 7, np.ones(n)) for n in (5, 40, 1, 9, 3)]
    rows = pack_documents(docs, 16)
    assert all(r.tokens.shape == (16,) for r in rows)
    kept = sum(int((r.document_ids != -1).sum()) for r in rows)
    assert kept == 5 + 40 + 9 + 3  # the 1-token document is dropped, the 40-token one split
    for r in rows:  # document ids count up from 0 in every row, padding only at the end
        d = r.document_ids[r.document_ids != -1]
        assert (np.diff(d) >= 0).all() and d[0] == 0 and (r.document_ids[len(d):] == -1).all()
    s1, s2 = RowStream(docs, 16, 2, seed=3), RowStream(docs, 16, 2, seed=3)
    for i in (0, 5, 1, 7):
        b1, b2 = s1.batch(i), s2.batch(i)
        assert all(np.array_equal(b1[k], b2[k]) for k in b1)


@pytest.mark.parametrize("vd", [5, 12])
def test_vocab_mapping_matches_speculators(vd):
    docs = [Document([3, 3, 7, 9, 9, 9, 1, 4], [1, 1, 1, 1, 1, 1, 0, 1]), Document([7, 2, 4, 4], [1, 0, 1, 0])]
    freq = token_frequencies(docs)
    assert freq == {3: 2, 7: 2, 9: 3, 4: 2}  # ties broken by id
    d2t, t2d = build_vocab_mapping(freq, vd, 20)
    rd2t, rt2d = build_vocab_mappings_from_distribution(freq, vd, 20)
    np.testing.assert_array_equal(d2t, rd2t.numpy())
    np.testing.assert_array_equal(t2d, rt2d.numpy())


def test_chat_rows_and_jsonl(tmp_path):
    tok = ByteTokenizer()
    msgs = [dict(role="user", content="hi"), dict(role="assistant", content="yo!"),
            dict(role="user", content="q"), dict(role="assistant", content="ok")]
    doc = chat_document(msgs, tok)
    sup = tok.decode(doc.tokens[doc.loss_mask == 1])
    assert sup == "yo!ok"  # assistant contents (+ their eos, not decodable) only
    assert int(doc.loss_mask.sum()) == len("yo!ok") + 2
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [dict(messages=msgs), dict(text="abc"),
                                                    dict(input_ids=[1, 2, 3], loss_mask=[0, 1, 1])]))
    docs = load_documents([str(p)], tok)
    np.testing.assert_array_equal(docs[0].tokens, doc.tokens)
    np.testing.assert_array_equal(docs[1].tokens, [tok.bos_token_id, 97, 98, 99])
    np.testing.assert_array_equal(docs[2].loss_mask, [0, 1, 1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1.*'text'"):
        load_documents([str(bad)], tok)


def test_online_features_match_per_document_forward():
    """Packed rows with document-causal attention (sliding window + sinks layer, query chunks) give
    the same aux / final states as running every document alone from position 0."""
    spec = LayerSpec(16, 2, RopeSpec())
    cfg = ModelConfig("llama", 64, 32, 64, 2, (dataclasses.replace(spec, sliding_window=5), spec, spec, spec),
                      sinks=True)
    t = init_target(cfg, jax.random.key(0), scale=0.2)
    t = dataclasses.replace(t, params=jax.tree.map(lambda x: x, t.params))
    for layer in t.params["layers"].values() if isinstance(t.params["layers"], dict) else t.params["layers"]:
        layer["self_attn"]["sinks"] = jnp.linspace(-1.0, 1.0, 2)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 64, (2, 40)).astype(np.int32)
    doc = np.array([[0] * 10 + [1] * 25 + [-1] * 5, [0] * 40])
    aux, fin = jax.jit(lambda t, x, d: target_features(t, x, d, (1, 2, 4), chunk=7), compiler_options=FAST)(
        t, toks, doc)
    spans = [(0, 0, 10), (0, 10, 35), (1, 0, 40)]
    alone = np.zeros((3, 40), np.int32)  # each document alone from position 0 (causal: tail padding is inert)
    for i, (b, s, e) in enumerate(spans):
        alone[i, :e - s] = toks[b, s:e]
    out = jax.jit(lambda t, x: forward(t, x, jnp.broadcast_to(jnp.arange(40), (3, 40)), aux_layer_ids=(1, 2, 4),
                                       return_final=True), compiler_options=FAST)(t, alone)
    for i, (b, s, e) in enumerate(spans):
        for ours, ref in ((aux[b, s:e], out.aux[i, :e - s]), (fin[b, s:e], out.final[i, :e - s])):
            err = np.linalg.norm(np.asarray(ours) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
            assert err < 1e-5
