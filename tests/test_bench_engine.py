"""The bench's continuous scheduling (`EngineBackend` on pjax.serve.Engine): per-request results equal the static
backend's (tokens, rounds, acceptance, stop reasons), never more than `concurrency` requests in flight, every program
compiled by `prepare`, and the admissions it precompiles cover every admission the run makes."""
import pytest

from pjax.bench.backend import BatchBackend, EngineBackend, Request, RunSettings
from pjax.decode import EngineConfig
from pjax.decode.inputs import bucket_batch, prefill_buckets
from tests.engine_utils import fast_default_compiles, tiny_pair

V = 12
PROMPTS = [[5, 7, 3], [9, 1, 4, 6, 2, 10, 3, 8] * 3, [3, 3, 2, 1, 0, 5], [7] * 17, [1, 2]]


@pytest.fixture(scope="module")
def models():
    return tiny_pair(V)


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    fast_default_compiles(monkeypatch)  # the backends take no compiler options


def test_admissions_are_runs_of_consecutive_requests():
    reqs = [Request(str(i), tuple([1] * n)) for i, n in enumerate([3, 20, 5, 40])]
    padded = EngineBackend.admissions(reqs, 2, 1024, "padded")
    assert padded == {(1, 16, None): (3,), (2, 32, None): (3, 20), (1, 32, None): (20,), (2, 64, None): (5, 40),
                      (1, 64, None): (40,)}  # the first admission of each program
    assert set(EngineBackend.admissions(reqs, 1, 1024, "padded")) == {(1, 16, None), (1, 32, None), (1, 64, None)}
    assert (4, 64, None) in EngineBackend.admissions(reqs, 3, 1024, "padded")  # 3 rows -> the 4-row program
    # packed: (3, 20) -> 23 tokens in 32 positions, (5, 40) -> 45 in 64; (3, 20, 5) + a padding row -> 29 in 32
    auto = EngineBackend.admissions(reqs, 3, 1024, "auto")
    assert {k for k in auto if k[0] > 1} == {(2, 32, 32), (2, 64, 64), (4, 32, 32), (4, 64, 128)}
    assert auto[(4, 32, 32)] == (3, 20, 5)
    assert set(EngineBackend.admissions(reqs, 2, 48, "padded")) >= {(1, 48, None), (2, 48, None)}  # capped at 48


# parallel drafting with every request admitted at once (the default max_admit_rows) runs with --full; the default run
# keeps admissions of at most 2 rows (several admission programs) and plain decoding
@pytest.mark.parametrize("drafting, k, concurrency, admit", [pytest.param("parallel", 2, 3, None,
                                                                          marks=pytest.mark.full),
                                                             ("none", 0, 2, None), ("parallel", 2, 4, 2)])
