"""Greedy exactness of the engine: parallel, sequential and plain decoding equal transformers' greedy `generate` on tiny
checkpoints of every target family (ragged batch, its prefill padded, and packed into one row for P-EAGLE; K in {1, 3,
7, 11}, one per family to bound compile time), and with injected drafts (every accepted-prefix length) the KV
bookkeeping of target and drafter stays exact."""
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from tests.engine_utils import AVAILABLE, FAST, K_OF, NEW, PROMPTS, V, build, round_programs


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_greedy")


# the packed prefill with P-EAGLE (its drafter prefill reads the unpacked target features); tests/test_packed_prefill.py
# checks the packed target prefill itself against the padded one for every family
LAYOUTS = [("parallel", "packed"), ("parallel", "padded"), ("sequential", "padded"), ("none", "padded")]
# the default run keeps every family once, each drafting mode and each prefill layout (parallel with both, K = 3, 7
# and 11 across families, sequential at K = 1 and 11, a sliding window family with each drafting mode); the
# cross-product runs with --full
DEFAULT = {("llama", "parallel", "packed"), ("qwen3", "sequential", "padded"), ("qwen3_moe", "parallel", "padded"),
           ("gpt_oss", "parallel", "packed"), ("gemma4", "sequential", "padded"), ("qwen3", "none", "padded")}


@pytest.mark.parametrize("name,drafting,prefill", [
    pytest.param(name, drafting, prefill, id=f"{name}-{drafting}-{prefill}",
                 marks=() if (name, drafting, prefill) in DEFAULT else pytest.mark.full)
    for name in AVAILABLE for drafting, prefill in LAYOUTS])
def test_greedy_equals_transformers(tmp_root, name, drafting, prefill):
    target, drafter, ref = build(name, tmp_root)
    k = K_OF[name]
    res = pjax.generate(target, drafter, PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k, drafting=drafting,
                        compiler_options=FAST, prefill=prefill)
    assert res.tokens == [r[:NEW] for r in ref]
    assert res.stats["prefill"] == prefill
    assert res.stats["stop_reasons"] == ["length"] * len(PROMPTS)
    assert res.stats["output_tokens"] == NEW * len(PROMPTS)
    if drafting != "none":
        assert res.stats["num_speculative_tokens"] == k and len(res.stats["acceptance_rates"]) == k


@pytest.fixture(scope="module")
def llama(tmp_root):
    return build("llama", tmp_root)


@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_injected_drafts_every_accept_length(llama, drafting):
    """Rounds driven with drafts taken from the true greedy continuation, corrupted at a chosen index c
    (c = K: all correct). Checks: accepted count == c, output == transformers, and before each round
    the engine's own drafts equal those of a fresh prefill over everything accepted so far (so the
    incremental drafter KV cache, with its overwritten mask / EAGLE-3 slots, is exact)."""
    target, drafter, ref = llama
    k, new, cap, lp = 3, 30, 64, 48
    spec = pjax.decode.make_spec(target, drafter, pjax.decode.EngineConfig(num_speculative_tokens=k, drafting=drafting),
                                 max_new_tokens=new)
    b = len(PROMPTS)
    samp, run_prefill, round_ = round_programs(target, drafter, spec, b, lp, cap)

    state = run_prefill(PROMPTS)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(new):
        done = np.asarray(state.done)
        if done.all():
            break
        num_out = np.asarray(state.num_out)
        # the engine's drafts == drafts proposed from scratch over the accepted context
        fresh = run_prefill([PROMPTS[i] + ref[i][:max(num_out[i] - 1, 0)] for i in range(b)])
        live = ~done
        np.testing.assert_array_equal(np.asarray(state.drafts)[live], np.asarray(fresh.drafts)[live])
        drafts, cut = np.zeros((b, k), np.int32), np.full(b, k)
        for i in range(b):
            truth = ref[i][num_out[i]:num_out[i] + k]
            cut[i] = rng.integers(0, k + 1)
            drafts[i] = truth
            if cut[i] < k:
                drafts[i, cut[i]] = (truth[cut[i]] + 1 + rng.integers(0, V - 1)) % V
        before = np.asarray(state.accepted)
        state = round_(target, drafter, dataclasses_replace(state, drafts=jnp.asarray(drafts)), samp, spec=spec)
        got = np.asarray(state.accepted) - before
        np.testing.assert_array_equal(got[live], cut[live])
        seen.update(got[live].tolist())
    out = np.asarray(state.out)
    assert [out[i, :new].tolist() for i in range(b)] == [r[:new] for r in ref]
    assert np.asarray(state.num_out).tolist() == [new] * b
    assert seen == set(range(k + 1))


def dataclasses_replace(state, **kw):
    import dataclasses
    return dataclasses.replace(state, **kw)
