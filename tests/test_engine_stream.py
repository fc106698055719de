"""`pjax.generate` on the engine, in device chunks: output equal to one device call and to one round per call,
streaming chunks that concatenate to the result, rows ended from the host, Ctrl-C returning the output so far, and a
sweep of shapes and settings that compiles only a handful of programs."""
import functools
import itertools
import sys

import pytest

import pjax
from pjax.decode import Generation, GenerationInterrupted
from tests.engine_utils import FAST, tiny_pair

V, H = 61, 32
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 10, 33, 8], [30, 31, 32, 33, 34, 35]]
SAMPLED = dict(temperature=[1.0, 0.0, 0.8], top_k=[0, 0, 5], seed=[3, 4, 5])
gen = functools.partial(pjax.generate, compiler_options=FAST, drafting="parallel", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def models():
    return tiny_pair(V, H)


def test_a_k_sweep_compiles_one_admission_and_one_chunk_per_setting(models, monkeypatch):
    """Across K and drafting modes each setting compiles its admission (the prefill of the batch) and its decode chunk
    once (`generate` runs to the end: no fixed-trip chunk; a streamed generation builds it where a request can outlive
    a chunk: 20 tokens do at K = 1 and without drafting, not in 8 rounds of K + 1 = 4), and the speculative settings'
    greedy output equals plain decoding's. (The module's first test: its programs are new; the next test reuses the
    sequential and plain ones.)"""
    target, drafter = models
    G = sys.modules["pjax.decode.engine"]
    built = []
    orig = G.compiled

    def record(name, *a):
        exe, seconds = orig(name, *a)
        if seconds:
            built.append(name)
        return exe, seconds
    monkeypatch.setattr(G, "compiled", record)
    settings = [("parallel", 1), ("sequential", 3), ("none", 3)]
    outs = [gen(target, drafter, PROMPTS, max_new_tokens=20, drafting=d, num_speculative_tokens=k).tokens
            for d, k in settings]
    assert built.count("admit") == 3 and built.count("chunk_ending") == 3 and "chunk" not in built, built
    assert outs[0] == outs[1] == outs[2]
    for d, k in settings:
        g = Generation(target, drafter, PROMPTS, max_new_tokens=20, drafting=d, num_speculative_tokens=k,
                       compiler_options=FAST)
        assert [sum(c, []) for c in zip(*(ch.new_tokens for ch in g))] == outs[0]
    assert built.count("admit") == 3 and built.count("chunk_ending") == 3 and built.count("chunk") == 2, built


@pytest.mark.parametrize("drafting", ["parallel", "sequential", "none"])
def test_chunked_equals_one_call_and_one_round_per_call(models, drafting):
    target, drafter = models
    kw = dict(max_new_tokens=20, drafting=drafting, num_speculative_tokens=3, **SAMPLED)
    # every round in one device call: a static batch's first chunk runs 4 x rounds_per_step rounds (20 at most here)
    one = gen(target, drafter, PROMPTS, rounds_per_step=8, **kw)
    g = Generation(target, drafter, PROMPTS, rounds_per_step=1, compiler_options=FAST, **kw)
    assert sum(1 for _ in g) > 3  # streamed: one round per device call
    many = g.result()
    assert many.tokens == one.tokens
    assert many.stats["rounds"] == one.stats["rounds"]
    assert one.stats["device_chunks"] == 1 and many.stats["device_chunks"] > 3
    # run to its end with 1 round a step: a first chunk of 4 rounds, then one sized to ~0.5 s (every round left)
    sized = gen(target, drafter, PROMPTS, rounds_per_step=1, **kw)
    assert sized.tokens == one.tokens and sized.stats["device_chunks"] == 2 and sized.stats["rounds"] > 4
    assert many.stats["num_accepted_tokens"] == one.stats["num_accepted_tokens"]


def test_stream_chunks_concatenate_to_the_result(models):
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=16, **SAMPLED)
    g = Generation(target, drafter, PROMPTS, max_new_tokens=16, rounds_per_step=1, compiler_options=FAST,
                   num_speculative_tokens=3, **SAMPLED)
    got = [[] for _ in PROMPTS]
    chunks = list(g)
    assert all(len(t) == 1 for t in chunks[0].new_tokens)  # the first chunk: the token sampled at prefill
    for c in chunks:
        for i, t in enumerate(c.new_tokens):
            got[i] += t
    assert got == ref.tokens and chunks[-1].done == [True] * 3
    assert chunks[-1].stop_reasons == ref.stats["stop_reasons"]
    assert g.result().tokens == ref.tokens


def test_finish_ends_a_row_from_the_host(models):
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=24)
    g = Generation(target, drafter, PROMPTS, max_new_tokens=24, rounds_per_step=1, compiler_options=FAST,
                   num_speculative_tokens=3)
    next(g)
    next(g)
    g.finish(1, keep=2)
    later = [c.new_tokens[1] for c in g]
    res = g.result()
    assert all(t == [] for t in later)
    assert res.tokens[1] == ref.tokens[1][:2] and res.stats["stop_reasons"][1] == "stop"
    assert res.tokens[0] == ref.tokens[0] and res.tokens[2] == ref.tokens[2]
    assert res.stats["requests"][1]["output_tokens"] == 2


