"""The continuous-batching engine (pjax.serve.Engine): every request's output equals `pjax.generate`'s for it alone
(greedy and sampled, every drafting mode, more requests than slots, staggered arrivals, stop ids), slots are reused,
cancellation (running and queued, with keep), events concatenate to the output, statistics match generate's, a
sweep of admissions compiles a bounded number of programs, and every bad value is refused naming its field."""
import pytest

import pjax
from pjax.bench.simulate import SimulatedAcceptance
from pjax.decode.state import SAMPLING_MODES, sampling_modes, sampling_need
from pjax.serve import Engine, EngineConfig, RequestParams
from tests.engine_utils import FAST
from tests.serve_utils import (MAX_LEN, V, assert_free_rows_done, check_against_reference, drain, engine, reference,
                               serve_models)

PROMPTS = [[5, 7, 3], [9, 1, 4, 6, 2, 10, 3, 8], [3, 3, 2, 1, 0, 5], [7] * 20, [1, 2], [4, 0, 11, 9, 8]]
NEW = [10, 20, 5, 12, 16, 7]


@pytest.fixture(scope="module")
def models():
    return serve_models()


# sequential drafting's and plain decoding's arrivals with --full (their engines are checked by
# tests/test_serve_engine_edges.py: random arrivals and cancellations)
@pytest.mark.parametrize("drafting", ["parallel", pytest.param("sequential", marks=pytest.mark.full),
                                      pytest.param("none", marks=pytest.mark.full)])
def test_greedy_equals_generate_with_staggered_arrivals(models, drafting):
    """Six requests through two slots, arriving in two waves while others decode; some stop on an EOS id."""
    params = [RequestParams(n) for n in NEW]
    for i in (1, 4):  # stop on a token these requests emit at their 4th position (generate stops there too)
        tok = reference(models, drafting, PROMPTS[i], params[i]).tokens[0][3]
        params[i] = RequestParams(NEW[i], stop_token_ids=(V - 1, tok))
    eng = engine(models, drafting)
    outputs, finals = {}, {}
    ids = [eng.submit(p, q) for p, q in zip(PROMPTS[:3], params[:3])]
    assert eng.num_waiting == 3 and eng.num_running == 0
    drain(eng, outputs, finals, steps=1)
    assert eng.num_running + len(finals) == 2 and eng.num_waiting == 1
    ids += [eng.submit(p, q) for p, q in zip(PROMPTS[3:], params[3:])]
    drain(eng, outputs, finals)
    assert not eng.has_work and eng.num_running == eng.num_waiting == 0
    assert sorted(finals) == ids
    for rid, p, q in zip(ids, PROMPTS, params):
        check_against_reference(models, drafting, p, q, outputs[rid], finals[rid])
    assert {finals[i].stop_reason for i in ids} == {"eos", "length"}
    if drafting != "none":
        assert sum(finals[i].stats["num_accepted_tokens"] for i in ids) > 0  # acceptance is exercised


def test_sampled_output_does_not_depend_on_the_other_requests(models):
    params = [RequestParams(14, temperature=1.0, seed=3), RequestParams(9, temperature=1.0, top_p=0.7, seed=4),
              RequestParams(12, temperature=0.8, top_k=3, seed=5), RequestParams(11, seed=6)]
    prompts = PROMPTS[:4]
    together, finals = {}, {}
    eng = engine(models, max_slots=4)
    ids = [eng.submit(p, q) for p, q in zip(prompts, params)]
    drain(eng, together, finals)
    for rid, p, q in zip(ids, prompts, params):
        alone, alone_final = {}, {}
        solo = engine(models, max_slots=4)
        solo_id = solo.submit(p, q)
        drain(solo, alone, alone_final)
        assert alone[solo_id] == together[rid]
        check_against_reference(models, "parallel", p, q, together[rid], finals[rid])
    # the seed matters: another seed gives another output for the same prompt
    other = engine(models, max_slots=4)
    oid = other.submit(prompts[0], RequestParams(14, temperature=1.0, seed=99))
    out = {}
    drain(other, out, {})
    assert out[oid] != together[ids[0]]


