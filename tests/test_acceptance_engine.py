"""The engine's acceptance rate at temperature > 0 is speculative sampling's: drafts are not just distributed right,
they are accepted as often as the theory promises.

With a draft d ~ q and the test u * q(d) < p(d) (u uniform), a draft is accepted with probability
sum_v min(p(v), q(v)), where q is the drafter's processed distribution for that draft (softmax(logits / T), then the
request's top-k and top-p, as the target's) and p the target's processed distribution at the same position; with
argmax drafts (q one-hot) it is p(argmax of the draft logits). A defect that keeps the output law right but wastes
acceptance (drafts one-hot where they should be sampled, q at the wrong temperature, depth or position, a filter on
one side only) passes `test_distribution_engine` and fails here.

Each run decodes M requests of one prompt (seeds 0..M-1, groups of N rows with one (temperature, top-k, top-p) each)
for one round and reads, per request, the first generated token t0 and the verdicts of the round's K = 2 drafts.
The expected rate is computed independently: p from plain target forwards over every continuation (t0, and t0 then
d1), q from the training paths (the COD layout of `pjax.train.draft_logits` for P-EAGLE's depths, the EAGLE-3
training-time test passes for the sequential chain), both processed in numpy. Draft 1 is tested per group given the
drawn t0; draft 2 given that draft 1 was accepted, its t0 and d1, pooled over the groups. A rate fails when it lies
more than Z = 4.5 binomial standard deviations from its expectation (about 0.03 for draft 1; a false alarm ~7e-6
per check, and the seeds are fixed, so the outcome is deterministic). `test_detects_a_lower_acceptance_law` checks
the power: the same verdicts against the rates of the defects named above must fail.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.decode.settings import EngineConfig, make_spec
from pjax.decode.state import Sampling
from pjax.decode.step import prefill, spec_round
from pjax.models.attention import init_step_kv
from pjax.models.drafter import combine, draft_logits_from_hidden, drafter_forward
from pjax.models.pairing import check_pair
from pjax.train import draft_logits, target_features
from pjax.train.data import eagle_shift
from pjax.train.masks import ttt_mask
from tests.engine_utils import FAST, make_drafter, processed, tiny_llama

V, K, N, Z = 8, 2, 4096, 4.5
PROMPT = [3, 1, 4, 1, 5]
L = len(PROMPT)
# (temperature, top_k, top_p) per group of N requests; 4 groups = 16384 rows, a power of two (the row bucket)
GROUPS = {"T=1": (1.0, 0, 1.0), "T=2": (2.0, 0, 1.0), "T=1 top_k=2": (1.0, 2, 1.0),
          "T=1.5 top_k=2 top_p=0.9": (1.5, 2, 0.9)}
MODES = [("parallel", "sample"), ("sequential", "sample"), ("parallel", "argmax"), ("sequential", "argmax")]
# the acceptance-rate tests run every mode but sequential argmax drafts by default (each drafting mode with sampled
# drafts, argmax drafts once); --full adds it
RATE_MODES = [pytest.param(m, marks=pytest.mark.full if m == ("sequential", "argmax") else ()) for m in MODES]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(V, seed=7, scale=0.5)
    drafter = make_drafter(target)
    params = jax.tree.map(lambda x: x, drafter.params)
    params["lm_head"]["kernel"] = 4 * params["lm_head"]["kernel"]  # q between one-hot and p: acceptance near 0.35
    return target, dataclasses.replace(drafter, params=params)


# ------------------------------------------------------------------------------------------ the laws, independently

def shifted_docs(target, drafter, seqs):
    """seqs [n, m]: n documents packed in one row -> the EAGLE-shifted row (doc i's shifted slots at i * (m - 1))."""
    n, m = seqs.shape
    toks = jnp.asarray(seqs.reshape(-1), jnp.int32)
    doc = jnp.asarray(np.repeat(np.arange(n), m), jnp.int32)
    aux, final = target_features(target, toks[None], doc[None], check_pair(target.config, drafter.config))
    return eagle_shift(toks, jnp.ones_like(toks), doc, aux[0], final[0])


def cod_logits(drafter, sh, at, depths):
    """P-EAGLE draft logits [len(at), depths, Vd] at the shifted row's anchors `at` (training layout: depth d at
    position anchor + d with the mask token and mask_hidden)."""
    s, n = sh["input_ids"].shape[0], len(at)
    anc = np.concatenate([np.arange(s)] + [at] * (depths - 1)).astype(np.int32)
    dep = np.concatenate([np.zeros(s)] + [np.full(n, d) for d in range(1, depths)]).astype(np.int32)
    lg = np.asarray(draft_logits(drafter, sh["hidden_states"][None], sh["input_ids"][None], sh["document_ids"][None],
                                 anc, dep))
    return np.stack([lg[at]] + [lg[s + (d - 1) * n:s + d * n] for d in range(1, depths)], 1)


@functools.partial(jax.jit, static_argnames=("steps",), compiler_options=FAST)
def ttt_logits(drafter, sh, at, steps):
    """EAGLE-3 draft logits [len(at), steps, Vd] at the shifted row's anchors `at`: the training-time test's passes
    (pass t feeds the token t + 1 places on and the previous pass's state, at position anchor + t)."""
    ids0, doc = sh["input_ids"], sh["document_ids"]
    s = ids0.shape[0]
    h, ids, pos = combine(drafter, sh["hidden_states"]), ids0, jnp.arange(s, dtype=jnp.int32)
    history = init_step_kv(drafter.config.layer, 1, steps, s, h.dtype)
    out = []
    for t in range(steps):
        normed, prenorm, history = drafter_forward(drafter, ids[None], h[None], (pos + t)[None], history,
                                                   mask=ttt_mask(doc, t, steps))
        out.append(draft_logits_from_hidden(drafter, normed[0])[at])
        h = (normed if drafter.config.norm_output else prenorm)[0]
        ids = jnp.concatenate([ids0[t + 1:], jnp.zeros((t + 1,), jnp.int32)])
    return jnp.stack(out, 1)


@pytest.fixture(scope="module")
def logits(models):
    """Raw logits: target p0 [V] (t0), p1 [t0, V] (d1), p2 [t0, d1, V] (d2); drafter q1 [t0, V] (both modes),
    q2_parallel [t0, d1, V] (the mask slot: d1 unseen), q2_sequential [t0, d1, V] (d1 fed back). One packed row of
    the V * V documents prompt + [t0, d1]."""
    target, drafter = models
    assert drafter.config.draft_vocab_size == V  # draft ids are target ids
    two = np.array([PROMPT + [t, d] for t in range(V) for d in range(V)], np.int32)
    tl = np.asarray(pjax.models.target_logits(target, two)).reshape(V, V, L + 2, V)
    sh = jax.jit(shifted_docs, compiler_options=FAST)(target, drafter, two)
    at = np.arange(V * V) * (L + 1) + L - 1  # anchor L - 1 of each document: token t0, feature of the prompt's last
    cod = cod_logits(drafter, sh, at[::V], 2)  # [t0, depth, V] (documents with d1 = 0; d1 is not seen)
    ttt = np.asarray(ttt_logits(drafter, sh, at, steps=2)).reshape(V, V, 2, V)
    np.testing.assert_allclose(ttt[:, 0, 0], cod[:, 0], atol=1e-4)  # depth 0 is the same pass in both layouts
    return dict(p0=tl[0, 0, L - 1], p1=tl[:, 0, L], p2=tl[:, :, L + 1], q1=cod[:, 0],
                q2_parallel=np.broadcast_to(cod[:, None, 1], (V, V, V)), q2_sequential=ttt[:, :, 1])


def law(x, group):
    """processed(...) over the last axis of x for a group's (temperature, top_k, top_p)."""
    return np.apply_along_axis(processed, -1, x, *group)


def accept_prob(p_logits, q_logits, group, draft_sampling):
    """Acceptance probability of a draft from q against p, elementwise over the leading axes."""
    p = law(p_logits, group)
    if draft_sampling == "argmax":
        return np.take_along_axis(p, np.argmax(q_logits, -1)[..., None], -1)[..., 0]
    return np.minimum(p, law(q_logits, group)).sum(-1)


# ------------------------------------------------------------------------------------------ the engine

_RUNS = {}


def _run(target, drafter, drafting, draft_sampling):
    """The engine's prefill and first round (`prefill`, `spec_round`: what `generate` runs) as one program over all
    groups' rows -> (t0 [M], x2 [M], verdicts [M, K]: the state's accepted_at, which `generate`'s per-position
    acceptance_rates count)."""
    groups = list(GROUPS.values())
    col = lambda i: np.array([g[i] for g in groups for _ in range(N)])  # noqa: E731
    m = N * len(groups)
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=K, drafting=drafting,
                                                   draft_sampling=draft_sampling), max_new_tokens=2)
    sampling = Sampling(jnp.asarray(col(0), jnp.float32), jnp.asarray(col(1), jnp.int32),
                        jnp.asarray(col(2), jnp.float32), jnp.arange(m, dtype=jnp.uint32))

    @functools.partial(jax.jit, compiler_options=FAST)
    def first_round(target, drafter, prompts, sampling):
        st = prefill(target, drafter, prompts, jnp.full((m,), L, jnp.int32), sampling, spec=spec, capacity=16)
        drafts, q = st.drafts, st.draft_probs
        st = spec_round(target, drafter, st, sampling, spec=spec)
        return st.out[:, :2], st.accepted_at, st.num_drafts, drafts, q

    out, accepted_at, num_drafts, drafts, q = jax.device_get(
        first_round(target, drafter, jnp.tile(jnp.asarray(PROMPT), (m, 1)), sampling))
    assert (num_drafts == 1).all() and (out >= 0).all()  # one round verified K drafts in every request
    return out[:, 0], out[:, 1], accepted_at > 0, drafts, q


