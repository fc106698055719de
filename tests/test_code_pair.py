"""examples/code_pair (`python -m examples.code_pair --tiny`) end to end on CPU: the pair it exports loads in transformers (target, same float32
logits) and speculators (heads, same logits); greedy speculative decoding through pjax.generate equals plain
decoding; a re-run does nothing; a training stage stopped mid-way and resumed gives the same weights bit for bit;
changed settings are refused without --force.

The mechanism tests run on RECIPE, the tiny recipe with fewer files, target steps and head steps (a pair that
decodes but has learned little); the full tiny build, whose heads learn and whose target writes readable text. Both
builds run with --full only: the recipe is an example, and what it relies on is checked in the default run by the
library's tests (exports against transformers / speculators: tests/test_hf_export.py, tests/test_drafter_parity.py;
greedy speculative == plain: tests/test_engine_greedy.py; exact resume: tests/test_train_loop.py; a head learning:
tests/test_parallel_consistency.py)."""
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import speculators.models.eagle3.core as ecore
import speculators.models.peagle.core as pcore
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.peagle import PEagleDraftModel

import examples.code_pair as cp
import pjax
from examples.code_pair.corpus import function_prompts, read_texts
from pjax.train import draft_logits
from tests.engine_utils import fast_default_compiles
from tests.example_utils import load_example
from tests.hf_utils import rel_err




# cp.TINY's whole path with a quarter of its files, 24 target steps and 4 head steps, the heads trained on the
# target's continuations (the full recipe's head data; the tiny build's corpus rows run with --full)
RECIPE = dataclasses.replace(cp.TINY, max_files=40, target_tokens=24 * 4 * 256, target_warmup=10, head_steps=4,
                             head_data="regenerated", regen_prompt_tokens=160, check_new_tokens=16)
LOG: list[str] = []  # the full tiny build's log lines


@pytest.fixture(scope="module", autouse=True)
def _fast_decoding():
    """The recipe's decoding (regenerated head data, the check) compiles as the tests' own decoding does."""
    with pytest.MonkeyPatch.context() as mp:
        fast_default_compiles(mp)
        yield


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "build"
    result = cp.build(out, RECIPE, progress=False, log=lambda s: None)
    assert result == {s: "built" for s in cp.STAGES}
    return out


@pytest.fixture(scope="module")
def tiny_build_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "build"
    result = cp.build(out, cp.TINY, progress=False, log=LOG.append)
    assert result == {s: "built" for s in cp.STAGES}
    return out


@pytest.mark.full
def test_outputs(build_dir):
    manifest = json.loads((build_dir / "pair" / "corpus_manifest.json").read_text())
    held = {f["path"] for f in manifest["files"] if f["split"] == "held_out"}
    trained = {json.loads(line)["path"] for line in (build_dir / "corpus" / "train.jsonl").open()}
    assert held and trained and not held & trained
    assert manifest["held_out"]["fraction_of_files"] >= 0.02 and len(manifest["sha256"]) == 64
    prompts = [json.loads(line) for line in (build_dir / "pair" / "prompts.jsonl").open()]
    assert len(prompts) >= RECIPE.min_prompts
    assert all(p["source"] in held and p["prompt"].endswith("\n") and p["reference"].strip() for p in prompts)
    pair = json.loads((build_dir / "pair" / "pair.json").read_text())
    assert pair["heads"]["peagle"]["steps"] == pair["heads"]["eagle3"]["steps"] == RECIPE.head_steps
    assert pair["heads"]["peagle"]["tokens"] == pair["heads"]["eagle3"]["tokens"]
    assert pair["target"]["tokens"] >= RECIPE.target_tokens
    for head in ("peagle", "eagle3"):  # held-out and teacher-forced-on-the-check accuracy beside decoding's
        assert len(pair["heads"][head]["held_out"]["cond_acc"]) == len(pair["heads"][head]["final"]["acc"])
    check = json.loads((build_dir / "check" / "stage.json").read_text())["summary"]
    assert len(check["peagle"]["teacher_forced"]["chain_acc"]) == RECIPE.peagle_depths
    assert len(check["eagle3"]["teacher_forced"]["cond_acc"]) == RECIPE.eagle3_ttt_steps
    replay = check["peagle"]["replay"]  # decoding replayed from teacher forcing, beside every anchor's accuracy
    assert replay["rounds"] > 0 and replay["anchors"] >= replay["rounds"]
    assert len(replay["acceptance_rates"]) == len(replay["every_anchor_chain"]) == RECIPE.peagle_depths


