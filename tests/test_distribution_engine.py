"""End-to-end sampling law of the engine (tiny vocabulary, many seeded requests, chi-square).

The joint law of the first two generated tokens (x1 from prefill, x2 from the first speculative round:
an accepted draft or a recovered token) must equal p1(x1) * p2(x2 | x1), where p are the target's
processed distributions (temperature, then top-k, then top-p) computed here independently in numpy from
the target logits. Each case runs N requests of the same prompt with seeds 0..N-1 in one batch.
False-alarm rate: a case fails when the chi-square p-value (cells with expected count >= 5, the rest
pooled) is below ALPHA = 1e-3, i.e. 0.1% per case for a correct engine (0.4% for the file).
"""
import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

import pjax
from tests.engine_utils import FAST, make_drafter, processed, tiny_llama

V, N, ALPHA = 8, 4000, 1e-3
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(V, seed=7, scale=0.5)  # peaked, non-trivial laws

    def peaked(drafter):  # a peaked q, so sampled drafts differ clearly from p
        params = jax.tree.map(lambda x: x, drafter.params)
        params["lm_head"]["kernel"] = 20 * params["lm_head"]["kernel"]
        return dataclasses.replace(drafter, params=params)
    # "small": a draft vocabulary of 6 of the 8 target ids (d2t map; q = 0 outside it)
    return target, {"full": peaked(make_drafter(target)), "small": peaked(make_drafter(target, draft_vocab_size=6))}


def joint_law(target, temperature, top_k, top_p):
    """P(x1, x2) [V, V] from the target logits (one forward over all V continuations)."""
    ids = np.array([PROMPT + [x] for x in range(V)], np.int32)
    logits = np.asarray(pjax.models.target_logits(target, ids))
    p1 = processed(logits[0, len(PROMPT) - 1], temperature, top_k, top_p)
    p2 = np.stack([processed(logits[x, len(PROMPT)], temperature, top_k, top_p) for x in range(V)])
    return p1[:, None] * p2


def chi_square_pvalue(counts, probs):
    exp = probs.ravel() * counts.sum()
    obs = counts.ravel().astype(np.float64)
    big = exp >= 5
    e = np.append(exp[big], exp[~big].sum())
    o = np.append(obs[big], obs[~big].sum())
    if e[-1] < 5:  # pooled cell too small: fold it into the smallest kept cell
        i = np.argmin(e[:-1])
        e[i] += e[-1]
        o[i] += o[-1]
        e, o = e[:-1], o[:-1]
    # an impossible cell that was hit is an immediate failure
    assert not ((probs.ravel() == 0) & (obs > 0)).any(), "sampled a token with zero probability"
    return stats.chisquare(o, e).pvalue


CASES = {
    "parallel_argmax_drafts": dict(drafting="parallel", num_speculative_tokens=3, temperature=1.0),
    "sequential_sampled_drafts_top_k": dict(drafting="sequential", num_speculative_tokens=2, temperature=0.8,
                                            top_k=4, draft_sampling="sample"),
    "parallel_sampled_drafts_small_vocab_top_p": dict(drafting="parallel", num_speculative_tokens=2, temperature=1.3,
                                                      top_p=0.7, draft_sampling="sample", drafter="small"),
    "plain_top_k_top_p": dict(drafting="none", temperature=1.0, top_k=5, top_p=0.9),
}


_RUNS = {}


def run(models, case):
    """(counts [V, V] of (x1, x2), stats) of N seeded requests; cached per case."""
    if case not in _RUNS:
        target, drafters = models
        kw = dict(CASES[case])
        drafter = drafters[kw.pop("drafter", "full")]
        res = pjax.generate(target, drafter, [PROMPT] * N, max_new_tokens=2, seed=list(range(N)),
                            compiler_options=FAST, **kw)
        toks = np.array(res.tokens)
        assert toks.shape == (N, 2)
        counts = np.zeros((V, V), np.int64)
        np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
        _RUNS[case] = counts, res.stats
    return _RUNS[case]


# the default run keeps one case per drafting mode (parallel: argmax drafts; sequential: sampled drafts, top-k; none:
# top-k and top-p); the parallel case with sampled drafts from a smaller draft vocabulary under top-p runs with --full
FULL_CASES = {"parallel_sampled_drafts_small_vocab_top_p"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full if c in FULL_CASES else ()) for c in CASES])
def test_first_two_tokens_follow_target_law(models, case):
    target, _ = models
    kw = CASES[case]
    counts, s = run(models, case)
    law = joint_law(target, kw["temperature"], kw.get("top_k") or 0, kw.get("top_p") or 1.0)
    assert chi_square_pvalue(counts, law) > ALPHA
    if kw["drafting"] != "none":  # both the accepted-draft and the recovered-token paths were taken
        assert 0.05 * N < s["num_accepted_tokens"] and s["acceptance_rates"][0] < 0.95


def test_chi_square_detects_a_wrong_law(models):
    """Power check: the same samples tested against the untruncated law (top-k ignored) must fail."""
    target, _ = models
    kw = CASES["sequential_sampled_drafts_top_k"]
    counts, _ = run(models, "sequential_sampled_drafts_top_k")
    wrong = joint_law(target, kw["temperature"], 0, 1.0)
    with pytest.raises(AssertionError):
        assert chi_square_pvalue(counts, wrong) > ALPHA