def test_sampling_modes_are_the_modes_of_the_rows():
    """The chunk programs a batch can need as its rows finish: each row's own need (any subset needs its strictest
    row's); a greedy row's top-k / top-p do not count."""
    greedy, sampled, filtered, greedy_filtered = (0.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 5, 1.0), (0.0, 5, 0.9)
    assert sampling_need([greedy, greedy_filtered]) == "greedy" and sampling_need([greedy, filtered]) == "filtered"
    assert sampling_modes([greedy_filtered]) == ("greedy",)
    assert sampling_modes([sampled, sampled]) == ("sampled",)  # no greedy program: never all rows greedy
    assert sampling_modes([filtered, (0.7, 0, 0.9)]) == ("filtered",)
    assert sampling_modes([filtered, greedy]) == ("greedy", "filtered")
    assert sampling_modes(iter([sampled, greedy, filtered])) == SAMPLING_MODES


def test_chunks_truncate_only_while_a_request_filters(models):
    """The chunk programs with the top-k / top-p truncation (a vocabulary sort per position) run only while a running
    sampled request asks for it, and no chunk or admission program branches on the device (on a GPU a branch stops
    the host in every round)."""
    eng = engine(models, max_slots=2)
    used, program = [], eng._chunk_program
    eng._chunk_program = lambda fixed, k=None: used.append(eng._needs() == "filtered") or program(fixed, k)
    eng.submit(PROMPTS[0], RequestParams(3, temperature=1.0, top_k=3, top_p=0.5))
    eng.submit(PROMPTS[1], RequestParams(40))
    while eng.num_running + eng.num_waiting == 2:
        eng.step()
    n = len(used)
    while eng.num_running:
        eng.step()
    assert n and all(used[:n]) and len(used) > n and not any(used[n:]), used
    eng.submit(PROMPTS[2], RequestParams(20, temperature=0.0, top_k=3, top_p=0.5))  # greedy: its argmax either way
    while eng.num_running + eng.num_waiting:
        eng.step()
    assert not any(used[n:]), used
    branches = {key[2]: "conditional(" in exe.as_text() for key, exe in eng._chunk_exe.items()}
    assert branches == {"filtered": False, "sampled": False}  # (chains: greedy rows take the "sampled" round)
    assert eng._admit_exe and not any("conditional(" in exe.as_text() for exe in eng._admit_exe.values())


def test_simulated_acceptance_equals_generate(models):
    sim = SimulatedAcceptance((0.9, 0.5, 0.3))
    eng = engine(models, max_slots=2, acceptance=sim)
    ids = [eng.submit(p, RequestParams(n)) for p, n in zip(PROMPTS[:3], NEW[:3])]
    outputs, finals = {}, {}
    drain(eng, outputs, finals)
    for rid, p, n in zip(ids, PROMPTS, NEW):
        ref = pjax.generate(models[0], models[1], [p], max_new_tokens=n, num_speculative_tokens=3,
                            acceptance=sim, max_len=MAX_LEN, compiler_options=FAST)
        assert outputs[rid] == ref.tokens[0]
        assert finals[rid].stats["num_accepted_tokens"] == ref.stats["num_accepted_tokens"] > 0


def test_slots_are_reused_one_slot(models):
    """One slot: requests run one after another through the same row (the previous row's cache and drafts must
    not leak into the next request). One slot and generate's 8 rounds a chunk: the programs of the references."""
    eng = engine(models, max_slots=1, rounds_per_step=8)
    params = [RequestParams(n) for n in NEW[:4]]
    ids = [eng.submit(p, q) for p, q in zip(PROMPTS[:4], params)]
    outputs, finals = {}, {}
    while eng.has_work:
        assert eng.num_running <= 1
        drain(eng, outputs, finals, steps=1)
    for rid, p, q in zip(ids, PROMPTS, params):
        check_against_reference(models, "parallel", p, q, outputs[rid], finals[rid])
    # finished requests leave nothing behind: a finished id is unknown to cancel
    eng.cancel(ids[0])
    assert not eng.has_work and eng.step() == []