def run(models, mode, with_drafts=False):
    """(t0 [G, N], x2 [G, N] (d1 when draft 1 was accepted), verdicts [G, N, K]) of one (drafting, draft_sampling);
    with_drafts: and the round's drafts [G, N, K] and their q [G, N, K, V] (None for argmax drafts). Cached per mode."""
    if mode not in _RUNS:
        _RUNS[mode] = _run(*models, *mode)
    g = len(GROUPS)
    t0, x2, v, drafts, q = _RUNS[mode]
    out = t0.reshape(g, N), x2.reshape(g, N), v.reshape(g, N, K)
    if with_drafts:
        out += (drafts.reshape(g, N, K), None if q is None else q.reshape(g, N, K, V))
    return out


def band(hits, expected):
    """(empirical rate, expected rate, Z-sigma half-width) of Bernoulli outcomes with per-trial probabilities."""
    n = len(hits)
    return hits.mean(), expected.mean(), Z * np.sqrt(np.sum(expected * (1 - expected))) / n


def first_expected(logits, mode, group, t0):
    """Per row: draft 1's acceptance probability given its t0."""
    return accept_prob(logits["p1"], logits["q1"], group, mode[1])[t0]


def second_expected(logits, mode, t0, x2, verdicts):
    """Per group: (draft-2 verdicts of the rows that accepted draft 1, their acceptance probabilities given t0, d1)."""
    hits, expected = [], []
    for gi, group in enumerate(GROUPS.values()):
        ok = verdicts[gi, :, 0]
        a2 = accept_prob(logits["p2"], logits[f"q2_{mode[0]}"], group, mode[1])
        hits.append(verdicts[gi, ok, 1])
        expected.append(a2[t0[gi, ok], x2[gi, ok]])
    return np.concatenate(hits), np.concatenate(expected)


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: "-".join(m))
def test_draft_probabilities_are_the_heads_processed_law(models, logits, mode):
    """The q the engine keeps for verification is, for every row and draft, the head's distribution at that draft
    (depth / fed-back token) processed with the row's own temperature, top-k and top-p."""
    t0, _, _, drafts, q = run(models, mode, with_drafts=True)
    for gi, group in enumerate(GROUPS.values()):
        want1 = law(logits["q1"], group)[t0[gi]]
        want2 = law(logits[f"q2_{mode[0]}"], group)[t0[gi], drafts[gi, :, 0]]
        np.testing.assert_allclose(q[gi, :, 0], want1, atol=2e-5, err_msg=f"draft 1, group {group}")
        np.testing.assert_allclose(q[gi, :, 1], want2, atol=2e-5, err_msg=f"draft 2, group {group}")


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("mode", RATE_MODES, ids=lambda m: "-".join(m))
def test_first_draft_acceptance_is_speculative_samplings(models, logits, mode, group):
    t0, _, verdicts = run(models, mode)
    gi = list(GROUPS).index(group)
    emp, exp, half = band(verdicts[gi, :, 0], first_expected(logits, mode, GROUPS[group], t0[gi]))
    assert 0.1 < exp < 0.9 and half < 0.035, (exp, half)  # an informative case
    assert abs(emp - exp) <= half, f"draft 1 accepted at {emp:.4f}, expected {exp:.4f} +- {half:.4f} (N={N})"


