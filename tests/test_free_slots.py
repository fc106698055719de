"""A round computes every slot; a free slot (its request finished, its context still in the cache) must not read that
context: its target and drafter queries sit at positions 0.. (a tile of the cache), the running row's where it is.
Chains (parallel and sequential drafting) and a tree. (The engine's outputs with free and reused slots equal plain
decoding's: tests/test_serve_engine*.py.)"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.decode import EngineConfig, Sampling, make_spec, prefill, spec_round
from pjax.decode.state import STOP_HOST
from pjax.models import attention
from tests.engine_utils import make_drafter, make_eagle3, tiny_pair

K, B, LONG = 3, 4, 40


@pytest.mark.parametrize("drafting,tree_budget", [("parallel", None), ("sequential", None), ("parallel", 6)])
def test_free_slots_read_no_context(drafting, tree_budget, monkeypatch):
    target, _ = tiny_pair(61)
    drafter = make_eagle3(target) if drafting == "sequential" else make_drafter(target, num_depths=K)
    spec = make_spec(target, drafter, EngineConfig(drafting=drafting, num_speculative_tokens=K,
                                                   tree_budget=tree_budget), max_new_tokens=8)
    lengths = jnp.asarray([5, LONG, LONG, LONG], jnp.int32)  # row 0 runs; rows 1-3 hold a finished request's context
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 61, (B, LONG)), jnp.int32)
    sampling = Sampling(jnp.zeros((B,)), jnp.zeros((B,), jnp.int32), jnp.ones((B,)), jnp.zeros((B,), jnp.uint32))
    state = jax.jit(prefill, static_argnames=("spec", "capacity"))(target, drafter, prompts, lengths, sampling,
                                                                   spec=spec, capacity=64)
    free = jnp.arange(B) > 0
    state = dataclasses.replace(state, done=free, stop=jnp.where(free, STOP_HOST, state.stop))
    seen = []
    cache_attention = attention.cache_attention
    monkeypatch.setattr(attention, "cache_attention", lambda q, k, v, q_pos, **kw: (  # also inside a scan
        jax.debug.callback(lambda p: seen.append(np.asarray(p)), q_pos), cache_attention(q, k, v, q_pos, **kw))[1])
    jax.block_until_ready(jax.jit(spec_round, static_argnames="spec")(target, drafter, state, sampling, spec=spec))
    assert len(seen) >= 2  # the target's verify and the drafter's pass(es)
    for q_pos in seen:
        assert q_pos[0].min() >= 5 and q_pos[1:].max() <= 2 * K + 6  # free slots: a tile, not their context
