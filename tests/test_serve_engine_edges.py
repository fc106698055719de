"""The serving engine under interleavings the main tests do not walk: random arrivals and cancellations (with keep)
against `pjax.generate` per request in every drafting mode, requests that exactly fill a slot's KV positions, a
request that ends at its prefill token (stop id, max_new_tokens=1) while others wait, the times of cancelled
requests, and the memory of an admission (the target's K/V written in place; a reused slot cleared)."""
import dataclasses
import random
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjax.decode.compiled import jitted
from pjax.serve import RequestParams
from tests.serve_utils import (MAX_LEN, V, assert_free_rows_done, check_against_reference, drain, engine, reference,
                               serve_models)

K = 3


@pytest.fixture(scope="module")
def models():
    return serve_models()  # one pair per process: the programs and references of tests/test_serve_engine.py are shared


def _random_request(rng: random.Random, drafting: str):
    length = rng.randint(1, 20)
    prompt = [rng.randrange(V) for _ in range(length)]
    slack = 0 if drafting == "none" else 2 * K
    new = min(rng.choice([1, 2, 5, 9, 15, 30]), MAX_LEN - length - slack)
    t = rng.choice([0.0, 0.0, 0.9])
    params = RequestParams(new, temperature=t, top_k=rng.choice([0, 0, 3]) if t else 0,
                           top_p=rng.choice([1.0, 0.6]) if t else 1.0, seed=rng.randrange(100),
                           stop_token_ids=tuple(rng.sample(range(V), rng.choice([0, 0, 1, 2]))))
    return prompt, params


# the default run keeps one case per drafting mode, and three slot counts (3: four device rows, three requests)
@pytest.mark.parametrize("seed, drafting, slots", [pytest.param(0, "parallel", 2, marks=pytest.mark.full),
                                                   (1, "parallel", 4), (2, "sequential", 2), (3, "none", 3)])
def test_random_arrivals_and_cancellations_equal_generate(models, seed, drafting, slots):
    """Requests arrive 0-3 at a time between steps and a random live one is cancelled now and then (queued or
    running, with or without keep, sometimes twice): every request finishes once; an uncancelled one equals
    generate's output and statistics; a cancelled one streamed a prefix of it and reports min(streamed, keep).
    Never more than max_slots requests run, though the device rows are a power of two."""
    rng = random.Random(seed)
    eng = engine(models, drafting, max_slots=slots, rounds_per_step=rng.choice([1, 2, 3]))
    running = []
    todo, reqs, outputs, finals, cancelled = 12, {}, {}, {}, {}
    while todo or eng.has_work:
        for _ in range(min(todo, rng.choice([0, 0, 1, 1, 2, 3]))):
            todo -= 1
            prompt, params = _random_request(rng, drafting)
            rid = eng.submit(prompt, params)
            reqs[rid], outputs[rid] = (prompt, params), []
        live = [r for r in reqs if r not in finals and r not in cancelled]
        if live and rng.random() < 0.25:
            rid, keep = rng.choice(live), rng.choice([None, None, 0, 1, 3, 100])
            cancelled[rid] = keep
            eng.cancel(rid, keep=keep)
            if rng.random() < 0.3:
                eng.cancel(rid)  # a second cancel is a no-op
        drain(eng, outputs, finals, steps=1)
        running.append(eng.num_running)
    assert sorted(finals) == sorted(reqs) and cancelled
    assert max(running) == slots and eng.max_slots == 1 << (slots - 1).bit_length()
    for rid, (prompt, params) in reqs.items():
        final, tokens = finals[rid], outputs[rid]
        s = final.stats
        if rid in cancelled and final.stop_reason == "stop":
            ref = reference(models, drafting, prompt, params).tokens[0]
            keep = cancelled[rid]
            assert tokens == ref[:len(tokens)]
            assert s["output_tokens"] == (len(tokens) if keep is None else min(keep, len(tokens)))
            assert (s["tpot_s"] is None) == (s["output_tokens"] <= 1)
            assert s["ttft_s"] is None or 0 <= s["queue_s"] <= s["ttft_s"] <= s["e2e_s"]
        else:
            check_against_reference(models, drafting, prompt, params, tokens, final)


@pytest.mark.parametrize("drafting", ["parallel", "none"])
def test_requests_that_exactly_fill_max_len_stop_on_length(models, drafting):
    """prompt + max_new_tokens + 2K == max_len: the request runs to its limit ("length", never "capacity"), as
    generate at the same cache capacity."""
    slack = 0 if drafting == "none" else 2 * K
    eng = engine(models, drafting, rounds_per_step=1)  # 2 slots, 1 round a step: the random arrivals' "none" engine
    cases = [([(i * 7) % V for i in range(n)], RequestParams(MAX_LEN - n - slack)) for n in (5, 30)]
    ids = [eng.submit(p, q) for p, q in cases]
    outputs, finals = {}, {}
    drain(eng, outputs, finals)
    for rid, (p, q) in zip(ids, cases):
        assert finals[rid].stop_reason == "length" and len(outputs[rid]) == q.max_new_tokens
        check_against_reference(models, drafting, p, q, outputs[rid], finals[rid])


