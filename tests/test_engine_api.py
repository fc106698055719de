"""Engine API: errors, stop conditions (EOS, length, cache capacity), statistics, seeded batch
independence, jax.vmap over the single-sequence round, host loop == device loop, the benchmark's
--tiny smoke run. Reference values are computed independently (plain greedy runs, exact counts)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.decode import EngineConfig, Sampling, make_spec, prefill_single, round_single
from pjax.decode.state import DecodeState
from pjax.decode.step import _emit
from tests.engine_utils import FAST, make_drafter
from tests.example_utils import load_example

V, H = 61, 32
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71 % V, 33, 8, 50, 12, 4], [30, 31, 32, 33, 34, 35]]

def tiny_target(seed=0, layers=2, vocab=V):
    rope = RopeSpec(theta=10000.0)
    cfg = ModelConfig("llama", vocab, H, 64, 4, tuple(LayerSpec(8, 2, rope) for _ in range(layers)), rms_norm_eps=1e-5)
    return pjax.init_target(cfg, jax.random.key(seed), jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def models():
    target = tiny_target()
    return target, make_drafter(target)


gen = functools.partial(pjax.generate, compiler_options=FAST, drafting="parallel", num_speculative_tokens=3)


# ----------------------------------------------------------------------------------------------- errors

def test_errors(models):
    target, drafter = models
    with pytest.raises(ValueError, match="longer than max_len"):
        gen(target, drafter, PROMPTS, max_new_tokens=4, max_len=8)
    for k in (0, -2):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
            gen(target, drafter, PROMPTS, max_new_tokens=4, num_speculative_tokens=k)
    with pytest.raises(ValueError, match="drafting="):
        gen(target, drafter, PROMPTS, max_new_tokens=4, drafting="tree")
    with pytest.raises(ValueError, match="needs a drafter"):
        gen(target, None, PROMPTS, max_new_tokens=4, drafting="parallel")
    with pytest.raises(ValueError, match="vocab_size"):
        gen(target, make_drafter(tiny_target(vocab=V + 3), mask_token_id=V), PROMPTS, max_new_tokens=4)
    wide = dataclasses.replace(target, config=dataclasses.replace(target.config, hidden_size=2 * H))
    with pytest.raises(ValueError, match="target_hidden_size"):
        gen(target, make_drafter(wide), PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"outside the target depth \[0, 2\]"):
        gen(target, make_drafter(target, aux=(0, 1, 3)), PROMPTS, max_new_tokens=4)
    eagle3 = make_drafter(target, mask_token_id=None, has_mask_hidden=False, model_kind="eagle3")
    with pytest.raises(ValueError, match="use drafting='sequential'"):
        gen(target, eagle3, PROMPTS, max_new_tokens=4, num_speculative_tokens=3, drafting="parallel")
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen(target, drafter, PROMPTS, max_new_tokens=0)
    with pytest.raises(ValueError, match="outside"):
        gen(target, drafter, [[1, V]], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        gen(target, drafter, [[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        gen(target, drafter, PROMPTS, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        gen(target, drafter, PROMPTS, max_new_tokens=4, temperature=[1.0, -1.0, 1.0])


# -------------------------------------------------------------------------------------- layouts, stops

def test_prefill_draft_layout_matches_spec_example():
    """peagle.md C.2 worked example, request 0: prefill a0..a4 (pos 0..4), sampled a5, K = 3:
    tokens a1..a5 M M at positions 0..6, features g0..g4 then the mask feature, samples at 4, 5, 6."""
    from pjax.decode.draft import prefill_draft_inputs
    # one program per K (the mask-slot count is static), not one per eager op
    prefill_draft_inputs = jax.jit(prefill_draft_inputs, static_argnums=(3,), static_argnames=("mask_token_id",),
                                   compiler_options=FAST)
    a = jnp.asarray([[10, 11, 12, 13, 14, 0, 0, 0]])  # right-padded to Lp = 8
    tok, fr, pos, valid = prefill_draft_inputs(a, jnp.asarray([5]), jnp.asarray([15]), 3, mask_token_id=99)
    n = int(valid.sum())
    assert n == 7
    assert tok[0, :n].tolist() == [11, 12, 13, 14, 15, 99, 99]
    assert fr[0, :n].tolist() == [0, 1, 2, 3, 4, -1, -1]
    assert pos[0, :n].tolist() == list(range(7))
    assert not valid[0, n:].any()
    assert tok.shape == (1, 8 + 16)  # mask slots padded to 16: the same shapes for K = 2..17
    assert prefill_draft_inputs(a, jnp.asarray([5]), jnp.asarray([15]), 17, mask_token_id=99)[0].shape == (1, 24)
    assert prefill_draft_inputs(a, jnp.asarray([5]), jnp.asarray([15]), 1, mask_token_id=99)[0].shape == (1, 8)


def test_select_drafts_maps_draft_vocab(models):
    """Draft-vocabulary lanes map to target ids through d2t, for argmax drafts and for q (sample mode)."""
    from pjax.decode.draft import select_drafts
    select_drafts = jax.jit(select_drafts, static_argnames=("spec",), compiler_options=FAST)  # one program per mode
    target, _ = models
    drafter = make_drafter(target, draft_vocab_size=20)
    t_ids = np.arange(20) + np.asarray(drafter.d2t)
    assert drafter.d2t is not None and len(set(t_ids)) == 20 and t_ids.max() < V
    logits = np.asarray(np.random.default_rng(0).normal(size=(2, 3, 20)) * 3, np.float32)
    samp = Sampling(jnp.asarray([0.0, 1.0]), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.asarray([1, 2], jnp.uint32))
    pos = jnp.asarray([[5, 6, 7], [5, 6, 7]])
    spec = pjax.decode.EngineSpec(3, "parallel", 8)
    d, q = select_drafts(drafter, logits, samp, pos, spec)
    assert q is None and d.tolist() == t_ids[np.argmax(logits, -1)].tolist()
    d, q = select_drafts(drafter, logits, samp, pos, dataclasses.replace(spec, draft_sampling="sample"))
    q = np.asarray(q)
    assert d[0].tolist() == t_ids[np.argmax(logits[0], -1)].tolist()  # greedy row: argmax, one-hot q
    np.testing.assert_allclose(q[0][np.arange(3), d[0]], 1.0)
    x = np.asarray(logits[1], np.float64)
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(q[1][:, t_ids], ref, rtol=1e-6)
    np.testing.assert_allclose(q[1].sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.isin(np.asarray(d[1]), t_ids))


def test_emit_eos_length_capacity():
    spec = pjax.decode.EngineSpec(num_speculative_tokens=3, drafting="parallel", max_new_tokens=6)
    eos = jnp.asarray([[7, 8]] * 4)
    b, n_buf = 4, spec.out_len
    state = DecodeState(None, None, None, None, None, None, jnp.full((b, n_buf), -1, jnp.int32),
                        jnp.asarray([0, 0, 4, 0]), jnp.zeros(b, bool), jnp.zeros(b, jnp.int32), *([None] * 5))
    tokens = jnp.asarray([[1, 2, 8, 3], [1, 2, 3, 4], [1, 2, 3, -1], [5, 7, -1, -1]])
    count = jnp.asarray([4, 4, 3, 2])
    new_pos = jnp.asarray([10, 10, 10, 20])
    emit = jax.jit(_emit, static_argnames=("spec", "capacity"), compiler_options=FAST)  # one program, not one per op
    out, num_out, done, stop = emit(state, tokens, count, new_pos, jnp.asarray([True, True, True, False]), spec=spec,
                                    capacity=10, eos=eos)
    # row 0: EOS at index 2 -> 3 tokens; row 1: fills capacity; row 2: length cut (4 + 2 = 6); row 3: inactive
    assert num_out.tolist() == [3, 4, 6, 0]
    assert stop.tolist() == [1, 3, 2, 0] and done.tolist() == [True, True, True, False]
    assert out[0, :4].tolist() == [1, 2, 8, -1] and out[2, 4:7].tolist() == [1, 2, -1]


def test_eos_stop(models):
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=12).tokens
    eos = ref[1][4]
    res = gen(target, drafter, PROMPTS, max_new_tokens=12, eos_token_id=[eos])
    for r, got, why in zip(ref, res.tokens, res.stats["stop_reasons"]):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert got == r[:cut] and why == ("eos" if eos in r else "length")


def test_cache_capacity_clean_stop(models):
    """A row that fills its cache stops with exactly capacity - L + 1 tokens, equal to the prefix of an
    unconstrained run (drafts are cut near the end so no verify write falls outside the cache)."""
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=12).tokens
    res = gen(target, drafter, PROMPTS, max_new_tokens=12, max_len=12)
    for p, r, got, why in zip(PROMPTS, ref, res.tokens, res.stats["stop_reasons"]):
        assert why == "capacity" and got == r[:12 - len(p) + 1]


def always_accept(target, drafter):
    """Target whose logits are all 0 (final norm weight 0 -> argmax 0) and a drafter that always
    proposes 0 (lm_head 0): every draft is accepted."""
    tp = jax.tree.map(lambda x: x, target.params)
    tp["norm"]["weight"] = jnp.zeros_like(tp["norm"]["weight"])
    dp = jax.tree.map(lambda x: x, drafter.params)
    dp["lm_head"]["kernel"] = jnp.zeros_like(dp["lm_head"]["kernel"])
    return dataclasses.replace(target, params=tp), dataclasses.replace(drafter, params=dp)


def test_stats_all_accepted(models):
    target, drafter = always_accept(*models)
    k, new = 3, 12
    res = gen(target, drafter, PROMPTS, max_new_tokens=new, num_speculative_tokens=k)
    assert res.tokens == [[0] * new] * 3
    s = res.stats
    rounds = -(-(new - 1) // (k + 1))  # prefill emits 1 token, each round K + 1
    assert s["rounds"] == rounds and s["per_request_rounds"] == [rounds] * 3
    assert s["num_drafts"] == 3 * rounds and s["num_accepted_tokens"] == 3 * rounds * k
    assert s["mean_acceptance_length"] == k + 1 and s["acceptance_rates"] == [1.0] * k
    assert s["output_tokens"] == 3 * new and s["output_tokens_per_s"] > 0 and s["wall_time_s"] > 0
    res = gen(target, drafter, PROMPTS, max_new_tokens=new, num_speculative_tokens=k, eos_token_id=0)
    assert res.tokens == [[0]] * 3 and res.stats["stop_reasons"] == ["eos"] * 3 and res.stats["rounds"] == 0


def test_random_drafter_stats(models):
    target, drafter = models
    s = gen(target, drafter, PROMPTS, max_new_tokens=12).stats
    assert s["num_drafts"] == sum(s["per_request_rounds"]) and s["num_draft_tokens"] == 3 * s["num_drafts"]
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert s["output_tokens"] == 36 and s["stop_reasons"] == ["length"] * 3


# ---------------------------------------------------------------------------- randomness and batching

SAMPLED = dict(max_new_tokens=12, num_speculative_tokens=3, temperature=1.0)


def test_seeded_alone_equals_in_batch(models):
    target, drafter = models
    batch = gen(target, drafter, PROMPTS, seed=[11, 12, 13], **SAMPLED)
    again = gen(target, drafter, PROMPTS, seed=[11, 12, 13], **SAMPLED)
    assert batch.tokens == again.tokens
    other = gen(target, drafter, PROMPTS, seed=[11, 99, 13], **SAMPLED)
    assert other.tokens[0] == batch.tokens[0] and other.tokens[1] != batch.tokens[1]
    # alone, or in another batch (other neighbours and order), request (PROMPTS[1], seed 12) is unchanged
    alone = gen(target, drafter, [PROMPTS[1]], seed=12, **SAMPLED)
    mixed = gen(target, drafter, [PROMPTS[2], [7, 7, 7, 7], PROMPTS[1]], seed=[5, 6, 12], **SAMPLED)
    assert alone.tokens[0] == batch.tokens[1] == mixed.tokens[2]
    # greedy and sampled rows in one batch: the greedy row equals plain greedy decoding
    greedy = gen(target, drafter, PROMPTS, **dict(SAMPLED, temperature=0.0))
    mixed_t = gen(target, drafter, PROMPTS, seed=[11, 12, 13], **dict(SAMPLED, temperature=[1.0, 0.0, 1.0]))
    assert mixed_t.tokens[1] == greedy.tokens[1] and mixed_t.tokens[0] == batch.tokens[0]
    assert greedy.tokens != batch.tokens


@pytest.mark.full  # tests/test_engine_stream.py::test_chunked_equals_one_call_and_one_round_per_call checks it per mode
def test_one_round_per_call_equals_chunks(models):
    target, drafter = models
    dev = gen(target, drafter, PROMPTS, seed=[11, 12, 13], **SAMPLED)
    host = gen(target, drafter, PROMPTS, seed=[11, 12, 13], rounds_per_step=1, **SAMPLED)
    assert host.tokens == dev.tokens and host.stats["rounds"] == dev.stats["rounds"]


@pytest.mark.parametrize("tree_budget, sampling", [(None, None), (6, None), (None, "sampled")])
def test_vmap_single_round_equals_batched_engine(models, tree_budget, sampling):
    """The research API: vmap the single-sequence prefill / round over sequences with their own seeds (a chain, or a
    tree of 6 nodes; the rows' sampling decided per round, or fixed in the spec)."""
    target, drafter = models
    batched = gen(target, drafter, PROMPTS, seed=[11, 12, 13], tree_budget=tree_budget, **SAMPLED)
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=3, drafting="parallel",
                                                   tree_budget=tree_budget), max_new_tokens=12)
    spec = dataclasses.replace(spec, sampling=sampling)
    b = len(PROMPTS)
    pad = np.zeros((b, 16), np.int32)
    for i, p in enumerate(PROMPTS):
        pad[i, :len(p)] = p
    samp = Sampling(jnp.ones(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.asarray([11, 12, 13], jnp.uint32))
    init = jax.jit(jax.vmap(functools.partial(prefill_single, spec=spec, capacity=64), in_axes=(None, None, 0, 0, 0)),
                   compiler_options=FAST)
    step = jax.jit(jax.vmap(functools.partial(round_single, spec=spec), in_axes=(None, None, 0, 0)),
                   compiler_options=FAST)
    state = init(target, drafter, jnp.asarray(pad), jnp.asarray([len(p) for p in PROMPTS]), samp)
    assert state.drafts.shape == ((b, 3) if tree_budget is None else (b, 0))
    while not bool(state.done.all()):
        state = step(target, drafter, state, samp)
    got = [np.asarray(state.out)[i, :int(state.num_out[i])].tolist() for i in range(b)]
    assert got == batched.tokens


# ------------------------------------------------------------------------------------------- benchmark

# The benchmark script's run: with --full (the rounds it times are checked by the engine tests).
@pytest.mark.full
def test_bench_engine_tiny(tmp_path, monkeypatch):
    mod = load_example("benchmarks/bench_engine.py")
    monkeypatch.setenv("OUT", str(tmp_path))
    result = mod.main(["--tiny", "--ks", "2", "--calls", "1", "--rounds", "2"])
    assert (tmp_path / "bench_engine.json").exists()
    assert {"drafter_pass", "round", "loop"} <= set(result)


def test_trained_depth_warning(models):
    target, _ = models
    drafter = make_drafter(target, num_depths=2)
    with pytest.warns(UserWarning, match="trained for"):
        make_spec(target, drafter, EngineConfig(num_speculative_tokens=3, drafting="parallel"), max_new_tokens=4)
