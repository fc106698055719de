"""A draft budget that follows the load (num_speculative_tokens="auto"): the chooser's model and choice on injected
observations; the engine switching budgets chunk by chunk (scripted) with no compilation after warm-up, its greedy
output equal to plain decoding's and its acceptance counters fed to the chooser under slot reuse; rounds driven by
hand through budgets 0..K_max with injected drafts (every accepted-prefix length), the drafter's cache exact after
rounds without drafts."""
import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.decode import EngineConfig, make_spec
from pjax.decode.budget import BudgetChooser, TreeBudget, candidates, expected_tokens, tree_candidates
from pjax.decode.compiled import compile_count
from pjax.decode.engine import Engine, RequestParams
from tests.engine_utils import FAST, make_drafter, round_programs, tiny_pair

V, H = 61, 32  # the shapes of tests/test_engine_stream.py (its plain decoding of PROMPTS is the reference here)
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 10, 33, 8], [30, 31, 32, 33, 34, 35]]
NEW = 20


# ------------------------------------------------------------------------------------------ the chooser


def test_expected_tokens_and_candidates():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0
    assert candidates(7) == (0, 1, 2, 3, 5, 7) and candidates(4) == (0, 1, 2, 3, 4) and candidates(2) == (0, 1, 2)


def _chooser(alpha, seconds=lambda k: 1.0 + 0.1 * k, **kw):
    """A chooser of budgets 0..7 (candidates(7)) that saw acceptance `alpha` at every position (1000 rounds each)."""
    c = BudgetChooser(candidates(7), **{"explore_every": 0, **kw})
    c.set_warm_times({k: seconds(k) for k in c.budgets})
    a = np.asarray(alpha, float)
    tested = 1000 * np.concatenate([[1.0], np.cumprod(a)[:-1]])
    for _ in range(3):
        c.observe_acceptance(tested * a, tested)
    return c