def test_ctrl_c_returns_the_output_so_far(models, monkeypatch):
    """KeyboardInterrupt while a chunk runs: GenerationInterrupted carries every token of the finished chunks."""
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=24)
    g = Generation(target, drafter, PROMPTS, max_new_tokens=24, rounds_per_step=1, compiler_options=FAST,
                   num_speculative_tokens=3)
    step, calls = g._engine.step, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **kw)
    g._engine.step = flaky
    with pytest.raises(GenerationInterrupted) as e:
        g.result()
    part = e.value.result
    assert isinstance(e.value, KeyboardInterrupt)
    assert part.stats["stop_reasons"] == ["interrupted"] * 3
    for have, want in zip(part.tokens, ref.tokens):
        assert 2 <= len(have) < len(want) and want[:len(have)] == have


def test_progress_bar(models, capsys):
    target, drafter = models
    res = gen(target, drafter, PROMPTS, max_new_tokens=8, progress=True)
    assert "generate (parallel)" in capsys.readouterr().err and len(res.tokens) == 3


def test_a_sweep_compiles_a_handful_of_programs(models, monkeypatch):
    """Batch sizes 1, 3, 4, prompt lengths 2-14, max_new_tokens 3-8, stop lists of 0-3 ids, top-k / top-p on and off:
    18 settings, 8 programs from an empty cache: 2 row buckets x (the decode chunk ending early, without and with
    the top-k / top-p truncation, the admission padded; no request outlives a chunk, so no fixed-trip chunk), and
    under prefill="auto" the admission packed per (rows, packed row) bucket where packing saves positions (4 x 16
    into 16 and into 32); the same sweep again compiles nothing."""
    target, drafter = models
    monkeypatch.setattr(sys.modules["pjax.decode.compiled"], "_COMPILED", {})
    G = sys.modules["pjax.decode._generate"]
    settings = list(itertools.product([1, 3, 4], [2, 9, 14], [3, 8]))
    samplings = [dict(), dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_p=0.8)]

    def sweep():
        before = G.compile_count()
        for i, (b, length, new) in enumerate(settings):
            prompts = [[(j * 7 + t) % V for t in range(length - j % 2)] for j in range(b)]
            gen(target, drafter, prompts, max_new_tokens=new, eos_token_id=[None, [7, 8, 9]][i // 2 % 2], seed=i,
                prefill="auto", **samplings[i % len(samplings)])
        return G.compile_count() - before
    assert sweep() == 8
    assert sweep() == 0


def test_precompile_in_threads_builds_each_program_once(models, monkeypatch):
    """`Engine.precompile_admissions` from threads at once: each program is compiled by one thread while the others
    wait for it, nothing runs, and the generations afterwards compile nothing and give the outputs of generations
    that compiled for themselves."""
    from concurrent.futures import ThreadPoolExecutor
    target, drafter = models
    C = sys.modules["pjax.decode.compiled"]
    G = sys.modules["pjax.decode._generate"]
    settings = dict(max_new_tokens=5, prefill="padded", num_speculative_tokens=3, compiler_options=FAST)
    prompts = [[list(range(3, 3 + n))] for n in (2, 20)] * 3  # two prompt buckets, six settings (one row: the sweep's)
    expected = [gen(target, drafter, p, **settings).tokens for p in prompts]
    monkeypatch.setattr(C, "_COMPILED", {})
    built = []
    orig_jitted = C.jitted

    def counting(name, *a):
        built.append(name)
        return orig_jitted(name, *a)
    monkeypatch.setattr(C, "jitted", counting)
    config = pjax.decode.EngineConfig(max_slots=1, max_len=64, prefill="padded", num_speculative_tokens=3,
                                      compiler_options=FAST)
    engines = [pjax.decode.Engine(target, drafter, config) for _ in prompts]
    with ThreadPoolExecutor(6) as pool:
        seconds = list(pool.map(lambda ep: ep[0].precompile_admissions([[len(x) for x in ep[1]]]),
                                zip(engines, prompts)))
    assert sorted(built) == ["admit"] * 2 + ["chunk", "chunk_ending"], built
    assert sum(s > 0 for s in seconds) >= 1
    before = G.compile_count()
    assert [pjax.generate(target, drafter, p, **settings).tokens for p in prompts] == expected
    assert G.compile_count() == before


def test_pipelined_chunks_stop_exactly(models):
    """Rows that hit a stop id inside a fixed-trip chunk dispatched ahead of the host emit nothing past it: a streamed
    generation (pipelined, 8 rounds a chunk, the default) gives the outputs and stop reasons of one round per call."""
    target, drafter = models
    ref = gen(target, drafter, PROMPTS, max_new_tokens=40, **SAMPLED)
    eos = [[row[12]] for row in ref.tokens]  # each row stops at its first occurrence of its 13th token
    kw = dict(max_new_tokens=40, eos_token_id=eos, compiler_options=FAST, num_speculative_tokens=3, **SAMPLED)
    g = Generation(target, drafter, PROMPTS, rounds_per_step=8, **kw)
    streamed = [ch.new_tokens for ch in g]  # streaming: the pipelined steps
    piped = g.result()
    assert (True, 3, "filtered") in g._engine._chunk_exe  # the fixed-trip chunk (K = 3, a row with top-k) ran ahead
    assert [sum(c, []) for c in zip(*streamed)] == piped.tokens
    one = gen(target, drafter, PROMPTS, rounds_per_step=1, max_new_tokens=40, eos_token_id=eos, **SAMPLED)
    assert piped.tokens == one.tokens and piped.stats["stop_reasons"] == one.stats["stop_reasons"] == ["eos"] * 3
    assert [t[:len(p)] for t, p in zip(ref.tokens, piped.tokens)] == piped.tokens