@pytest.mark.full
def test_target_matches_transformers(build_dir):
    path = build_dir / "pair" / "target"
    prompt = json.loads((build_dir / "pair" / "prompts.jsonl").open().readline())["prompt"]
    tok = tf.AutoTokenizer.from_pretrained(path)
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == prompt
    assert tok.mask_token_id is not None and tok.apply_chat_template([{"role": "user", "content": "x"}],
                                                                     tokenize=False).startswith(tok.bos_token)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.as_tensor([ids[:200]])).logits.numpy()
    got = np.asarray(pjax.models.target_logits(pjax.load_target(path, dtype=jnp.float32), np.asarray([ids[:200]])))
    assert rel_err(got, ref) <= 1e-4, rel_err(got, ref)


def speculators_logits(model, monkeypatch, hs, ids, anchor, depth):
    """Logits of a speculators head's training forward over a fixed (anchor, depth) layout (its sampler and metric
    replaced), as tests/test_drafter_parity.py reads them."""
    cap, s = {}, ids.shape[1]
    doc, last = torch.zeros(1, s, dtype=torch.long), torch.zeros(1, s, model.config.transformer_layer_config.hidden_size)
    if isinstance(model, PEagleDraftModel):
        monkeypatch.setattr(pcore, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
        monkeypatch.setattr(pcore, "compute_metrics", lambda **kw: (cap.update(kw), (torch.tensor(0.0), {}))[1])
        with torch.no_grad():
            model(hidden_states=hs, input_ids=ids, document_ids=doc, verifier_last_hidden_states=last,
                  num_depths=int(depth.max()) + 1)
    else:
        monkeypatch.setattr(ecore, "compute_metrics",
                            lambda logits, *a, **k: (cap.update(logits=logits), (torch.tensor(0.0), {}))[1])
        with torch.no_grad():
            model(hidden_states=hs, input_ids=ids, document_ids=doc, position_ids=torch.arange(s)[None],
                  loss_mask=torch.ones(1, s), verifier_last_hidden_states=last, ttt_steps=1)
    return cap["logits"][0].float().numpy()


@pytest.mark.full
@pytest.mark.parametrize("head", ["peagle", "eagle3"])
def test_heads_match_speculators(build_dir, head, monkeypatch):
    path = build_dir / "pair" / head
    drafter = pjax.load_drafter(path, dtype=jnp.float32)
    model = (PEagleDraftModel if head == "peagle" else Eagle3DraftModel).from_pretrained(str(path)).float().eval()
    cfg = drafter.config
    s = 20
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, s, cfg.num_aux * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, s), generator=g)
    if head == "peagle":
        assert model.mask_token_id == cfg.mask_token_id
        torch.manual_seed(0)
        loss_mask = torch.ones(1, s)
        loss_mask[0, :2] = 0
        anchor, depth = pcore.generate_cod_sample_indices(seq_length=s, loss_mask=loss_mask, num_depths=4)
        assert int(depth.max()) >= 2
    else:
        anchor, depth = torch.arange(s), torch.zeros(s, dtype=torch.long)
    ref = speculators_logits(model, monkeypatch, hs, ids, anchor, depth)
    got = np.asarray(draft_logits(drafter, hs.numpy(), ids.numpy(), np.zeros((1, s), np.int32), anchor.numpy(),
                                  depth.numpy()))
    assert got.shape == ref.shape and rel_err(got, ref) <= 1e-4, rel_err(got, ref)