def test_continuous_equals_static_per_request(models, drafting, k, concurrency, admit):
    target, drafter = models
    requests = [Request(str(i), tuple(p), seed=i) for i, p in enumerate(PROMPTS)]
    settings = RunSettings(drafting=drafting, k=k, concurrency=concurrency, max_new_tokens=14,
                           max_positions=max(map(len, PROMPTS)) + 14 + 2 * 2, eos_token_ids=(4,))
    static = BatchBackend(target, {"parallel": drafter}, EngineConfig(prefill="auto"))
    static.prepare(requests, settings)
    want = static.run(requests, settings)

    cont = EngineBackend(target, {"parallel": drafter},
                         EngineConfig(rounds_per_step=2, prefill="auto", max_admit_rows=admit or 8))
    cont.prepare(requests, settings)
    eng = cont.engine(settings)
    assert eng.max_slots == bucket_batch(concurrency)
    in_flight, admitted, step = [], [], eng.step

    def watched(**kw):
        queued = [r for r in eng._queue.values()]
        events = step(**kw)
        in_flight.append(eng.num_running)
        taken = [r for r in queued if r.id not in eng._queue]  # one admission program per group of max_admit_rows
        a = eng.max_admit_rows
        admitted.extend(prefill_buckets([len(r.prompt) for r in taken[i:i + a]], eng.max_len, eng.prefill)
                        for i in range(0, len(taken), a))
        return events
    eng.step = watched
    progress = []
    got = cont.run(requests, settings, on_progress=progress.append)

    assert max(in_flight) == concurrency and sum(progress) == len(requests)
    assert eng.max_admit_rows == min(admit or 8, bucket_batch(concurrency))
    runs = EngineBackend.admissions(requests, min(concurrency, eng.max_admit_rows), eng.max_len, eng.prefill)
    assert set(admitted) <= set(runs)
    assert any(packed for _, _, packed in admitted)  # the prefill "auto" packed some admission
    assert got.compile_s == 0.0 and got.duration_s > 0  # prepare compiled every program the run used
    for a, b in zip(got.requests, want.requests):
        assert a.tokens == b.tokens
        assert (a.rounds, a.num_drafts, a.accepted_per_position, a.stop_reason) == \
            (b.rounds, b.num_drafts, b.accepted_per_position, b.stop_reason)
        assert 0 < a.ttft_s <= a.e2e_s
    assert {r.stop_reason for r in got.requests} == {"eos", "length"}
    if drafting != "none":
        assert sum(r.num_accepted_tokens for r in got.requests) > 0
    assert cont.engine(settings) is eng  # one engine per configuration, reused by run


def test_a_run_within_its_slots_compiles_only_its_first_admission(models):
    """With no more requests than slots every request is admitted at the first step: `prepare` builds exactly that
    admission's programs (one per group of max_admit_rows), not every run of consecutive requests, and the run
    compiles nothing more."""
    target, _ = models
    requests = [Request(str(i), tuple(p), seed=i) for i, p in enumerate(PROMPTS)]
    settings = RunSettings(drafting="none", k=0, concurrency=len(PROMPTS), max_new_tokens=6,
                           max_positions=max(map(len, PROMPTS)) + 6 + 2)
    cont = EngineBackend(target, {}, EngineConfig(rounds_per_step=2, max_admit_rows=2))
    cont.prepare(requests, settings)
    eng = cont.engine(settings)
    groups = [[len(p) for p in PROMPTS[i:i + 2]] for i in range(0, len(PROMPTS), 2)]
    first = {prefill_buckets(g, eng.max_len, eng.prefill) for g in groups}
    assert set(eng._admit_exe) == first
    assert len(EngineBackend.admissions(requests, 2, eng.max_len, eng.prefill)) > len(first)
    got = cont.run(requests, settings)
    assert got.compile_s == 0.0 and set(eng._admit_exe) == first
    assert all(len(r.tokens) == 6 for r in got.requests)
    assert cont.prepare([], settings) == 0.0  # no requests: no admission, the chunk programs built already


def test_draft_sampling_reaches_the_engine(models):
    """At temperature 1, `draft_sampling="sample"` reaches both backends' engines: static and continuous give the same
    per-request results (seeded draws), and they differ from argmax drafts' (another random stream, another law)."""
    target, drafter = models
    prompts = PROMPTS[:2]
    requests = [Request(str(i), tuple(p), seed=i) for i, p in enumerate(prompts)]
    settings = RunSettings(drafting="parallel", k=2, concurrency=2, max_new_tokens=10,
                           max_positions=max(map(len, prompts)) + 10 + 2 * 2, temperature=1.0)

    def results(backend):
        return [(r.tokens, r.accepted_per_position) for r in backend.run(requests, settings).requests]
    sampled = results(BatchBackend(target, {"parallel": drafter}, EngineConfig(draft_sampling="sample")))
    assert results(EngineBackend(target, {"parallel": drafter},
                                 EngineConfig(rounds_per_step=2, draft_sampling="sample"))) == sampled
    assert results(BatchBackend(target, {"parallel": drafter}, EngineConfig(draft_sampling="argmax"))) != sampled