def test_max_slots_round_up_and_an_admission_returns_the_prefill_tokens(models):
    eng = engine(models, max_slots=3)
    assert eng.max_slots == 4
    rid = eng.submit(PROMPTS[0], RequestParams(1))
    rid2 = eng.submit(PROMPTS[1], RequestParams(5))
    evs = eng.step()
    ref = reference(models, "parallel", PROMPTS[0], RequestParams(1)).tokens[0]
    first = next(e for e in evs if e.request_id == rid)
    assert first.finished and first.new_tokens == ref and first.stop_reason == "length"  # done at prefill
    second = next(e for e in evs if e.request_id == rid2)
    assert not second.finished and len(second.new_tokens) == 1  # an admission step returns the prefill tokens only
    ttft = second_time = None
    while eng.has_work:
        for e in eng.step():  # then chunks of rounds_per_step rounds: up to K + 1 tokens a round
            assert e.request_id == rid2 and 1 <= len(e.new_tokens) <= eng.rounds_per_step * 4
            if e.finished:
                ttft, second_time = e.stats["ttft_s"], e.stats["e2e_s"]
    assert 0 < ttft < second_time


def test_a_step_after_an_admission_decodes(models):
    """Admissions alternate with chunks while requests run: a newcomer waits one step, the running request is not
    starved by a stream of arrivals (requests short enough that no chunk is pipelined: each step waits for its own
    work)."""
    eng = engine(models, max_slots=2, rounds_per_step=1)
    a = eng.submit(PROMPTS[1], RequestParams(8))
    assert [(e.request_id, len(e.new_tokens)) for e in eng.step()] == [(a, 1)]  # admission
    b = eng.submit(PROMPTS[0], RequestParams(8))
    evs = eng.step()  # a chunk: a decodes, b still queued
    assert [e.request_id for e in evs] == [a] and eng.num_waiting == 1
    assert [(e.request_id, len(e.new_tokens)) for e in eng.step()] == [(b, 1)]  # admission of b
    assert sorted(e.request_id for e in eng.step()) == [a, b]  # a chunk for both


def test_cancel_running_and_queued(models):
    eng = engine(models, max_slots=2, rounds_per_step=1)
    params = [RequestParams(n) for n in (30, 20, 10, 12)]
    a, b, c = (eng.submit(p, q) for p, q in zip(PROMPTS[:3], params[:3]))
    outputs, finals = {}, {}
    drain(eng, outputs, finals, steps=2)
    sent_a = len(outputs[a])
    assert sent_a >= 2 and eng.num_waiting == 1
    eng.cancel(a, keep=1)  # running: ends before the next chunk, its output cut to 1 token
    eng.cancel(c)  # queued: dropped
    eng.cancel(12345)  # unknown: no-op
    eng.cancel(a)  # already cancelled: no-op
    assert eng.num_running == 1 and eng.num_waiting == 0 and eng.has_work
    assert_free_rows_done(eng)
    d = eng.submit(PROMPTS[3], params[3])  # takes a's freed slot at the next step
    evs = eng.step()
    by_id = {e.request_id: e for e in evs}
    assert [e.request_id for e in evs[:2]] == [a, c]  # cancelled first, in cancellation order
    assert by_id[a].finished and by_id[a].stop_reason == "stop" and by_id[a].new_tokens == []
    assert by_id[a].stats["output_tokens"] == 1 and by_id[a].stats["prompt_tokens"] == len(PROMPTS[0])
    assert by_id[c].finished and by_id[c].stop_reason == "stop" and by_id[c].new_tokens == []
    assert by_id[c].stats["output_tokens"] == 0 and by_id[c].stats["ttft_s"] is None
    assert eng.num_running == 2
    for e in evs:
        outputs.setdefault(e.request_id, []).extend(e.new_tokens)
        if e.finished:
            finals[e.request_id] = e
    drain(eng, outputs, finals)
    assert outputs[a] == reference(models, "parallel", PROMPTS[0], params[0]).tokens[0][:sent_a]
    for rid, i in ((b, 1), (d, 3)):
        check_against_reference(models, "parallel", PROMPTS[i], params[i], outputs[rid], finals[rid])
    with pytest.raises(ValueError, match="keep must be an integer >= 0"):
        eng.cancel(b, keep=-1)


