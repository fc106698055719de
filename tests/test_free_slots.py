"""A round computes every slot; a free slot (its request finished, its context still in the cache) must not read that
context: its target and drafter queries sit at positions 0.. (a tile of the cache), the running rows' where they
are. Chains (parallel and sequential drafting) and a tree; the engine's greedy output is plain decoding's."""
import dataclasses

import jax
import numpy as np
import pytest

import pjax
from pjax.decode import EngineConfig, RequestParams
from pjax.decode.engine import Engine
from pjax.decode.state import RUNNING
from pjax.decode.step import spec_round
from pjax.models import attention
from tests.engine_utils import FAST, make_drafter, make_eagle3, tiny_pair

PROMPTS = [[5, 17, 3, 9, 11, 2, 8], [30, 31, 32, 33, 34], [7, 8, 9]]
NEW, K = 12, 3


@pytest.mark.parametrize("drafting,tree_budget", [("parallel", None), ("sequential", None), ("parallel", 6)])
def test_free_slots_read_no_context(drafting, tree_budget, monkeypatch):
    target, _ = tiny_pair(61)
    drafter = make_eagle3(target) if drafting == "sequential" else make_drafter(target, num_depths=K)
    plain = pjax.generate(target, None, PROMPTS, max_new_tokens=NEW, drafting="none", compiler_options=FAST).tokens
    eng = Engine(target, drafter, EngineConfig(drafting=drafting, num_speculative_tokens=K, tree_budget=tree_budget,
                                               max_slots=4, max_len=64, compiler_options=FAST))
    ids = [eng.submit(p, RequestParams(NEW)) for p in PROMPTS]
    out = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id] += ev.new_tokens
    assert [out[i] for i in ids] == plain
    s = eng._state
    stale = np.asarray(s.pos)
    assert (stale[:3] > len(PROMPTS[2]) + NEW // 2).all()  # the finished requests' contexts are still there
    seen = []
    cache_attention = attention.cache_attention
    monkeypatch.setattr(attention, "cache_attention", lambda q, k, v, q_pos, **kw: (  # also inside a scan
        jax.debug.callback(lambda p: seen.append(np.asarray(p)), q_pos), cache_attention(q, k, v, q_pos, **kw))[1])
    running = dataclasses.replace(s, done=s.done.at[0].set(False), stop=s.stop.at[0].set(RUNNING),
                                  num_out=s.num_out.at[0].set(1), pos=s.pos.at[0].set(20))  # slot 0 runs again
    spec_round(target, drafter, running, eng._sampling, spec=eng._round_specs[K])
    assert len(seen) >= 2  # the target's verify and the drafter's pass(es)
    for q_pos in seen:
        assert q_pos[0].max() >= 20 and q_pos[1:].max() <= 2 * K + 6  # free slots: a tile, not their context
