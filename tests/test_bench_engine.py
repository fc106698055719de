"""The bench's continuous scheduling (`EngineBackend` on pjax.serve.Engine): per-request results equal the static
backend's (tokens, rounds, acceptance, stop reasons), never more than `concurrency` requests in flight, every program
compiled by `prepare`, and the admissions it precompiles cover every admission the run makes."""
import pytest

from pjax.bench.backend import BatchBackend, EngineBackend, Request, RunSettings
from pjax.decode.inputs import bucket_batch, bucket_length
from tests.engine_utils import tiny_pair

V = 12
PROMPTS = [[5, 7, 3], [9, 1, 4, 6, 2, 10, 3, 8] * 3, [3, 3, 2, 1, 0, 5], [7] * 17, [1, 2]]


@pytest.fixture(scope="module")
def models():
    return tiny_pair(V)


def test_admissions_are_runs_of_consecutive_requests():
    reqs = [Request(str(i), tuple([1] * n)) for i, n in enumerate([3, 20, 5, 40])]
    assert EngineBackend.admissions(reqs, 2) == {(1, 16): 5, (1, 32): 20, (1, 64): 40, (2, 32): 20, (2, 64): 40}
    assert EngineBackend.admissions(reqs, 1) == {(1, 16): 5, (1, 32): 20, (1, 64): 40}
    assert EngineBackend.admissions(reqs, 3)[(4, 64)] == 40  # 3 rows -> the 4-row program


@pytest.mark.parametrize("drafting, k, concurrency", [("parallel", 2, 3), ("none", 0, 2)])
def test_continuous_equals_static_per_request(models, drafting, k, concurrency):
    target, drafter = models
    requests = [Request(str(i), tuple(p), seed=i) for i, p in enumerate(PROMPTS)]
    settings = RunSettings(drafting=drafting, k=k, concurrency=concurrency, max_new_tokens=14,
                           max_positions=max(map(len, PROMPTS)) + 14 + 2 * 2, eos_token_ids=(4,))
    static = BatchBackend(target, {"parallel": drafter})
    static.prepare(requests, settings)
    want = static.run(requests, settings)

    cont = EngineBackend(target, {"parallel": drafter}, rounds_per_step=2)
    cont.prepare(requests, settings)
    eng = cont.engine(settings)
    assert eng.max_slots == bucket_batch(concurrency)
    in_flight, admitted, step = [], [], eng.step

    def watched():
        in_flight.append(eng.num_running + eng.num_waiting)
        queued = [r for r in eng._queue.values()]
        events = step()
        if queued and not eng._queue:
            admitted.append((bucket_batch(len(queued)), bucket_length(max(len(r.prompt) for r in queued))))
        return events
    eng.step = watched
    progress = []
    got = cont.run(requests, settings, on_progress=progress.append)

    assert max(in_flight) == concurrency and sum(progress) == len(requests)
    assert set(admitted) <= set(EngineBackend.admissions(requests, concurrency))
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