@pytest.mark.parametrize("mode", RATE_MODES, ids=lambda m: "-".join(m))
def test_second_draft_acceptance_given_the_first(models, logits, mode):
    t0, x2, verdicts = run(models, mode)
    hits, expected = second_expected(logits, mode, t0, x2, verdicts)
    emp, exp, half = band(hits, expected)
    assert len(hits) > 4000 and half < 0.04, (len(hits), half)
    assert abs(emp - exp) <= half, (f"draft 2 accepted at {emp:.4f} given draft 1, expected {exp:.4f} +- {half:.4f} "
                                    f"({len(hits)} rounds)")


@pytest.mark.parametrize("group, wrong", [
    ("T=1", "one-hot q"), ("T=2", "q at temperature 1"), ("T=1 top_k=2", "q without top-k / top-p"),
    ("T=1.5 top_k=2 top_p=0.9", "q without top-k / top-p")])
def test_detects_a_lower_acceptance_law(models, logits, group, wrong):
    """Power check: the sampled drafts' verdicts tested against the rate of a plausible defect (argmax drafts with q
    one-hot, q at temperature 1, q unfiltered) must fail, for both drafting modes."""
    g = GROUPS[group]
    gi = list(GROUPS).index(group)
    q1 = logits["q1"]
    for drafting in ("parallel", "sequential"):
        t0, _, verdicts = run(models, (drafting, "sample"))
        if wrong == "one-hot q":
            exp = accept_prob(logits["p1"], q1, g, "argmax")[t0[gi]]
        else:
            p = law(logits["p1"], g)
            q = law(q1, (1.0, 0, 1.0) if wrong == "q at temperature 1" else (g[0], 0, 1.0))
            exp = np.minimum(p, q).sum(-1)[t0[gi]]
        emp, e, half = band(verdicts[gi, :, 0], exp)
        assert abs(emp - e) > half, (drafting, group, wrong, emp, e, half)