def test_cancel_with_keep_beyond_the_output_keeps_everything(models):
    eng = engine(models, max_slots=2, rounds_per_step=1)
    rid = eng.submit(PROMPTS[1], RequestParams(20))
    outputs, finals = {}, {}
    drain(eng, outputs, finals, steps=1)
    n = len(outputs[rid])
    eng.cancel(rid, keep=100)
    assert_free_rows_done(eng)
    drain(eng, outputs, finals)
    assert finals[rid].stats["output_tokens"] == n and finals[rid].stop_reason == "stop"
    assert finals[rid].stats["e2e_s"] >= finals[rid].stats["ttft_s"]


def test_compile_count_is_bounded_over_a_sweep(models):
    """Admissions of 1..4 requests with prompts of 1..40 tokens: at most (3 row buckets x 3 length buckets)
    admission programs + 1 chunk program, and a repeat of the sweep compiles nothing."""
    def sweep():
        eng = engine(models, max_slots=4, max_len=MAX_LEN)
        sizes = [1, 4, 2, 3, 1, 2]
        lengths = [1, 40, 17, 9, 33, 16]
        for rep, (n, length) in enumerate(zip(sizes, lengths)):
            for j in range(n):
                eng.submit([(rep + j) % V] * (length - j % 2 if length > 1 else 1), RequestParams(3 + j))
            while eng.has_work:
                eng.step()
    before = pjax.decode.compile_count()
    sweep()
    first = pjax.decode.compile_count() - before
    assert 1 <= first <= 3 * 3 + 1
    sweep()
    assert pjax.decode.compile_count() - before == first


def test_precompile_compiles_every_admission_program(models):
    eng = engine(models, max_slots=4, drafting="none")
    eng.precompile(rows=[1, 2, 3, 4], prompt_lengths=[5, 20])
    before = pjax.decode.compile_count()
    for n, length in ((1, 5), (3, 20), (4, 5), (2, 17)):
        for j in range(n):
            eng.submit([1] * length, RequestParams(4))
        while eng.has_work:
            eng.step()
    assert pjax.decode.compile_count() == before
    with pytest.raises(ValueError, match="precompile"):
        eng.precompile(rows=[5], prompt_lengths=[3])
    assert eng.precompile([1], [5], sampling="greedy") == 0.0  # one mode as a string; built above already
    with pytest.raises(ValueError, match="sampling needs one of"):
        eng.precompile([1], [5], sampling=())


# the default run keeps "auto" (padded and packed admissions); precompiling padded admissions is
# test_precompile_compiles_every_admission_program's
@pytest.mark.parametrize("prefill", [pytest.param("padded", marks=pytest.mark.full), "auto"])
def test_admission_shapes_cover_every_admission(models, prefill):
    """Precompiling `admission_shapes(L)` leaves nothing to compile for any admission of prompts up to L tokens (with
    packing, whatever packed row the admission takes)."""
    eng = engine(models, max_slots=4, drafting="none", prefill=prefill)
    shapes = eng.admission_shapes(20)  # its padded admissions are test_precompile_compiles_every_admission_program's
    assert {n for n, _ in shapes} == {1, 2, 4} and max(length for _, length in shapes) == 20
    for n, length in shapes:
        eng.precompile([n], [length])
    before = pjax.decode.compile_count()
    for n, length in ((1, 1), (3, 20), (4, 16), (2, 17), (3, 9)):
        for j in range(n):
            eng.submit([1] * (length - j % 2 if length > 1 else 1), RequestParams(2))
        while eng.has_work:
            eng.step()
    assert pjax.decode.compile_count() == before
    with pytest.raises(ValueError, match="longest_prompt"):
        eng.admission_shapes(MAX_LEN + 1)


def test_precompile_admissions_builds_exactly_their_programs(models):
    eng = engine(models, max_slots=4, drafting="none", prefill="auto")
    admissions = [[5, 3], [20, 1, 1], [9]]  # packed into 16 and 32 positions, and one padded row
    eng.precompile_admissions(admissions)
    assert sorted(eng._admit_exe, key=str) == sorted([(2, 16, 16), (4, 32, 32), (1, 16, None)], key=str)
    before = pjax.decode.compile_count()
    for lengths in admissions:
        for n in lengths:
            eng.submit([1] * n, RequestParams(3))
        while eng.has_work:
            eng.step()
    assert pjax.decode.compile_count() == before
    with pytest.raises(ValueError, match="precompile_admissions"):
        eng.precompile_admissions([[3] * 5])


