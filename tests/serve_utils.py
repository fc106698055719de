"""Shared pieces of the serving-engine tests: the tiny pair, an engine over it, `pjax.generate`'s result for one
request alone (cached), draining an engine while checking the event invariants, and the per-request comparison."""
import functools

import numpy as np

import pjax
from pjax.serve import Engine, EngineConfig, Event, RequestParams
from tests.engine_utils import FAST, tiny_pair

V, H = 12, 32  # a small vocabulary: random drafts are accepted now and then, so acceptance counts are exercised
MAX_LEN = 64


@functools.lru_cache(maxsize=None)
def serve_models():
    """The tiny (target, P-EAGLE head) of the serving-engine tests, built once per process (references shared)."""
    return tiny_pair(V, H)


def engine(models, drafting="parallel", acceptance=None, **kw):
    cfg = dict(max_slots=2, max_len=MAX_LEN, num_speculative_tokens=3, drafting=drafting, rounds_per_step=2,
               prefill="padded", compiler_options=FAST)
    return Engine(models[0], models[1] if drafting != "none" else None, EngineConfig(**{**cfg, **kw}),
                  acceptance=acceptance)


_REFS: dict = {}


def _reference(models, drafting, prompt, new, stops=(), temperature=0.0, top_k=0, top_p=1.0, seed=0):
    key = (id(models[0]), drafting, prompt, new, stops, temperature, top_k, top_p, seed)
    if key not in _REFS:
        _REFS[key] = _generate(models, drafting, prompt, new, stops, temperature, top_k, top_p, seed)
    return _REFS[key]


def _generate(models, drafting, prompt, new, stops, temperature, top_k, top_p, seed):
    return pjax.generate(models[0], models[1] if drafting != "none" else None, [list(prompt)], max_new_tokens=new,
                         num_speculative_tokens=3, drafting=drafting, eos_token_id=list(stops) or None,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_len=MAX_LEN,
                         compiler_options=FAST)


def reference(models, drafting, prompt, params: RequestParams):
    """generate's result for one request alone (same cache capacity as the engine)."""
    p = params
    return _reference(models, drafting, tuple(prompt), p.max_new_tokens, tuple(p.stop_token_ids), p.temperature,
                      p.top_k, p.top_p, p.seed)


def assert_free_rows_done(eng: Engine):
    """Every slot without a running request is a done row on the device (it computes nothing more)."""
    done = np.asarray(eng._state.done)
    assert all(done[s] for s in range(eng.max_slots) if s not in eng._slots), done


def drain(eng: Engine, outputs: dict, finals: dict, steps: int = 10 ** 6):
    """Step while there is work (at most `steps` times): stream each request's tokens into outputs[id], its final
    event into finals[id]; checks the event invariants on the way."""
    for _ in range(steps):
        if not eng.has_work:
            return
        for ev in eng.step():
            assert isinstance(ev, Event) and ev.request_id not in finals
            assert ev.new_tokens or ev.finished
            outputs.setdefault(ev.request_id, []).extend(ev.new_tokens)
            if ev.finished:
                finals[ev.request_id] = ev
            else:
                assert ev.stop_reason is None and ev.stats is None
        assert eng.num_running <= eng.max_slots
        assert_free_rows_done(eng)


def check_against_reference(models, drafting, prompt, params, tokens, final):
    ref = reference(models, drafting, prompt, params)
    assert tokens == ref.tokens[0]
    r, s = ref.stats["requests"][0], final.stats
    assert final.stop_reason == r["stop_reason"]
    for key in ("prompt_tokens", "output_tokens", "rounds", "num_drafts", "num_accepted_tokens",
                "mean_acceptance_length", "acceptance_rates"):
        assert s[key] == r[key], key
    assert 0 <= s["queue_s"] <= s["ttft_s"] <= s["e2e_s"]
    assert (s["tpot_s"] is None) == (len(tokens) <= 1)
