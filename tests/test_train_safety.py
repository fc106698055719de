"""Training loses nothing and passes nothing silently: bad training data is refused when read (file and line), a
checkpoint directory that cannot be used is refused before any work, resuming with another setting is refused
naming it, and a non-finite loss stops the run naming the step, with nothing saved or exported past it."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.train.checkpoint import RUN_RECORD, TrainError, check_checkpoint_dir
from pjax.train.data import ByteTokenizer, DataError, RowStream, load_documents, text_document
from pjax.train.loop import train_drafter
from tests.train_utils import byte_training_setup

S, B = 64, 4
FAST = {"xla_backend_optimization_level": 0}
KW = dict(progress=False, compiler_options=FAST)


@pytest.fixture(scope="module")
def setup():
    return byte_training_setup(S, B, draft_vocab_size=200, num_depths=4, max_anchors=None)


@pytest.mark.parametrize("row, match", [
    ('{"input_ids": [1, 2, -1]}', r"d\.jsonl:2: token id -1 \(position 2\) is outside the target's vocabulary "
                                  r"\[0, 260\)"),
    ('{"input_ids": [1, 260, 3]}', r"d\.jsonl:2: token id 260 \(position 1\) is outside"),
    ('{"input_ids": "abc"}', r"d\.jsonl:2: input_ids must be a list of integers"),
    ('{"input_ids": [1, 2.5]}', r"d\.jsonl:2: input_ids must be a list of integers"),
    ('{"input_ids": [1, 99999999999]}', r"d\.jsonl:2: input_ids holds values outside int32"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', r"d\.jsonl:2: loss_mask must be 2 values of 0 / 1"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', r"d\.jsonl:2: loss_mask must be 2 values of 0 / 1"),
    ('[1, 2]', r"d\.jsonl:2: expected a JSON object, got list"),
    ('{"messages": "hi"}', r"d\.jsonl:2: chat message 0 must be a dict"),
    ('{"text": 5}', r"d\.jsonl:2: "),
    ('{"input_ids": [1, 2]', r"d\.jsonl:2: invalid JSON"),
])
def test_bad_rows_name_file_and_line(tmp_path, row, match):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n' + row + "\n")
    with pytest.raises(DataError, match=match):
        load_documents([str(p)], ByteTokenizer(), vocab_size=260)


def test_unreadable_files_are_named(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(DataError, match=r"none\.jsonl: no such file"):
        load_documents([str(tmp_path / "none.jsonl")], tok)
    with pytest.raises(DataError, match=r": is a directory, expected a training file"):
        load_documents([str(tmp_path)], tok)
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8 text"):
        load_documents([str(tmp_path / "latin.jsonl")], tok)


def test_ids_outside_the_vocabulary_are_refused_before_training(setup, monkeypatch):
    target, drafter, stream, cfg = setup
    docs = list(stream.docs)
    docs[3] = dataclasses.replace(docs[3], tokens=docs[3].tokens.copy(), source="chats.jsonl:4")
    docs[3].tokens[7] = 999
    import pjax.train.loop as loop
    monkeypatch.setattr(loop, "make_train_step", lambda *a, **k: pytest.fail("compiled before the data check"))
    with pytest.raises(DataError, match=r"chats\.jsonl:4: token id 999 \(position 7\) is outside the target's "
                                        r"vocabulary \[0, 260\)"):
        train_drafter(target, drafter, RowStream(docs, S, B, seed=1), cfg, **KW)


def test_checkpoint_dir_is_checked_first(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(TrainError, match=r"checkpoint directory .*file: is a file, expected a directory"):
        check_checkpoint_dir(f)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(TrainError, match=r"model: holds other files \(config\.json\), not a pjax training "
                                         r"checkpoint"):
        check_checkpoint_dir(model)
    with pytest.raises(TrainError, match=r"file/sub: cannot be created"):
        check_checkpoint_dir(f / "sub")
    assert check_checkpoint_dir(tmp_path / "new" / "ckpt").is_dir()
    for name in ("200", "300.orbax-checkpoint-tmp-17", RUN_RECORD):  # a checkpoint, a killed save's leftover
        (tmp_path / "new" / "ckpt" / name).mkdir()
    assert check_checkpoint_dir(tmp_path / "new" / "ckpt").is_dir()


def test_resume_with_other_settings_is_refused(setup, tmp_path, capsys):
    target, drafter, stream, cfg = setup
    ckpt = tmp_path / "ckpt"
    train_drafter(target, drafter, stream, cfg, steps=2, checkpoint_dir=ckpt, **KW)
    assert json.loads((ckpt / RUN_RECORD).read_text())["cod.num_depths"] == 4
    capsys.readouterr()

    def refused(match, target=target, drafter=drafter, stream=stream, cfg=cfg):
        with pytest.raises(TrainError, match=r"checkpoint directory .*ckpt: cannot resume: " + match):
            train_drafter(target, drafter, stream, cfg, steps=3, checkpoint_dir=ckpt, **KW)
    refused(r"optim\.lr was 0\.001, this run has 0\.002", cfg=dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, lr=2e-3)))
    refused(r"total_steps was 4, this run has 8", cfg=dataclasses.replace(cfg, total_steps=8))
    refused(r"the training data differs", stream=RowStream(stream.docs, S, B, seed=2))
    other = dataclasses.replace(target, params=jax.tree.map(lambda x: x * 1.5, target.params))
    refused(r"the target's weights differ", target=other)
    refused(r"the training data differs", stream=RowStream(stream.docs[1:], S, B, seed=1))
    deeper = pjax.train.init_drafter_for_target(target, dataclasses.replace(drafter.config, num_depths=6),
                                                jax.random.key(1))
    refused(r"cod\.num_depths was 4, this run has 6 \(also 1 more: head\.num_depths\)", drafter=deeper,
            cfg=dataclasses.replace(cfg, cod=dataclasses.replace(cfg.cod, num_depths=6)))
    wider = pjax.train.init_drafter_for_target(target, dataclasses.replace(
        drafter.config, layer=dataclasses.replace(drafter.config.layer, intermediate_size=96)), jax.random.key(1))
    refused(r"head\.layer\.intermediate_size was 64, this run has 96 \(also 1 more: head\.d2t\)", drafter=wider)
    refused(r"the draft vocabulary \(d2t\) differs", drafter=dataclasses.replace(drafter, d2t=drafter.d2t[::-1]))
    # the same settings resume (a kernel choice may change), saying so
    res = train_drafter(target, drafter, stream, dataclasses.replace(cfg, remat=False), steps=3,
                        checkpoint_dir=ckpt, **KW)
    assert int(res.state.step) == 3
    assert "resumed from step 2" in capsys.readouterr().out
    # a record of another pjax version (a field it lacks, one it had) resumes on the fields both know
    record = json.loads((ckpt / RUN_RECORD).read_text())
    del record["optim.lr"]
    (ckpt / RUN_RECORD).write_text(json.dumps({**record, "retired.field": 1}))
    refused(r"total_steps was 4, this run has 8", cfg=dataclasses.replace(cfg, total_steps=8))
    res = train_drafter(target, drafter, stream, dataclasses.replace(cfg, remat=False), steps=4,
                        checkpoint_dir=ckpt, **KW)
    assert int(res.state.step) == 4


def test_non_finite_loss_stops_at_its_step(setup, tmp_path):
    target, drafter, stream, cfg = setup
    fc = drafter.params["fc"]["kernel"]
    bad = dataclasses.replace(drafter, params={**drafter.params, "fc": {"kernel": fc.at[0, 0].set(jnp.nan)}})
    with pytest.raises(TrainError, match=r"step 1: the loss is nan and the gradient norm nan; training stopped "
                                         r"before saving or exporting"):
        train_drafter(target, bad, stream, cfg, steps=3, log_every=10, save_every=1, checkpoint_dir=tmp_path, **KW)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_RECORD]  # no step saved


def test_text_document_source(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello")
    doc, = load_documents([str(p)], ByteTokenizer(), vocab_size=260)
    assert doc.source == str(p)
    assert text_document("a", ByteTokenizer()).source == ""


# ------------------------------------------------------------------------------ examples/train_peagle.py
@pytest.fixture(scope="module")
def script():
    from tests.example_utils import load_example
    return load_example("train_peagle.py")


@pytest.fixture
def no_training(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("training started")
    import examples.tiny_pair
    monkeypatch.setattr(examples.tiny_pair, "tiny_run", fail)
    monkeypatch.setattr(pjax.train, "train_drafter", fail)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_script_checks_outputs_before_training(script, no_training, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert script.main(["--out", str(taken), "--no-progress"]) == 2
    assert "taken: already exists and is not a pjax output" in one_error(capsys)
    f = tmp_path / "file"
    f.write_text("x")
    assert script.main(["--out", str(tmp_path / "new"), "--checkpoint-dir", str(f), "--no-progress"]) == 2
    assert "file: is a file, expected a directory" in one_error(capsys)
    assert not (tmp_path / "new").exists()


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    from tests.text_utils import build
    return build(tmp_path_factory.mktemp("pair"))[0]


def test_script_refuses_bad_data_and_reports_ctrl_c(script, hf_target, tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n{"input_ids": [1, 400]}\n')
    base = ["--target", str(hf_target), "--out", str(tmp_path / "head"), "--no-progress", "--aux-layer-ids", "0", "1",
            "2", "--batch-rows", "1", "--seq-len", "8"]
    assert script.main(base + ["--data", str(data)]) == 2
    assert "d.jsonl:2: token id 400 (position 1) is outside the target's vocabulary [0, 320)" in one_error(capsys)
    data.write_text('{"text": "hello"}\n')

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pjax.train, "train_drafter", interrupted)
    ckpt = tmp_path / "ckpt"
    assert script.main(base + ["--data", str(data), "--checkpoint-dir", str(ckpt)]) == 130
    assert capsys.readouterr().err == f"interrupted; the checkpoints in {ckpt} are kept (run the same command to " \
                                      "resume)\n"