def test_admissions_run_in_groups_of_max_admit_rows(models):
    """max_admit_rows=2 over 4 slots: one step admits all four queued requests as two programs of 2 rows (no 4-row
    program is built, nor listed by admission_shapes / precompile_admissions), and each request's output equals
    generate's alone."""
    eng = engine(models, max_slots=4, max_admit_rows=3)
    assert eng.max_admit_rows == 4  # rounded up to a power of two, at most max_slots
    eng = engine(models, max_slots=4, max_admit_rows=2)
    assert {n for n, _ in eng.admission_shapes(20)} == {1, 2}
    eng.precompile_admissions([[3, 8, 6, 20]], warm=True)
    assert sorted(eng._admit_exe) == [(2, 16, None), (2, 32, None)]
    before = pjax.decode.compile_count()
    params = [RequestParams(n) for n in NEW[:4]]
    ids = [eng.submit(p, q) for p, q in zip(PROMPTS[:4], params)]
    evs = eng.step()
    assert sorted(e.request_id for e in evs) == ids and eng.num_running == 4 and eng.num_waiting == 0
    outputs, finals = {e.request_id: list(e.new_tokens) for e in evs}, {}
    drain(eng, outputs, finals)
    assert pjax.decode.compile_count() == before  # both programs (and the chunk) were built ahead
    for rid, prompt, q in zip(ids, PROMPTS, params):
        check_against_reference(models, "parallel", prompt, q, outputs[rid], finals[rid])


@pytest.mark.parametrize("drafting", ["parallel", "none"])
def test_packed_admissions_equal_generate(models, drafting):
    """Admissions prefilled packed (the first one: four requests in one row) give every request `pjax.generate`'s
    output for it alone."""
    params = [RequestParams(n) for n in NEW]
    eng = engine(models, drafting, max_slots=4, prefill="packed")
    outputs, finals = {}, {}
    ids = [eng.submit(p, q) for p, q in zip(PROMPTS, params)]
    drain(eng, outputs, finals)
    assert (4, 32, 64) in eng._admit_exe  # 3 + 8 + 6 + 20 tokens: four rows of 32 packed into 64
    for rid, p, q in zip(ids, PROMPTS, params):
        check_against_reference(models, drafting, p, q, outputs[rid], finals[rid])


def test_warm_precompile_changes_no_slot(models):
    """precompile(warm=True) runs each admission program on padding rows only: a running request goes on as if
    nothing happened."""
    eng = engine(models, max_slots=4)
    rid = eng.submit(PROMPTS[1], RequestParams(16))
    outputs, finals = {}, {}
    drain(eng, outputs, finals, steps=2)
    eng.precompile(rows=[1, 2, 4], prompt_lengths=[5, 30], warm=True)
    assert eng.num_running == 1
    drain(eng, outputs, finals)
    check_against_reference(models, "parallel", PROMPTS[1], RequestParams(16), outputs[rid], finals[rid])