@pytest.mark.full
def test_speculative_equals_plain(build_dir):
    """The check stage decoded benchmark prompts through pjax.generate: plain, P-EAGLE (parallel) and EAGLE-3
    (sequential) greedy decoding of the float32 tiny pair."""
    check = json.loads((build_dir / "check" / "stage.json").read_text())["summary"]
    assert check["prompts"] >= 1 and check["dtype"] == "float32"
    for head in ("peagle", "eagle3"):
        assert check[head]["identical_to_plain"], check[head]
        assert 1.0 <= check[head]["mean_acceptance_length"] <= check[head]["k"] + 1


@pytest.mark.full
def test_tiny_pair_shows_a_working_head_and_readable_text(tiny_build_dir):
    """The tiny pair is a demo that shows something: both heads learned (held-out depth-0 accuracy, decoding
    acceptance well above one token per round, no warning in the log), and the target continues a prompt with text
    a person can read, not only whitespace."""
    pair = json.loads((tiny_build_dir / "pair" / "pair.json").read_text())
    check = json.loads((tiny_build_dir / "check" / "stage.json").read_text())["summary"]
    for head in ("peagle", "eagle3"):
        assert pair["heads"][head]["learned"] and pair["heads"][head]["held_out"]["acc"][0] >= 0.15, head
        assert check[head]["mean_acceptance_length"] >= 1.3, check[head]
    assert not [line for line in LOG if "has not learned" in line]
    tok = cp.load_tokenizer(cp.Build(tiny_build_dir, cp.TINY))
    prompt = json.loads((tiny_build_dir / "pair" / "prompts.jsonl").open().readline())["prompt"]
    target = pjax.load_target(tiny_build_dir / "pair" / "target", dtype=jnp.float32)
    out = pjax.generate(target, None, [tok.encode(prompt).ids], max_new_tokens=32, drafting="none")
    text = tok.decode(out.tokens[0])
    assert sum(c.isalpha() for c in text) >= 10, repr(text)


def test_recipe_warns_when_a_head_does_not_learn():
    """What the recipe logs when a head's held-out depth-0 accuracy or its decoding acceptance says it learned
    nothing (the tiny pair's P-EAGLE head once reached acceptance length 1.00 without a word)."""
    assert "has not learned" in cp.not_learned("peagle", first_accuracy=0.0)
    assert "has not learned" in cp.not_learned("peagle", acceptance_length=1.0)
    assert cp.not_learned("eagle3", first_accuracy=0.7) is None
    assert cp.not_learned("eagle3", acceptance_length=2.5) is None


@pytest.mark.full
def test_rerun_does_nothing(build_dir):
    before = {s: (build_dir / s / "stage.json").stat().st_mtime_ns for s in cp.STAGES}
    assert cp.build(build_dir, RECIPE, progress=False, log=lambda s: None) == {s: "done" for s in cp.STAGES}
    assert before == {s: (build_dir / s / "stage.json").stat().st_mtime_ns for s in cp.STAGES}


@pytest.mark.full
def test_stage_locks(build_dir):
    """Different stages of one build may run at once (the two heads, each on its own GPU); a stage being built, or
    one a running stage reads, is refused to another process."""
    def run(stage):
        return cp.build(build_dir, RECIPE, stages=(stage,), progress=False, log=lambda s: None)

    with cp.locked(build_dir, "eagle3"):
        assert run("peagle") == {"peagle": "done"}
        for stage in ("eagle3", "regen"):  # built by another process, read by it
            with pytest.raises(cp.RecipeError, match=f"stage {stage} is in use by another process"):
                run(stage)
    with cp.locked(build_dir, "regen"):
        with pytest.raises(cp.RecipeError, match="stage regen, which stage peagle reads, is being built"):
            run("peagle")
    assert run("eagle3") == {"eagle3": "done"} and run("regen") == {"regen": "done"}