def test_chooser_argmax_of_expected_tokens_per_second():
    c = _chooser([0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    scores = {k: expected_tokens(c.alpha, k) / (1.0 + 0.1 * k) for k in c.budgets}
    np.testing.assert_allclose(c.alpha, [0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1], atol=0.1)  # (the prior fades)
    assert c.choose() == max(scores, key=scores.get) == 3


def test_chooser_zero_when_nothing_is_accepted_long_when_everything_is():
    assert _chooser([0.0] * 7).choose() == 0
    assert _chooser([1.0] * 7).choose() == 7
    # a costly round at high concurrency: long drafts stop paying, short ones still do
    assert _chooser([0.7] * 7, seconds=lambda k: 1.0 + 0.5 * k).choose() == 1


def test_chooser_hysteresis_exploration_and_measured_times():
    c = _chooser([1.0] * 7, seconds=lambda k: 1.0 + 0.1 * k, hysteresis=0.2)
    c.current = 5  # 7 scores 8 / 1.7 = 4.71, 5 scores 6 / 1.5 = 4.0: less than the 1.2x a switch needs
    assert c.choose() == 5
    c.observe_time(5, 3.0)  # slower than at warm-up: so are the budgets not seen since (the same ratio)
    assert c.round_seconds(5) == pytest.approx(0.8 * 1.5 + 0.2 * 3.0)
    assert c.round_seconds(7) == pytest.approx(1.7 * (0.8 + 0.2 * 2.0)) and c.choose() == 5
    c.observe_time(7, 1.0)  # 7 runs faster than that: 8 / 1.83 = 4.37 against 6 / 1.8 = 3.33, a 1.31x gain
    assert c.round_seconds(7) == pytest.approx(0.8 * 1.7 * 1.2 + 0.2 * 1.0) and c.choose() == 7
    c = _chooser([0.0] * 7, explore_every=3)
    assert [c.choose() for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # every third chunk the next larger budget once
    assert c.chunks == {0: 4, 1: 2}
    # a position not tested keeps its estimate; a tested one moves towards what is seen
    c = BudgetChooser((0, 1, 2), prior=0.8)
    c.observe_acceptance([0, 0], [10, 0])
    assert c.alpha[0] < 0.3 and c.alpha[1] == pytest.approx(0.8)
    for bad in (dict(budgets=(0,)), dict(budgets=(-1, 2)), dict(budgets=(0, 1), decay=1.5),
                dict(budgets=(0, 1), explore_every=0.5)):
        with pytest.raises(ValueError, match="BudgetChooser: "):
            BudgetChooser(**bad)


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def models():
    target, _ = tiny_pair(V, H)
    return target, make_drafter(target, num_depths=2)  # K_max = 2: budgets 0, 1, 2


@pytest.fixture(scope="module")
def reference(models):
    return pjax.generate(models[0], None, PROMPTS, max_new_tokens=NEW, drafting="none", compiler_options=FAST).tokens


class Scripted(BudgetChooser):
    """Budgets from a script (cycled), the observations summed."""

    def __init__(self, budgets, script):
        super().__init__(budgets)
        self.script, self.seen = itertools.cycle(script), [0, 0]

    def choose(self):
        k = next(self.script)
        self.chunks[k] += 1
        return k

    def observe_acceptance(self, accepted, tested):
        super().observe_acceptance(accepted, tested)
        self.seen = [self.seen[0] + np.asarray(accepted), self.seen[1] + np.asarray(tested)]


def run_to_end(eng, ids):
    """Step `eng` until it has no work: ({request id: its tokens}, {request id: its final stats})."""
    out, stats = {i: [] for i in ids}, {}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id] += ev.new_tokens
            if ev.finished:
                stats[ev.request_id] = ev.stats
    return out, stats


SCRIPT = (2, 0, 1, 0, 0, 2, 1, 2, 2)


@pytest.mark.full  # the default run switches chains and trees: test_engine_switches_between_chains_and_trees
def test_engine_switches_budgets_without_compiling(models, reference, monkeypatch):
    """Two slots, three requests (a slot is reused): each chunk of 2 rounds runs the script's budget; the tokens are
    plain decoding's, nothing compiles after warm-up, the chooser saw every request's tested / accepted drafts, and
    `generate(num_speculative_tokens="auto")` on the same shapes reuses the engine's chunk programs."""
    target, drafter = models
    max_len = pjax.decode.inputs.bucket_capacity(max(map(len, PROMPTS[:2])) + NEW + 4)
    config = EngineConfig(num_speculative_tokens="auto", max_slots=2, max_len=max_len, rounds_per_step=2,
                          compiler_options=FAST)
    chooser = Scripted(candidates(2), SCRIPT)
    eng = Engine(target, drafter, config, chooser=chooser)
    assert eng.budgets == (0, 1, 2) and eng.spec.state_k == 2 and eng.slack == 4
    eng.precompile_admissions([[3, 8], [6]])
    assert all(t > 0 for t in eng.budget_stats()["round_seconds"].values())
    before = compile_count()
    ids = [eng.submit(p, RequestParams(NEW)) for p in PROMPTS]
    out, stats = run_to_end(eng, ids)
    assert compile_count() == before
    assert [out[i] for i in ids] == reference
    assert set(chooser.chunks) == {0, 1, 2}
    for s in stats.values():
        assert 0 < s["mean_budget"] < 2 and s["tested_per_position"][0] == s["num_drafts"]
        assert len(s["acceptance_rates"]) == 2
    total = lambda key: np.sum([s[key] for s in stats.values()], axis=0)  # noqa: E731
    np.testing.assert_array_equal(chooser.seen[0], total("accepted_per_position"))
    np.testing.assert_array_equal(chooser.seen[1], total("tested_per_position"))

    monkeypatch.setattr(BudgetChooser, "choose", Scripted.choose)
    monkeypatch.setattr(BudgetChooser, "script", itertools.cycle(SCRIPT), raising=False)
    res = pjax.generate(target, drafter, PROMPTS[:2], max_new_tokens=NEW, num_speculative_tokens="auto",
                        rounds_per_step=2, compiler_options=FAST)
    assert res.tokens == reference[:2]
    assert res.stats["num_speculative_tokens"] == "auto" and 0 < res.stats["mean_budget"] < 2
    assert res.stats["budget_stats"]["budgets"] == [0, 1, 2] and len(res.stats["acceptance_rates"]) == 2
    assert compile_count() == before


@pytest.mark.parametrize("tree", [False, True])
def test_budget_timing_runs_distinct_tokens_per_slot(models, tree):
    """The warm-up timing of every budget runs its chunks on free slots holding distinct tokens (a MoE layer's cost
    is the experts its tokens choose: slots of one token would time one token's experts at any K), then puts the
    empty state's tokens back."""
    target, _ = models
    config = EngineConfig(num_speculative_tokens=None if tree else "auto", tree_budget="auto" if tree else None,
                          max_slots=4, max_len=32, rounds_per_step=1, compiler_options=FAST)
    drafter = make_drafter(target, num_depths=2, draft_vocab_size=3) if tree else make_drafter(target, num_depths=1)
    chooser = BudgetChooser((1, TreeBudget(8))) if tree else None  # two of the tree candidates: fewer programs
    eng = Engine(target, drafter, config, chooser=chooser)
    seen, program = [], eng._chunk_program

    def recording(*a, **kw):
        exe = program(*a, **kw)
        return lambda *args: (seen.append(args[2]), exe(*args))[1]
    eng._chunk_program = recording
    eng._time_budgets("sampled", chunks=1)
    assert len(seen) == 2 * len(eng.budgets) and eng.budgets == ((1, TreeBudget(8)) if tree else (0, 1))
    for state in seen:
        assert len(set(np.asarray(state.last).tolist())) == 4
        nodes = np.asarray(state.tree.tokens if tree else state.drafts)
        assert len(set(nodes[:, 0].tolist())) > 1
    s = eng._state  # the free slots hold the empty state's tokens again
    assert not np.asarray(s.last).any() and not np.asarray(s.tree.tokens if tree else s.drafts).any()


def test_chooser_scores_trees_by_measured_tokens():
    """A tree's gain is the measured tokens per row and round (E(K_max) before any); chain acceptance is untouched;
    exploration climbs from the chain K_max through the trees."""
    trees = tree_candidates(7, 32)
    assert trees == (TreeBudget(8), TreeBudget(16), TreeBudget(32)) and tree_candidates(2, 12) == (TreeBudget(8),
                                                                                                   TreeBudget(12))
    c = BudgetChooser(candidates(7) + trees, explore_every=0)
    c.set_warm_times({k: 1.0 + 0.1 * (k.nodes if isinstance(k, TreeBudget) else k) for k in c.budgets})
    tested = 1000 * 0.5 ** np.arange(7)
    for _ in range(3):
        c.observe_acceptance(0.5 * tested, tested)
    assert c.gain(TreeBudget(16)) == pytest.approx(expected_tokens(c.alpha, 7))  # before any measure
    assert c.choose() == 2  # alpha ~0.5: 1.75 / 1.2 beats the chain K_max and the trees (at most 2 / 1.8)
    c.observe_tokens(TreeBudget(8), 4.0)  # a tree of 8 emits 4 tokens a round: 4 / 1.8 beats 1.75 / 1.2
    assert c.gain(TreeBudget(8)) == 4.0 and c.choose() == TreeBudget(8)
    c.observe_tokens(TreeBudget(8), 1.0)  # the average moves by the smoothing
    assert c.gain(TreeBudget(8)) == pytest.approx(0.8 * 4.0 + 0.2 * 1.0)
    c.observe_tokens(TreeBudget(16), 9.0)  # 9 / 2.6 = 3.46 against 3.4 / 1.8
    assert c.choose() == TreeBudget(16) and c.chunks[TreeBudget(16)] == 1
    e = BudgetChooser(candidates(2) + (TreeBudget(8), TreeBudget(12)), explore_every=1)
    e.set_warm_times({k: 1.0 for k in e.budgets})
    e.observe_tokens(TreeBudget(8), 0.0)
    e.observe_tokens(TreeBudget(12), 0.0)
    assert [e.choose() for _ in range(2)] == [TreeBudget(8), TreeBudget(8)]  # from K_max = 2, the next one
    with pytest.raises(ValueError, match="trees of at least"):
        BudgetChooser((0, 3, TreeBudget(2)))


TREE_SCRIPT = (TreeBudget(8), TreeBudget(8), TreeBudget(12), 1, TreeBudget(12), TreeBudget(12), 1, 1, TreeBudget(8))


def test_engine_switches_between_chains_and_trees(models, reference):
    """tree_budget="auto" with a scripted chooser of three of its candidates (fewer programs), two requests: each
    chunk runs the script's chain or tree (tree -> larger tree -> chain -> tree (stale: the chain drafted fewer than
    K_max) -> smaller tree); the tokens are plain decoding's, nothing compiles after warm-up, the chooser measured a
    tree's tokens per round and saw the chains' acceptance only (the rows' tested counts exceed it)."""
    target, _ = models
    drafter = make_drafter(target, num_depths=2, draft_vocab_size=3)  # 3 + 9 paths: N_max = 12, trees 8 and 12
    max_len = pjax.decode.inputs.bucket_capacity(max(map(len, PROMPTS[:2])) + NEW + 14)
    config = EngineConfig(tree_budget="auto", max_slots=2, max_len=max_len, rounds_per_step=2, compiler_options=FAST)
    with pytest.raises(ValueError, match=r"chooser: budgets \['tree 16'\] are not among"):
        Engine(target, drafter, config, chooser=BudgetChooser((1, TreeBudget(16))))
    eng = Engine(target, drafter, config, chooser=Scripted((1,) + tree_candidates(2, 12), TREE_SCRIPT))
    assert eng.budgets == (1, TreeBudget(8), TreeBudget(12)) and eng.spec.state_tree == 12 and eng.slack == 14
    eng.precompile_admissions([[3, 8]])
    before = compile_count()
    ids = [eng.submit(p, RequestParams(NEW)) for p in PROMPTS[:2]]
    out, stats = run_to_end(eng, ids)
    assert compile_count() == before
    assert [out[i] for i in ids] == reference[:2]
    chooser = eng.chooser
    assert set(chooser.chunks) == set(eng.budgets) and chooser._tokens
    total = np.sum([s["tested_per_position"] for s in stats.values()], axis=0)
    assert (chooser.seen[1] < total).all()  # the tree chunks' counts are left out
    assert max(s["mean_budget"] for s in stats.values()) > 2  # trees verified more nodes than the chain K_max
    assert eng.budget_stats()["budgets"] == [1, "tree 8", "tree 12"]


def test_auto_settings_are_checked(models):
    target, drafter = models
    with pytest.raises(ValueError, match="takes chains only"):
        make_spec(target, drafter, EngineConfig(num_speculative_tokens="auto", tree_budget=4), max_new_tokens=4)
    with pytest.raises(ValueError, match="or 'auto'"):
        make_spec(target, drafter, EngineConfig(num_speculative_tokens="fast"), max_new_tokens=4)
    with pytest.raises(ValueError, match="only an engine with num_speculative_tokens='auto'"):
        Engine(target, drafter, EngineConfig(num_speculative_tokens=2), chooser=BudgetChooser((0, 1)))
    with pytest.raises(ValueError, match="num_speculative_tokens must be 'auto' or None"):
        make_spec(target, drafter, EngineConfig(num_speculative_tokens=2, tree_budget="auto"), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs drafting='parallel'"):
        make_spec(target, drafter, EngineConfig(drafting="sequential", tree_budget="auto"), max_new_tokens=4)
    spec = make_spec(target, drafter, EngineConfig(tree_budget="auto"), max_new_tokens=4)
    assert (spec.k, spec.state_k, spec.state_tree, spec.tree_budget, spec.slack) == (2, 2, 32, None, 34)
    spec = make_spec(target, None, EngineConfig(num_speculative_tokens="auto", drafting="none"), max_new_tokens=4)
    assert spec.k == 0 and spec.state_k is None  # plain decoding has no budget to choose


# ------------------------------------------------------------------------------------------ rounds by hand


@pytest.mark.parametrize("drafting", ["sequential", pytest.param("parallel", marks=pytest.mark.full)])
def test_rounds_of_every_budget_with_injected_drafts(models, reference, drafting):
    """Rounds of budgets 0, 1 and 3 over one state of K_max = 3 with drafts taken from the true continuation, cut at
    a chosen index: each round accepts exactly the cut (at most the drafts proposed for that position: a round
    after a smaller budget verifies only those), the output is the target's, and before each round the state's
    fresh drafts equal a new prefill's over everything accepted so far (the drafter's cache is exact, also after
    rounds without drafts)."""
    target = models[0]
    head = make_drafter(target) if drafting == "parallel" else make_drafter(
        target, mask_token_id=None, has_mask_hidden=False, model_kind="eagle3")
    k_max, cap, lp, b = 3, 64, 48, len(PROMPTS)
    base = make_spec(target, head, EngineConfig(num_speculative_tokens="auto", drafting=drafting),
                     max_new_tokens=NEW)
    base = dataclasses.replace(base, num_speculative_tokens=k_max, state_k=k_max)
    samp, run_prefill, round_ = round_programs(target, head, base, b, lp, cap)
    state = run_prefill(PROMPTS)
    rng = np.random.default_rng(0)
    seen, budgets = set(), itertools.cycle((3, 0, 1, 3, 0, 0, 3, 1, 3))
    while not np.asarray(state.done).all():
        k = next(budgets)
        done, num_out, ready = (np.asarray(x) for x in (state.done, state.num_out, state.ready))
        live = ~done
        fresh = run_prefill([PROMPTS[i] + reference[i][:max(num_out[i] - 1, 0)] for i in range(b)])
        have, want = np.asarray(state.drafts), np.asarray(fresh.drafts)
        for i in np.flatnonzero(live):
            np.testing.assert_array_equal(have[i, :ready[i]], want[i, :ready[i]])
        drafts, cut = np.asarray(state.drafts).copy(), np.zeros(b, int)
        for i in range(b):
            m = min(k, ready[i], NEW - num_out[i]) if live[i] else 0
            truth = reference[i][num_out[i]:num_out[i] + m]
            cut[i] = rng.integers(0, m + 1) if m else 0
            drafts[i, :len(truth)] = truth
            if cut[i] < m:
                drafts[i, cut[i]] = (truth[cut[i]] + 1 + rng.integers(0, V - 1)) % V
        before = np.asarray(state.accepted)
        spec = dataclasses.replace(base, num_speculative_tokens=k)
        state = round_(target, head, dataclasses.replace(state, drafts=jnp.asarray(drafts)), samp, spec=spec)
        got = np.asarray(state.accepted) - before
        np.testing.assert_array_equal(got[live], cut[live])
        np.testing.assert_array_equal(np.asarray(state.ready)[live & ~np.asarray(state.done)], k)
        seen.update(got[live].tolist())
    out = np.asarray(state.out)
    assert [out[i, :NEW].tolist() for i in range(b)] == reference
    assert seen == set(range(k_max + 1))
    tested, accepted = np.asarray(state.tested_at), np.asarray(state.accepted_at)
    assert (tested[:, 1:] <= accepted[:, :-1]).all() and (accepted <= tested).all()