@pytest.mark.parametrize("prompt, params, error, match", [
    ([], RequestParams(4), ValueError, "prompt must be a non-empty"),
    ([1, V], RequestParams(4), ValueError, r"prompt has token ids outside the vocabulary \[0, 12\)"),
    ([1, -1], RequestParams(4), ValueError, "prompt has token ids outside"),
    ([[1, 2]], RequestParams(4), ValueError, "prompt must be a non-empty 1-D"),
    ([1.5, 2], RequestParams(4), ValueError, "prompt must hold integer token ids"),
    ("hello", RequestParams(4), TypeError, "prompt is text"),
    ([1] * 50, RequestParams(10), ValueError, r"prompt \(50 tokens\) \+ max_new_tokens \(10\) \+ drafting slack "
                                              r"\(6\) = 66 positions exceed max_len=64"),
    ([1], RequestParams(0), ValueError, "max_new_tokens=0 must be >= 1"),
    ([1], RequestParams(2.5), TypeError, "max_new_tokens=2.5 must be an integer"),
    ([1], RequestParams(4, temperature=-0.5), ValueError, "temperature=-0.5 must be >= 0"),
    ([1], RequestParams(4, temperature=float("nan")), ValueError, "temperature=nan must be a finite number"),
    ([1], RequestParams(4, temperature=1e300), ValueError, r"temperature=1e\+300 is out of range"),
    ([1], RequestParams(4, top_k=2 ** 31), ValueError, "top_k=2147483648 must be < 2147483648"),
    ([1], RequestParams(4, top_p=0.0), ValueError, "top_p=0.0 must be > 0"),
    ([1], RequestParams(4, top_p=1.5), ValueError, "top_p=1.5 must be <= 1"),
    ([1], RequestParams(4, top_k=-1), ValueError, "top_k=-1 must be >= 0"),
    ([1], RequestParams(4, seed=-1), ValueError, "seed=-1 must be >= 0"),
    ([1], RequestParams(4, seed=2 ** 32), ValueError, "seed=4294967296 must be < 4294967296"),
    ([1], RequestParams(4, stop_token_ids=(3, V)), ValueError, r"stop_token_ids: 12 is outside the vocabulary"),
    ([1], RequestParams(4, stop_token_ids=(-1,)), ValueError, "stop_token_ids: -1 is outside"),
    ([1], RequestParams(4, stop_token_ids=tuple(range(9))), ValueError, "stop_token_ids: 9 ids, more than the "
                                                                         "engine's 8"),
    ([1], RequestParams(4, stop_token_ids=("a",)), TypeError, "stop_token_ids: 'a' is not an integer"),
    ([1], RequestParams(4, stop_token_ids=5), TypeError, "stop_token_ids must be a tuple"),
    ([1], dict(max_new_tokens=4), TypeError, "params must be a pjax.serve.RequestParams"),
])
def test_submit_validation_names_the_field(models, prompt, params, error, match):
    eng = engine(models)
    with pytest.raises(error, match=match):
        eng.submit(prompt, params)
    assert not eng.has_work


def test_the_longest_request_that_fits(models):
    eng = engine(models, max_slots=1, rounds_per_step=8)  # the reference's programs
    prompt = [2] * (MAX_LEN - 10 - 6)
    rid = eng.submit(prompt, RequestParams(10))
    outputs, finals = {}, {}
    drain(eng, outputs, finals)
    check_against_reference(models, "parallel", prompt, RequestParams(10), outputs[rid], finals[rid])


@pytest.mark.parametrize("kw, error, match", [
    (dict(max_slots=0), ValueError, "EngineConfig.max_slots must be an integer >= 1"),
    (dict(max_len=1), ValueError, "EngineConfig.max_len must be an integer >= 2"),
    (dict(rounds_per_step=0), ValueError, "EngineConfig.rounds_per_step must be an integer >= 1"),
    (dict(max_admit_rows=0), ValueError, "EngineConfig.max_admit_rows must be an integer >= 1"),
    (dict(max_slots=2.0), ValueError, "EngineConfig.max_slots"),
    (dict(drafting="tree"), ValueError, "drafting='tree': expected one of"),
    (dict(num_speculative_tokens=0), ValueError, "num_speculative_tokens must be an integer >= 1"),
    (dict(implementation="cuda"), ValueError, "implementation='cuda'"),
    (dict(draft_sampling="beam"), ValueError, "draft_sampling='beam'"),
    (dict(cache_dtype="int3"), ValueError, "cache_dtype"),
    (dict(compiler_options=[("a", 1)]), TypeError, "EngineConfig.compiler_options must be a dict"),
    (dict(prefill="ragged"), ValueError, "EngineConfig.prefill='ragged': expected one of"),
])
def test_config_validation(models, kw, error, match):
    with pytest.raises(error, match=match):
        engine(models, **kw)


def test_config_needs_a_drafter_and_a_target(models):
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(models[0], None, EngineConfig(drafting="parallel"))
    with pytest.raises(TypeError, match="target must be a pjax Target"):
        Engine("path", models[1], EngineConfig())
    with pytest.raises(TypeError, match="config must be a pjax.decode.EngineConfig"):
        Engine(models[0], models[1], dict(max_slots=2))
    assert hash(EngineConfig(compiler_options={"a": 1})) == hash(EngineConfig())  # options are not hashed