def _copy_stages(src: Path, dst: Path, stages):
    dst.mkdir()
    shutil.copy(src / "pjax_output.json", dst)
    for s in stages:
        shutil.copytree(src / s, dst / s)


class StopAfter:
    def __init__(self, n):
        self.n = n

    def __call__(self):
        self.n -= 1
        return self.n < 0


@pytest.mark.full
@pytest.mark.parametrize("stage", ["target"])  # the heads resume through train_drafter (tests/test_train_loop.py)
def test_stopped_training_resumes_exactly(build_dir, tmp_path, stage):
    upstream = cp.inputs(stage)
    out = tmp_path / "build"
    _copy_stages(build_dir, out, upstream)
    steps = RECIPE.target_tokens // (RECIPE.target_batch_rows * RECIPE.target_seq_len)
    stop = max(1, min(50, steps // 20))  # a log boundary: the resumed run's logged means cover the same steps
    with pytest.raises(cp.Incomplete, match="checkpoint saved"):
        cp.build(out, RECIPE, stages=(stage,), progress=False, log=lambda s: None, should_stop=StopAfter(stop))
    assert (out / stage / "ckpt").is_dir() and not (out / stage / "stage.json").exists()
    assert cp.build(out, RECIPE, stages=(stage,), progress=False, log=lambda s: None) == {stage: "built"}
    if stage == "target":
        a, b = (pjax.load_target(d / "target" / "model", dtype=jnp.float32) for d in (out, build_dir))
    else:
        a, b = (pjax.load_drafter(d / "peagle" / "head", dtype=jnp.float32) for d in (out, build_dir))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    first = json.loads((build_dir / stage / "stage.json").read_text())["summary"]["history"]
    again = json.loads((out / stage / "stage.json").read_text())["summary"]["history"]
    assert [h["loss"] for h in first] == [h["loss"] for h in again]


@pytest.mark.full
def test_target_minutes_fixes_the_steps_after_the_warmup(build_dir, tmp_path):
    out = tmp_path / "build"
    _copy_stages(build_dir, out, cp.inputs("target"))
    recipe = dataclasses.replace(RECIPE, target_minutes=1e-4)  # far less than the full token budget takes
    cp.build(out, recipe, stages=("target",), progress=False, log=lambda s: None)
    plan = json.loads((out / "target" / "plan.json").read_text())
    summary = json.loads((out / "target" / "stage.json").read_text())["summary"]
    assert plan["steps"] == summary["steps"] == recipe.target_warmup + 1 and plan["measured_tokens_per_s"] > 0
    assert summary["history"][-1]["step"] == plan["steps"]


@pytest.mark.full
def test_regenerated_head_data(build_dir):
    out, recipe = build_dir, RECIPE
    assert recipe.head_data == "regenerated"
    summary = json.loads((out / "regen" / "stage.json").read_text())["summary"]
    assert summary["prompts"] == recipe.regen_prompts and 0 < summary["new_tokens"] <= recipe.regen_prompts * recipe.regen_new_tokens
    b = cp.Build(out, recipe)
    docs = cp.head_documents(b)
    bos = cp.special_ids(b)["bos_token"]
    assert len(docs) == recipe.regen_prompts and sum(int(d.loss_mask.sum()) for d in docs) == summary["new_tokens"]
    tok = cp.load_tokenizer(b)

    def kinds(split, docs):
        """How many docs start with a function prompt of the split's files; every other one with a file prefix."""
        texts = read_texts(out / "corpus" / f"{split}.jsonl")
        functions = {tuple(tok.encode(p.prompt).ids) for p in function_prompts(texts)}
        starts = {tuple(d.tokens[:32].tolist()) for d in cp.documents(b, split)}
        found = 0
        for d in docs:
            n = int(np.argmax(d.loss_mask))  # the prompt (BOS first), unsupervised; the continuation supervised
            assert d.tokens[0] == bos and n <= recipe.regen_prompt_tokens and d.loss_mask[n:].all()
            if tuple(d.tokens[:n].tolist()) in functions:
                found += 1
            else:
                assert n >= 32 and tuple(d.tokens[:32].tolist()) in starts
        return found
    assert kinds("train", docs) == summary["function_prompts"] == round(recipe.regen_prompts / 2)
    assert pjax.load_drafter(out / "peagle" / "head").config.model_kind == "peagle"
    held = cp.head_documents(b, "held_out")  # evaluation prompts: of held-out files only
    assert len(held) == recipe.regen_eval_prompts and summary["held_out_prompts"] == len(held)
    assert kinds("held_out", held) == summary["held_out_function_prompts"] > 0
    peagle = json.loads((out / "peagle" / "stage.json").read_text())["summary"]
    assert len(peagle["held_out"]["chain_acc"]) == recipe.peagle_depths and peagle["held_out"]["tokens_per_s"] > 0


@pytest.mark.full
def test_changed_settings_are_refused(build_dir, tmp_path):
    with pytest.raises(cp.RecipeError, match=r"eagle3_ttt_steps: 3 -> 2.*--force"):
        cp.build(build_dir, dataclasses.replace(RECIPE, eagle3_ttt_steps=2), stages=("eagle3",), progress=False)
    with pytest.raises(cp.RecipeError, match="needs corpus, tokenizer, tokens, target, regen first"):
        cp.build(tmp_path / "empty", RECIPE, stages=("peagle",), progress=False)
    for bad, flag in ((dict(head_optimizer="sgd"), "--head-optimizer 'sgd'"), (dict(head_data="web"), "--head-data"),
                      (dict(regen_function_fraction=1.5), "--regen-function-fraction 1.5")):
        with pytest.raises(cp.RecipeError, match=flag):  # before any stage runs: nothing is created
            cp.build(tmp_path / "bad", dataclasses.replace(RECIPE, **bad), progress=False)
        assert not (tmp_path / "bad").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(pjax.checkpoint.OutputError, match="not a pjax output"):
        cp.build(mine, RECIPE, progress=False)


def test_flags():
    a = cp.parse_args(["--out", "x", "--tiny", "--peagle-depths", "12", "--peagle-max-anchors", "none",
                       "--aux-layer-ids", "1", "2", "3", "--no-remat", "--target-tokens", "5e7", "--head-optimizer",
                       "muon", "--regen-function-fraction", "0.25"])
    r = cp.recipe_from_args(a)
    assert r == dataclasses.replace(cp.TINY, peagle_depths=12, peagle_max_anchors=None, aux_layer_ids=(1, 2, 3),
                                    remat=False, target_tokens=50_000_000, head_optimizer="muon",
                                    regen_function_fraction=0.25)
    assert cp.recipe_from_args(cp.parse_args(["--out", "x"])) == cp.FULL


def test_random_code_pair_shape_is_the_full_target():
    """`python -m pjax bench --target random:code-pair` times the geometry the full recipe trains."""
    from pjax.bench.models import RANDOM_SHAPES
    from pjax.models.families import config_from_hf
    r = cp.FULL
    c = config_from_hf(RANDOM_SHAPES["code-pair"], "random:code-pair")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads, c.num_layers) == (
        r.vocab_size, r.target_hidden, r.target_intermediate, r.target_heads, r.target_layers)
    assert {(s.num_kv_heads, s.head_dim, s.rope.theta) for s in c.layers} == {
        (r.target_kv_heads, r.target_hidden // r.target_heads, r.rope_theta)}
    assert RANDOM_SHAPES["code-pair"]["max_position_embeddings"] == r.target_seq_len


def test_table_script_commands(tmp_path, capsys):
    """examples/benchmarks/code_pair_table.py: every benchmark it runs is a valid `python -m pjax bench` command line
    on the pair's files, and a deadline turns into time budgets, then skips."""
    from pjax.bench.cli import build_parser
    table = load_example("benchmarks/code_pair_table.py")
    build, out = tmp_path / "cpb", tmp_path / "bench"
    assert table.main(["--build", str(build), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(table.STAGES) + len(table.RUNS)
    assert table.STAGES == tuple(s for s in cp.STAGES if s != "check")  # the recipe's stages up to the export
    assert [ln.split()[-1] for ln in lines[:len(table.STAGES)]] == list(table.STAGES)
    for name, _, bench_args in table.RUNS:
        args = build_parser().parse_args(table.bench_command(build, out, name, bench_args, 120)[4:])
        assert args.target == str(build / "pair" / "target") and args.out == str(out / name)
        assert args.time_budget == 120 and args.chat == "off"
        assert all(str(build / "pair") in d for d in args.dataset if d.endswith(".jsonl"))
    assert table.budget(300, 100, None) == (True, None)
    assert table.budget(300, 100, 2000) == (True, 300)
    assert table.budget(300, 1800, 2000) == (True, 2000 - 1800 - table.MARGIN_S)
    assert table.budget(300, 1920, 2000)[0] is False
    with pytest.raises(SystemExit):
        table.main(["--build", "b", "--out", "o", "--only", "c1-nothing", "--dry-run"])


def test_table_script_spreads_over_gpus(tmp_path, monkeypatch):
    """--gpus 0,1: the heads train at once, one per GPU (each waits here until the other has started), every other
    stage runs on the first GPU, and each benchmark runs whole on one GPU with that GPU's compilation cache."""
    import sys
    table = load_example("benchmarks/code_pair_table.py")
    marks = tmp_path / "marks"
    marks.mkdir()
    fake = ("import os, sys, time; from pathlib import Path; gpu, name = os.environ['CUDA_VISIBLE_DEVICES'], "
            "sys.argv[1]; m = Path(sys.argv[2]); (m / name).touch(); other = {'peagle': 'eagle3', 'eagle3': "
            "'peagle'}.get(name); t = time.time() + 60\n"
            "while other and not (m / other).exists() and time.time() < t: time.sleep(0.05)\n"
            "print(gpu, *sys.argv[1:2], *sys.argv[3:]); sys.exit(int(bool(other) and not (m / other).exists()))")
    monkeypatch.setattr(table, "build_commands", lambda build, stages=table.STAGES: [
        [sys.executable, "-c", fake, s, str(marks)] for s in stages])
    monkeypatch.setattr(table, "bench_command", lambda build, out, name, args, budget_s=None, cache=".jax_cache": [
        sys.executable, "-c", fake, name, str(marks), cache])
    out, runs = tmp_path / "bench", ["c1-humaneval", "c1-2048", "c1-heldout"]
    assert table.main(["--build", str(tmp_path / "cpb"), "--out", str(out), "--gpus", "0,1",
                       "--only", ",".join(runs)]) == 0
    assert (out / "build-peagle.log").read_text().split() == ["0", "peagle"]
    assert (out / "build-eagle3.log").read_text().split() == ["1", "eagle3"]
    assert [ln.split() for ln in (out / "build.log").read_text().splitlines()] == [
        ["0", s] for s in table.STAGES if s not in ("peagle", "eagle3")]
    for name in runs:
        gpu, ran, cache = (out / f"{name}.log").read_text().split()
        assert gpu in ("0", "1") and ran == name and cache == f".jax_cache-{gpu}"
    log = (out / "table.log").read_text().splitlines()
    assert log[-1].endswith("table done") and sum("bench" in ln and "done" in ln for ln in log) == len(runs)
    assert not (out / "table.md").exists()  # no run wrote a bench.json


def test_table_script_summary(tmp_path):
    """--summary: OUT/table.md from every OUT/RUN/bench.json, the table's runs first in their order."""
    table = load_example("benchmarks/code_pair_table.py")
    with pytest.raises(SystemExit):
        table.main(["--build", "b", "--out", str(tmp_path), "--summary"])
    row = dict(dataset="humaneval", max_new_tokens=256, temperature=0.0, draft_sampling="argmax",
               scheduling="static", drafting="none", k=0, concurrency=1, output_tokens_per_s=1.0,
               mean_acceptance_length=None)
    for run in ("extra", "c1-humaneval", "c8-64-heldout"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "bench.json").write_text(json.dumps([row]))
    assert table.main(["--build", "b", "--out", str(tmp_path), "--summary"]) == 0
    md = (tmp_path / "table.md").read_text()
    assert [ln.split(" | ")[0] for ln in md.splitlines() if ln.startswith("| ") and "static" in ln] == [
        "| c8-64-heldout", "| c1-humaneval", "| extra"]


def test_summary_across_runs(tmp_path):
    """code_pair_table.py's summary: per run, setting and concurrency, plain decoding and each mode's best K, with
    P-EAGLE's speedups; a mode not measured there leaves its cells empty."""
    from pjax.bench.report import plots_available
    table = load_example("benchmarks/code_pair_table.py")

    def row(mode, k, c, otps, al=None, **kw):
        return dict(dict(dataset="humaneval", max_new_tokens=256, temperature=0.0, draft_sampling="argmax",
                         scheduling="static batches: ...", drafting=mode, k=k, concurrency=c,
                         output_tokens_per_s=otps, mean_acceptance_length=al), **kw)
    t1 = dict(temperature=1.0, draft_sampling="sample")
    runs = {"a": [row("none", 0, 1, 100.0), row("sequential", 3, 1, 200.0, 3.0), row("sequential", 5, 1, 250.0, 4.0),
                  row("parallel", 3, 1, 240.0, 2.9), row("parallel", 7, 1, 300.0, 4.5), row("parallel", 9, 1, None),
                  row("none", 0, 8, 800.0), row("sequential", 3, 8, 1000.0, 3.0)],
            "b": [row("none", 0, 1, 90.0, **t1), row("parallel", 3, 1, 180.0, 1.8, **t1)]}
    lines = table.summary(runs)
    assert [(ln["run"], ln["setting"], ln["concurrency"], ln["configurations"]) for ln in lines] == [
        ("a", "humaneval, 256 tokens, T = 0, static", 1, 5), ("a", "humaneval, 256 tokens, T = 0, static", 8, 2),
        ("b", "humaneval, 256 tokens, T = 1, sample drafts, static", 1, 2)]
    a1, a8, b1 = lines
    assert (a1["sequential_k"], a1["parallel_k"], a1["parallel_mean_acceptance_length"]) == (5, 7, 4.5)
    assert a1["parallel_vs_none"] == pytest.approx(3.0) and a1["parallel_vs_sequential"] == pytest.approx(1.2)
    assert a8["parallel_tokens_per_s"] is None and a8["parallel_vs_none"] is None
    assert b1["parallel_vs_none"] == pytest.approx(2.0) and b1["parallel_vs_sequential"] is None
    md = table.summary_markdown(lines)
    assert "| a | humaneval, 256 tokens, T = 0, static | 1 | 100.0 | K = 5: 250.0 (4.00) | K = 7: 300.0 (4.50) | " \
           "3.00x | 1.20x |" in md
    assert "| a | humaneval, 256 tokens, T = 0, static | 8 | 800.0 | K = 3: 1,000.0 (3.00) | - | - | - |" in md
    trees = table.summary({"t": [row("none", 0, 1, 100.0), row("sequential", 7, 1, 200.0, 3.0, tree_budget=12),
                                 row("parallel", "auto", 1, 300.0, 4.0, mean_budget=5.25)]})
    md = table.summary_markdown(trees)
    assert "| K = 7, tree 12: 200.0 (3.00) | K = auto (mean 5.2): 300.0 (4.00) |" in md  # the best of chains and trees
    if plots_available():
        table.write_summary_plot(lines, tmp_path / "speedups.png")
        assert (tmp_path / "speedups.png").read_bytes()[:4] == b"\x89PNG"