def test_requests_ending_at_their_prefill_token_free_the_slot_at_once(models):
    """A stop id hit by the prefill token and max_new_tokens=1 finish in their admission step (one token, "eos" /
    "length", no rounds, tpot None) and free their slot: the request that waited gets it at the next step."""
    prompt = [5, 7, 3]
    first = reference(models, "parallel", prompt, RequestParams(4)).tokens[0][0]
    eng = engine(models, max_slots=2, rounds_per_step=1)  # test_requests_that_exactly_fill_max_len's engine
    params = [RequestParams(9, stop_token_ids=(first,)), RequestParams(1), RequestParams(6)]
    ids = [eng.submit(prompt, q) for q in params]
    evs = {e.request_id: e for e in eng.step()}
    assert sorted(evs) == ids[:2] and eng.num_running == 0 and eng.num_waiting == 1
    for rid, reason in zip(ids[:2], ("eos", "length")):
        e = evs[rid]
        assert e.finished and e.new_tokens == [first] and e.stop_reason == reason
        assert e.stats["rounds"] == 0 and e.stats["tpot_s"] is None and e.stats["ttft_s"] == e.stats["e2e_s"]
    assert_free_rows_done(eng)
    evs = eng.step()  # nothing runs: the waiting request is admitted at once
    assert [(e.request_id, len(e.new_tokens)) for e in evs] == [(ids[2], 1)] and eng.num_running == 1
    outputs, finals = {ids[2]: evs[0].new_tokens}, {}
    drain(eng, outputs, finals)
    check_against_reference(models, "parallel", prompt, params[2], outputs[ids[2]], finals[ids[2]])


def test_a_cancelled_request_ends_when_cancelled(models):
    """The e2e time of a cancelled request (running or queued) ends at `cancel`, not after the device work of the
    step that reports it (a slow step here: reading its view takes 0.2 s)."""
    eng = engine(models, max_slots=1, rounds_per_step=1)
    t0 = time.perf_counter()
    running = eng.submit([5, 7, 3], RequestParams(30))
    queued = eng.submit([1, 2], RequestParams(30))
    other = eng.submit([4, 4], RequestParams(30))
    drain(eng, {}, {}, steps=2)
    eng.cancel(running)
    eng.cancel(queued)
    t_cancel = time.perf_counter()
    read = eng._read

    def slow_read(*a):
        time.sleep(0.2)
        read(*a)
    eng._read = slow_read
    evs = {e.request_id: e for e in eng.step()}  # admits `other` (a slow step)
    for rid in (running, queued):
        s = evs[rid].stats
        assert evs[rid].finished and evs[rid].stop_reason == "stop"
        assert s["e2e_s"] <= t_cancel - t0, (s, t_cancel - t0)
    assert evs[queued].stats["queue_s"] == evs[queued].stats["e2e_s"]
    s = evs[running].stats
    assert 0 <= s["queue_s"] <= s["ttft_s"] <= s["e2e_s"] and s["tpot_s"] is not None
    assert np.isclose(s["tpot_s"], (s["e2e_s"] - s["ttft_s"]) / (s["output_tokens"] - 1))
    assert evs[other].new_tokens and not evs[other].finished


# the default run keeps parallel (both caches written in place: the bound of "none" with a drafter's cache added) and
# sequential (the drafter's cache built for the admitted rows, then scattered)
@pytest.mark.parametrize("drafting", [pytest.param("none", marks=pytest.mark.full), "parallel", "sequential"])
def test_an_admission_writes_the_caches_in_place(models, drafting):
    """An admission of every slot allocates no second KV cache: its temporary memory grows with the slots' KV
    capacity by the zeros that clear one cache array's rows (here 1/4 of the target's cache) and, with sequential
    drafting, by the drafter's cache built for the admitted rows (then scattered: up to twice its size), not by a
    copy of the caches (the program compiled with its state donated, as on the GPU; before, the growth was 1.27x
    the target's cache growth, 1.18x both caches')."""
    temp, caches = {}, {}
    for max_len in (512, 2048):
        eng = engine(models, drafting, max_slots=16, max_len=max_len)
        args = eng._admission_args([], [], 16, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CPU: donation is compiled in, then ignored when run
            exe = jitted("admit", True).lower(*args, spec=eng.spec, capacity=max_len, cache_dtype=None,
                                              packed_len=None).compile()
        temp[max_len] = exe.memory_analysis().temp_size_in_bytes
        caches[max_len] = [sum(x.nbytes for x in jax.tree.leaves(c))
                           for c in (eng._state.target_cache, eng._state.drafter_cache)]
    grown_target, grown_drafter = (caches[2048][i] - caches[512][i] for i in (0, 1))
    assert grown_target > 0
    in_place, scattered = (grown_target, grown_drafter) if drafting == "sequential" else (
        grown_target + grown_drafter, 0)
    assert temp[2048] - temp[512] <= 0.5 * in_place + 2 * scattered, (temp, caches)


def test_a_reused_slot_is_cleared(models):
    """A slot's old K/V never reach the next request in it: positions past the new prompt hold what an earlier
    request (here: non-finite values, as one that ended "nonfinite" may leave) wrote, and a masked attention weight
    times inf or nan is nan, so the admission clears the slot's rows first."""
    prompt, params = [5, 7, 3], RequestParams(8)
    eng = engine(models, max_slots=1, rounds_per_step=8)  # one slot, generate's chunk: the reference's programs
    s = eng._state
    nan = lambda cache: jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), cache)  # noqa: E731
    eng._state = dataclasses.replace(s, target_cache=nan(s.target_cache), drafter_cache=nan(s.drafter_cache))
    rid = eng.submit(prompt, params)
    outputs, finals = {}, {}
    drain(eng, outputs, finals)
    check_against_reference(models, "parallel", prompt, params, outputs[rid], finals[rid])
