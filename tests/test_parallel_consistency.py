"""Train / inference consistency of P-EAGLE parallel drafting with a trained head, end to end: in every engine round
(accepted and rejected drafts alike, one row or several ragged rows) the K parallel drafts equal the teacher-forced
COD prediction (`draft_logits`, anchor = the bonus token's position - 1, depths 0..K-1) on the final greedy
sequence, and the training path (`cod_hidden` over a `cod_sample` layout, online target features, the EAGLE shift)
gives the dense `draft_logits` values. Deep drafts that train well therefore draft the same way (the check behind the
study of why a first pair's deep drafts were rarely accepted: they were under-trained, not mis-drafted)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.decode.settings import EngineConfig, make_spec
from pjax.decode.state import Sampling
from pjax.decode.step import prefill, spec_round
from pjax.models.pairing import check_pair
from pjax.train import CodConfig, cod_sample, draft_logits, target_features
from pjax.train.data import eagle_shift
from pjax.train.losses import cod_hidden
from pjax.train.replay import replay_rounds, teacher_forced_drafts
from examples.tiny_pair import tiny_run

K = 4
FAST = {"xla_backend_optimization_level": 0}  # CPU: much faster compiles of these tiny programs
OPTIMISED = {"xla_backend_optimization_level": 2}  # the training steps: 270 runs of each program (conftest: -O0)


@pytest.fixture(scope="module")
def run():
    return tiny_run(target_steps=150, head_steps=120, batch_rows=4, seq_len=128, num_depths=K, log_every=10,
                    max_files=6, compiler_options=OPTIMISED)


def test_tiny_pair_learns(run):
    """The tiny end-to-end run behind these checks learns: the target LM's loss falls, then the P-EAGLE head's loss
    falls and its accuracy rises at every depth."""
    assert run.target_history[-1][1] < 0.75 * run.target_history[0][1]
    first, last = run.head_history[0], run.head_history[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["acc_all"] > first["acc_all"] + 0.1
    for d in range(K):
        assert last["acc"][d] > first["acc"][d]
    assert last["tokens_per_s"] > 0


def engine_programs(target, dr, rows: int, max_new_tokens: int):
    """(greedy Sampling for `rows` rows, jitted prefill, jitted spec_round, spec) of parallel drafting at K."""
    spec = make_spec(target, dr, EngineConfig(num_speculative_tokens=K, drafting="parallel"),
                     max_new_tokens=max_new_tokens)
    samp = Sampling(jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows), jnp.zeros(rows, jnp.uint32),
                    jnp.full((rows, 1), -1, jnp.int32))
    pre = jax.jit(prefill, static_argnames=("spec", "capacity"), compiler_options=FAST)
    step = jax.jit(spec_round, static_argnames=("spec",), compiler_options=FAST)
    return samp, pre, step, spec


def test_engine_drafts_equal_teacher_forced_cod(run):
    target, dr = run.target, run.drafter
    samp, pre, step, spec = engine_programs(target, dr, 1, 48)
    checked, accepted_rounds = 0, 0
    for doc in run.docs[:3]:
        prompt = doc.tokens[100:140].tolist()
        st = pre(target, dr, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), samp, spec=spec, capacity=128)
        rounds = [(int(st.pos[0]), np.asarray(st.drafts[0]), 0)]
        while not bool(st.done[0]):
            before = int(st.accepted[0])
            st = step(target, dr, st, samp, spec=spec)
            rounds.append((int(st.pos[0]), np.asarray(st.drafts[0]), int(st.accepted[0]) - before))
        seq = prompt + np.asarray(st.out[0, :int(st.num_out[0])]).tolist()
        pred = teacher_forced_drafts(target, dr, seq, K)
        chain, starts = replay_rounds(pred, seq, len(prompt) - 1)
        for i, (pos, drafts, _) in enumerate(rounds[:-1]):
            if pos + K >= len(seq):
                break
            np.testing.assert_array_equal(drafts, pred[pos - 1], err_msg=f"round {i} at position {pos}")
            # the replay from teacher forcing starts its rounds where the engine did and accepts as many drafts
            assert len(prompt) - 1 + starts[i] == pos - 1 and chain[starts[i]].sum() == rounds[i + 1][2], (i, pos)
            checked += 1
            accepted_rounds += rounds[i + 1][2] > 0
    assert checked >= 20 and accepted_rounds >= 3, (checked, accepted_rounds)


def test_ragged_batch_drafts_equal_teacher_forced_cod(run):
    """Three prompts of different lengths decoded together (rows accept different counts, so each round's real tokens
    and mask slots sit at other offsets per row): every row's drafts still equal its teacher-forced COD prediction."""
    target, dr = run.target, run.drafter
    b = 3
    samp, pre, step, spec = engine_programs(target, dr, b, 40)
    prompts = [run.docs[i].tokens[100:100 + n].tolist() for i, n in zip(range(b), (40, 33, 47))]
    toks = np.zeros((b, max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    st = pre(target, dr, jnp.asarray(toks), jnp.asarray([len(p) for p in prompts]), samp, spec=spec, capacity=128)
    rounds = [[(int(st.pos[i]), np.asarray(st.drafts[i]))] for i in range(b)]
    accepted = []
    while not bool(np.all(np.asarray(st.done))):
        live, before = ~np.asarray(st.done), np.asarray(st.accepted)
        st = step(target, dr, st, samp, spec=spec)
        accepted.append(np.where(live, np.asarray(st.accepted) - before, -1))
        for i in np.flatnonzero(live):
            rounds[i].append((int(st.pos[i]), np.asarray(st.drafts[i])))
    accepted = np.asarray(accepted)
    assert (accepted[(accepted >= 0).all(1)] != accepted[(accepted >= 0).all(1)][:, :1]).any()  # rows diverge
    checked = 0
    for i in range(b):
        seq = prompts[i] + np.asarray(st.out[i, :int(st.num_out[i])]).tolist()
        pred = teacher_forced_drafts(target, dr, seq, K)
        for r, (pos, drafts) in enumerate(rounds[i][:-1]):
            if pos + K >= len(seq):
                break
            np.testing.assert_array_equal(drafts, pred[pos - 1], err_msg=f"row {i} round {r} at position {pos}")
            checked += 1
    assert checked >= 20, checked


def test_training_path_matches_dense_draft_logits(run):
    target, dr = run.target, run.drafter
    seq = np.concatenate([run.docs[0].tokens[:60], run.docs[1].tokens[:68]])
    docid = np.asarray([0] * 60 + [1] * 68)
    aux_ids = check_pair(target.config, dr.config)

    @functools.partial(jax.jit, compiler_options=FAST)
    def training_path(target, dr, toks, docid):  # one program (op by op, these take minutes to compile on a CPU)
        aux, final = target_features(target, toks, docid[None], aux_ids)
        sh = eagle_shift(toks[0], jnp.ones((128,), jnp.int32), docid, aux[0], final[0])
        lay = cod_sample(jax.random.key(0), sh["loss_mask"], CodConfig(num_depths=K, max_anchors=None),
                         sh["document_ids"])
        normed = cod_hidden(dr, sh["input_ids"], sh["hidden_states"], sh["document_ids"], lay, num_depths=K)
        return sh, lay, dr.module.logits(normed)

    sh, lay, got = jax.device_get(training_path(target, dr, jnp.asarray(seq, jnp.int32)[None],
                                                jnp.asarray(docid, jnp.int32)))
    v = np.asarray(lay.valid)
    want = np.asarray(draft_logits(dr, sh["hidden_states"][None], sh["input_ids"][None], sh["document_ids"][None],
                                   np.asarray(lay.anchor_pos), np.asarray(lay.depth), valid=v))[v]
    ok = (np.asarray(sh["document_ids"])[np.asarray(lay.anchor_pos)[v]] != -1)
    assert int((np.asarray(lay.depth)[v][ok] >= 2).sum()) > 10
    np.testing.assert_allclose(np.asarray(got)[v][ok], want[ok], atol=1e-4, rtol=1e-4)
