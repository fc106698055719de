"""Build a trained pair from scratch on one GPU: a code language model (Llama architecture) trained on the Python
sources installed on the machine, and a P-EAGLE head and an EAGLE-3 head trained against it on the same data with
the same budget; exported as a Hugging Face target and two speculators-format heads, with benchmark prompts drawn
from files no model has seen.

    python examples/code_pair.py --out out/code_pair --max-minutes 8    # repeat until it prints "pair complete"
    python examples/code_pair.py --out /tmp/tiny_pair --tiny              # the same path on a CPU in ~2 minutes
    python examples/code_pair.py --out out/code_pair --stage peagle --peagle-depths 12 --force

Stages, each resumable (a re-run skips finished stages, and continues a training stage from its last orbax
checkpoint):
    corpus     standard library + installed packages (`pjax.train.corpus`): manifest, held-out split by file,
               benchmark prompts (held-out functions: signature + docstring -> body)
    tokenizer  byte-level BPE on the training split (`pjax.train.bpe`), Hugging Face layout
    tokens     every file encoded once: BOS + tokens + EOS
    target     next-token training (`pjax.train.target_lm`) for `target_tokens` tokens; held-out loss
    regen      with --head-data regenerated: training-file prompts continued by the target (half functions'
               signatures and docstrings, half file prefixes), and held-out-file prompts for evaluation (else nothing)
    peagle     P-EAGLE head (COD sampling, `peagle_depths` trained depths) on the head data; accuracy per depth on
               held-out data (acc, cond_acc given the earlier depths right, chain_acc of the whole chain)
    eagle3     EAGLE-3 head (training-time test) on the same rows, same steps, rows per step and row length
    export     DIR/pair: target/ (Hugging Face), peagle/ and eagle3/ (speculators), prompts.jsonl, pair.json
    check      greedy decoding of benchmark prompts: plain vs each head (acceptance length, equality), and each head
               teacher-forced over the same sequences beside its decoding acceptance
No feature stage: the heads compute the target's features in each training step (stored, 4 x 1024 values per token
of the full target would take 8 KB a token, 105 GB for the heads' 13 M tokens).

Head data (--head-data): "regenerated" (default), training-file prompts continued greedily by the target, the loss
on the continuations: what a head sees when decoding (published heads train on target-regenerated responses to prompts
like their users', spec D.6; here --regen-function-fraction of the prompts are functions' signatures and docstrings,
the form of the benchmark's prompts, the rest file prefixes). "corpus": rows of the corpus' training split with the
target's own next-token distributions as the loss targets (computed online in each step); it costs no generation
stage, but a depth-d label is then a human-written token where at decode time it is the target's own.

Output rule: DIR is created with a pjax marker; an existing directory that is not a build of this recipe is refused.
A stage built with other settings (or whose inputs were rebuilt) is refused unless --force, which rebuilds it.
--max-minutes stops the run cleanly (training stages checkpoint first) once that much time has passed, with exit
status 75: run the same command again to continue.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
import typing
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pjax.train.corpus import DEFAULT_PACKAGES  # noqa: E402

# ============================================================================================ the recipe settings
# One block: every field is also a flag (--target-layers 24, --peagle-max-anchors none, --no-remat ...).


@dataclasses.dataclass(frozen=True)
class Recipe:
    # corpus
    packages: tuple[str, ...] = tuple(p.name for p in DEFAULT_PACKAGES)
    include_tests: bool = False
    held_out_fraction: float = 0.03
    max_files: Optional[int] = None
    max_file_bytes: int = 1_000_000
    prompts: int = 200
    min_prompts: int = 100
    # tokenizer
    vocab_size: int = 32768
    tokenizer_sample_bytes: int = 32_000_000
    # target (Llama: 24 x 1024, 16 heads, 4 KV heads, SwiGLU 2816, untied head: 0.34 B parameters)
    target_layers: int = 24
    target_hidden: int = 1024
    target_heads: int = 16
    target_kv_heads: int = 4
    target_intermediate: int = 2816
    rope_theta: float = 10000.0
    target_seq_len: int = 2048
    target_batch_rows: int = 16
    target_tokens: int = 60_000_000
    target_minutes: Optional[float] = None  # fewer steps when the measured rate would take longer than this
    target_lr: float = 6e-4
    target_warmup: int = 100
    target_weight_decay: float = 0.1
    eval_rows: int = 64
    # heads: the same rows (seed), steps, rows per step and row length for both
    head_seq_len: int = 2048
    head_batch_rows: int = 8
    # 1,600 x 8 x 2,048 = 26 M tokens of rows (16 M regenerated tokens plus their prompts): P-EAGLE still gains from
    # 800 to 1,600 steps (acceptance length 3.38 -> 4.05 at K = 8 on the benchmark prompts), EAGLE-3 barely (3.15 -> 3.20)
    head_steps: int = 1600
    head_weight_decay: float = 0.01
    head_warmup: Optional[int] = None  # None: 1% of the steps (speculators)
    head_optimizer: str = "adamw"  # or "muon" (speculators' CLI default: Muon on the weight matrices, `pjax.train.optim`)
    # "regenerated": training-file prefixes continued by the target (what the heads see when decoding: a depth-d label
    # is a token P-EAGLE cannot see, and at decode time it is the target's own); "corpus": the training rows
    head_data: str = "regenerated"
    regen_prompts: int = 32768
    regen_prompt_tokens: int = 512  # prefixes of 32..this many tokens (BOS included)
    regen_new_tokens: int = 512
    regen_temperature: float = 0.0  # 0: greedy continuations (the benchmark's decoding)
    regen_batch: int = 256
    # this fraction of the prompts (training and evaluation alike): functions' signatures and docstrings from the
    # split's files (`pjax.train.corpus.function_prompts`, the form a code drafter is asked to continue), the rest
    # file prefixes
    regen_function_fraction: float = 0.5
    # held-out evaluation of both heads: prefixes of held-out files continued the same way (corpus head data: the
    # held-out files themselves), head_eval_batches batches of the training shape
    regen_eval_prompts: int = 512
    head_eval_batches: int = 8
    aux_layer_ids: Optional[tuple[int, ...]] = None  # None: the target's default (2, L//2, L-3)
    draft_vocab_size: Optional[int] = None  # None: the target's vocabulary
    # P-EAGLE head
    peagle_layers: int = 4
    peagle_depths: int = 8
    peagle_down_sample_ratio: float = 0.7
    peagle_down_sample_ratio_min: float = 0.2
    peagle_max_anchors: Optional[int] = None  # a 512 cap at 2048 tokens leaves depths 1-7 4x fewer samples
    peagle_segments: int = 1
    peagle_lr: float = 1e-3  # speculators' default
    # EAGLE-3 head
    eagle3_layers: int = 1
    eagle3_ttt_steps: int = 3
    eagle3_lr: float = 1e-3
    # precision, export, check
    compute_dtype: Optional[str] = "bfloat16"
    # rematerialise each layer in the backward pass (target and P-EAGLE head): less memory for about one more forward
    # a step. Off: the target step fits an H200 without it, and the P-EAGLE head step takes 138 ms in 16 GiB (H200)
    remat: bool = False
    export_dtype: str = "bfloat16"
    check_prompts: int = 32
    check_new_tokens: int = 256
    seed: int = 0


FULL = Recipe()
TINY = dataclasses.replace(
    FULL, packages=("stdlib",), max_files=160, held_out_fraction=0.1, max_file_bytes=40_000, prompts=8, min_prompts=2,
    vocab_size=1024, tokenizer_sample_bytes=2_000_000, target_layers=4, target_hidden=64, target_heads=4,
    target_kv_heads=2, target_intermediate=176, target_seq_len=256, target_batch_rows=4, target_tokens=60 * 4 * 256,
    target_lr=3e-3, target_warmup=10, eval_rows=8, head_seq_len=256, head_batch_rows=4, head_steps=40,
    regen_prompts=24, regen_prompt_tokens=64, regen_new_tokens=24, regen_batch=8, regen_eval_prompts=24,
    head_eval_batches=2,
    head_data="corpus", peagle_layers=2, peagle_depths=8, peagle_max_anchors=None, peagle_lr=3e-3, eagle3_lr=3e-3,
    compute_dtype=None, export_dtype="float32", check_prompts=2, check_new_tokens=16)

STAGES = ("corpus", "tokenizer", "tokens", "target", "regen", "peagle", "eagle3", "export", "check")
UPSTREAM = {"corpus": (), "tokenizer": ("corpus",), "tokens": ("tokenizer",), "target": ("tokens",),
            "regen": ("target",), "peagle": ("regen",), "eagle3": ("regen",), "export": ("peagle", "eagle3"),
            "check": ("export",)}
SETTINGS = {
    "corpus": ("packages", "include_tests", "held_out_fraction", "max_files", "max_file_bytes", "prompts",
               "min_prompts"),
    "tokenizer": ("vocab_size", "tokenizer_sample_bytes"),
    "tokens": (),
    "target": ("target_layers", "target_hidden", "target_heads", "target_kv_heads", "target_intermediate",
               "rope_theta", "target_seq_len", "target_batch_rows", "target_tokens", "target_minutes", "target_lr",
               "target_warmup", "target_weight_decay", "eval_rows", "compute_dtype", "remat", "seed"),
    "regen": ("head_data", "regen_prompts", "regen_prompt_tokens", "regen_new_tokens", "regen_temperature",
              "regen_batch", "regen_function_fraction", "regen_eval_prompts", "compute_dtype", "seed"),
    "peagle": ("head_seq_len", "head_batch_rows", "head_steps", "head_weight_decay", "head_warmup", "head_optimizer",
               "aux_layer_ids", "draft_vocab_size", "peagle_layers", "peagle_depths", "peagle_down_sample_ratio",
               "peagle_down_sample_ratio_min", "peagle_max_anchors", "peagle_segments", "peagle_lr",
               "head_eval_batches", "compute_dtype", "remat", "seed"),
    "eagle3": ("head_seq_len", "head_batch_rows", "head_steps", "head_weight_decay", "head_warmup", "head_optimizer",
               "aux_layer_ids", "draft_vocab_size", "eagle3_layers", "eagle3_ttt_steps", "eagle3_lr", "head_eval_batches",
               "compute_dtype", "seed"),
    "export": ("export_dtype",),
    "check": ("check_prompts", "check_new_tokens"),
}
BUILD_KIND = "code-pair-build"
PAIR_KIND = "code-pair"
EXIT_INCOMPLETE = 75


class RecipeError(RuntimeError):
    """The build cannot go on as asked; the message says why and what to do."""


class Incomplete(Exception):
    """The time limit stopped the build; the same command continues it."""


# ============================================================================================ build directory
@dataclasses.dataclass
class Build:
    """A build directory and how this run treats it."""
    out: Path
    recipe: Recipe
    force: bool = False
    progress: bool = True
    deadline: Optional[float] = None  # time.time() after which no step or stage starts
    save_seconds: float = 240.0  # training checkpoints at least this often
    implementation: str = "auto"
    log: Callable[[str], None] = print
    should_stop: Optional[Callable[[], bool]] = None  # checked after every training step, besides the deadline
    _keys: dict = dataclasses.field(default_factory=dict, repr=False)

    def dir(self, stage: str) -> Path:
        return self.out / stage

    def settings(self, stage: str) -> dict:
        if stage == "regen" and self.recipe.head_data == "corpus":  # the regen_* settings are then unused
            return {"head_data": "corpus"}
        return {k: _jsonable(getattr(self.recipe, k)) for k in SETTINGS[stage]}

    def key(self, stage: str) -> str:
        """Fingerprint of a stage: its settings and the fingerprints of its inputs."""
        if stage not in self._keys:
            ident = dict(stage=stage, settings=self.settings(stage), upstream=[self.key(u) for u in _inputs(stage)])
            self._keys[stage] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        return self._keys[stage]

    def marker(self, stage: str) -> Optional[dict]:
        try:
            return json.loads((self.dir(stage) / "stage.json").read_text())
        except (OSError, ValueError):
            return None

    def done(self, stage: str) -> bool:
        m = self.marker(stage)
        return m is not None and m.get("key") == self.key(stage)

    def stop_now(self) -> bool:
        return (self.deadline is not None and time.time() >= self.deadline) or bool(self.should_stop and
                                                                                   self.should_stop())

    def bar(self, total, desc, initial=0, unit="it"):
        if not self.progress:
            return None
        from tqdm.auto import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


def _inputs(stage: str) -> tuple[str, ...]:
    """Every stage a stage reads (its upstream closure)."""
    out = []
    for u in UPSTREAM[stage]:
        for x in _inputs(u) + (u,):
            if x not in out:
                out.append(x)
    return tuple(out)


def _differences(b: Build, stage: str, marker: dict) -> str:
    old = marker.get("settings", {})
    diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in b.settings(stage).items() if old.get(k) != v]
    changed = [u for u in _inputs(stage) if marker.get("inputs", {}).get(u) != b.key(u)]
    if changed:
        diff.append(f"rebuilt inputs: {', '.join(changed)}")
    return "; ".join(diff) or "unknown settings"


def _write_json(path: Path, obj) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(obj, indent=1, default=_jsonable) + "\n")
    os.replace(tmp, path)


def open_build(out, *, force: bool) -> Path:
    """Create DIR (absent or empty) with the build marker, or accept an existing build of this recipe."""
    from pjax.checkpoint.files import OUTPUT_FORMAT, OUTPUT_MARKER, OUTPUT_VERSION, output_kind, prepare_output
    out = Path(os.path.abspath(out))
    if output_kind(out) == BUILD_KIND:
        return out
    prepare_output(out, force=force, kind=BUILD_KIND)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / OUTPUT_MARKER, {"format": OUTPUT_FORMAT, "version": OUTPUT_VERSION, "kind": BUILD_KIND,
                                      "written_at": _now()})
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def _locked(out: Path, stage: str):
    """Hold `stage` for this process (exclusive) and its inputs against a rebuild (shared): different stages of one
    build may run at once, e.g. the two heads each on its own GPU (examples/benchmarks/code_pair_table.py --gpus)."""
    with contextlib.ExitStack() as stack:
        for name, mode in [(stage, fcntl.LOCK_EX)] + [(u, fcntl.LOCK_SH) for u in _inputs(stage)]:
            f = stack.enter_context(open(out / f".{name}.lock", "a"))
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RecipeError(f"{out}: stage {name} is in use by another process (being built, or read by a "
                                  f"stage being built)" if name == stage else
                                  f"{out}: stage {name}, which stage {stage} reads, is being built by another "
                                  f"process") from None
        yield


# ============================================================================================ stages
def stage_corpus(b: Build, work: Path) -> dict:
    from pjax.train.corpus import CorpusPackage, benchmark_prompts, collect_corpus, read_texts, write_prompts
    r = b.recipe
    known = {p.name: p for p in DEFAULT_PACKAGES}
    unknown = [n for n in r.packages if n not in known]
    if unknown:
        raise RecipeError(f"--packages: {unknown} are not in the recipe's licence table "
                          f"(pjax.train.corpus.DEFAULT_PACKAGES: {sorted(known)})")
    pkgs: list[CorpusPackage] = [known[n] for n in r.packages]
    m = collect_corpus(work, pkgs, held_out_fraction=r.held_out_fraction, include_tests=r.include_tests,
                       max_file_bytes=r.max_file_bytes, max_files=r.max_files, progress=b.progress)
    prompts = benchmark_prompts(read_texts(work / "held_out.jsonl"), read_texts(work / "train.jsonl"),
                                max_prompts=r.prompts)
    if len(prompts) < r.min_prompts:
        raise RecipeError(f"the held-out files yield {len(prompts)} benchmark prompts, fewer than --min-prompts "
                          f"{r.min_prompts}: raise --held-out-fraction or add packages")
    write_prompts(prompts, work / "prompts.jsonl")
    absent = [p["name"] for p in m["packages"] if not p["installed"]]
    b.log(f"corpus: {m['train']['files']} training files ({m['train']['bytes'] / 1e6:.1f} MB), "
          f"{m['held_out']['files']} held out ({m['held_out']['fraction_of_files']:.1%}), {len(prompts)} prompts; "
          f"sha256 {m['sha256'][:16]}; not installed: {absent or 'none'}")
    return dict(sha256=m["sha256"], train=m["train"], held_out=m["held_out"], prompts=len(prompts), absent=absent)


def _sample(b: Build):
    """Training texts for the tokenizer: files in sha256-of-name order up to tokenizer_sample_bytes."""
    from pjax.train.corpus import read_texts
    texts = sorted(read_texts(b.dir("corpus") / "train.jsonl"), key=lambda t: hashlib.sha256(t[0].encode()).digest())
    out, total = [], 0
    for _, text in texts:
        if total >= b.recipe.tokenizer_sample_bytes:
            break
        out.append(text)
        total += len(text.encode("utf-8"))
    return out, total


def stage_tokenizer(b: Build, work: Path) -> dict:
    from pjax.train.bpe import train_bpe_tokenizer, write_tokenizer_files
    texts, nbytes = _sample(b)
    t0 = time.time()
    tok = train_bpe_tokenizer(texts, b.recipe.vocab_size, length=len(texts), progress=b.progress)
    write_tokenizer_files(tok, work, model_max_length=b.recipe.target_seq_len)
    b.log(f"tokenizer: {tok.get_vocab_size()} ids from {len(texts)} files ({nbytes / 1e6:.1f} MB) in "
          f"{time.time() - t0:.0f} s")
    return dict(vocab_size=tok.get_vocab_size(), sample_files=len(texts), sample_bytes=nbytes)


def load_tokenizer(b: Build):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(b.dir("tokenizer") / "tokenizer.json"))


def special_ids(b: Build) -> dict:
    from pjax.train.bpe import SPECIAL_TOKENS
    tok = load_tokenizer(b)
    return {k: tok.token_to_id(v) for k, v in SPECIAL_TOKENS.items()}


def stage_tokens(b: Build, work: Path) -> dict:
    from pjax.train.corpus import read_texts
    tok, ids = load_tokenizer(b), special_ids(b)
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    out = {}
    for split in ("train", "held_out"):
        files = list(read_texts(b.dir("corpus") / f"{split}.jsonl"))
        bar = b.bar(len(files), f"tokenize {split}", unit="file")
        chunks, lengths = [], []
        for i in range(0, len(files), 256):
            for enc in tok.encode_batch([t for _, t in files[i:i + 256]], add_special_tokens=False):
                chunks.append(np.asarray([ids["bos_token"]] + enc.ids + [ids["eos_token"]], dtype))
                lengths.append(len(chunks[-1]))
            if bar is not None:
                bar.update(min(256, len(files) - i))
        if bar is not None:
            bar.close()
        np.save(work / f"{split}.npy", np.concatenate(chunks))
        np.save(work / f"{split}_offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        out[split] = dict(files=len(files), tokens=int(sum(lengths)))
    b.log(f"tokens: {out['train']['tokens'] / 1e6:.2f} M training tokens in {out['train']['files']} files, "
          f"{out['held_out']['tokens'] / 1e6:.2f} M held out")
    return out


def documents(b: Build, split: str):
    """The split's files as `Document`s (BOS not supervised)."""
    from pjax.train.data import Document
    toks = np.load(b.dir("tokens") / f"{split}.npy")
    offs = np.load(b.dir("tokens") / f"{split}_offsets.npy")
    docs = []
    for a, e in zip(offs[:-1], offs[1:]):
        mask = np.ones(e - a, np.int32)
        mask[0] = 0
        docs.append(Document(toks[a:e], mask))
    return docs


def target_hf_config(b: Build) -> dict:
    from pjax.checkpoint.hf_export import hf_config
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    r, ids = b.recipe, special_ids(b)
    if r.target_hidden % r.target_heads:
        raise RecipeError(f"--target-hidden {r.target_hidden} is not a multiple of --target-heads {r.target_heads}")
    spec = LayerSpec(head_dim=r.target_hidden // r.target_heads, num_kv_heads=r.target_kv_heads,
                     rope=RopeSpec(theta=r.rope_theta))
    cfg = ModelConfig("llama", load_tokenizer(b).get_vocab_size(), r.target_hidden, r.target_intermediate,
                      r.target_heads, (spec,) * r.target_layers, rms_norm_eps=1e-5).validate()
    return hf_config(cfg, dtype="float32", bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"],
                     pad_token_id=ids["pad_token"], max_position_embeddings=r.target_seq_len)


def init_code_target(cfg, seed: int):
    """Normal(0, 0.02) weights, the residual-branch outputs (o_proj, down_proj) scaled by 1/sqrt(2 L) so the
    residual stream's variance does not grow with depth at initialisation."""
    from pjax.models.target import Target, init_target
    t = init_target(cfg, jax.random.key(seed), jnp.float32, scale=0.02)
    scale = 1.0 / math.sqrt(2 * cfg.num_layers)

    def fix(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        return x * scale if ("o_proj" in names or "down_proj" in names) else x
    return Target(t.config, t.graphdef, jax.tree_util.tree_map_with_path(fix, t.params))


def _eval_loss(b: Build, target, docs) -> dict:
    """Mean next-token loss of the target over up to eval_rows packed rows of `docs`."""
    from pjax.train.data import pack_documents, stack_rows
    from pjax.train.target_lm import lm_loss
    r = b.recipe
    rows = pack_documents(docs, r.target_seq_len)[:r.eval_rows]
    fn = jax.jit(functools.partial(lm_loss, compute_dtype=r.compute_dtype, implementation=b.implementation))
    shell = type(target)(target.config, target.graphdef, None)
    total, count = 0.0, 0
    for i in range(0, len(rows), r.target_batch_rows):
        batch = stack_rows(rows[i:i + r.target_batch_rows])
        doc = batch["document_ids"]
        n = int(np.sum((doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] != -1)))
        total += float(fn(target.params, shell, jnp.asarray(batch["tokens"]), jnp.asarray(doc))) * n
        count += n
    loss = total / max(count, 1)
    return dict(loss=loss, perplexity=math.exp(loss), tokens=count)


def _target_steps(b: Build, work: Path, per_step: int, rate: Optional[float]) -> int:
    """The target's step count: target_tokens / tokens per step, or fewer when target_minutes at the measured rate
    (tokens/s) allows fewer. Decided once (plan.json), so a resumed run keeps it."""
    r, plan = b.recipe, work / "plan.json"
    if plan.exists():
        return json.loads(plan.read_text())["steps"]
    most = -(-r.target_tokens // per_step)
    if r.target_minutes is None or rate is None:
        return most
    steps = max(r.target_warmup + 1, min(most, int(r.target_minutes * 60 * rate / per_step)))
    _write_json(plan, dict(steps=steps, measured_tokens_per_s=rate, target_minutes=r.target_minutes,
                           target_tokens=r.target_tokens))
    return steps


def stage_target(b: Build, work: Path) -> dict:
    """Next-token training (`pjax.train.target_lm.make_lm_step`, the step `train_target_lm` runs) with orbax
    checkpoints; with target_minutes, the step count is fixed at the end of the warmup from the measured rate (the
    warmup's learning rates do not depend on it)."""
    from pjax.checkpoint import save_native_target
    from pjax.models.families import config_from_hf
    from pjax.train import Checkpointer, RowStream, TrainState
    from pjax.train.target_lm import causal_lengths, make_lm_step
    r = b.recipe
    if r.target_minutes is not None and r.target_warmup < 10:
        raise RecipeError(f"--target-minutes measures the rate during the warmup: --target-warmup must be >= 10, "
                          f"got {r.target_warmup}")
    hf = target_hf_config(b)
    target = init_code_target(config_from_hf(hf), r.seed)
    per_step = r.target_batch_rows * r.target_seq_len
    steps = _target_steps(b, work, per_step, None)
    decided = (work / "plan.json").exists() or r.target_minutes is None

    def make_step(n):
        return make_lm_step(lr=r.target_lr, steps=n, warmup=r.target_warmup, weight_decay=r.target_weight_decay,
                            compute_dtype=r.compute_dtype, remat=r.remat, implementation=b.implementation)
    init, step = make_step(steps)
    stream = RowStream(documents(b, "train"), r.target_seq_len, r.target_batch_rows, seed=r.seed)
    state = TrainState(jnp.zeros((), jnp.int32), target.params, init(target.params),
                       jax.random.key_data(jax.random.key(r.seed)), jnp.zeros((), jnp.int32))
    ckpt = Checkpointer(work / "ckpt", max_to_keep=1)
    history_path = work / "history.json"
    history = []
    if ckpt.latest_step() is not None:
        state = ckpt.restore(state)
        history = json.loads(history_path.read_text()) if history_path.exists() else []
    start = int(state.step)
    n_params = sum(x.size for x in jax.tree.leaves(target.params))
    epoch_tokens = stream.batches_per_epoch * per_step
    b.log(f"target: {n_params / 1e6:.1f} M parameters; {'' if decided else 'at most '}{steps} steps x {per_step} "
          f"tokens = {steps * per_step / 1e6:.1f} M tokens ({steps * per_step / epoch_tokens:.2f} epochs of "
          f"{epoch_tokens / 1e6:.1f} M){'' if decided else f'; fixed after the warmup for {r.target_minutes} min'}"
          f"{f'; resuming at step {start}' if start else ''}")
    params, opt_state, shell = state.params, state.opt_state, type(target)(target.config, target.graphdef, None)
    bar = b.bar(steps, "train target", initial=start, unit="step")
    losses, t_save, log_every = [], time.time(), max(1, min(50, steps // 20))
    t_log = n_log = None
    step_times = []  # until the step count is fixed: each step timed alone (block per step)
    done = start
    while done < steps:
        batch = stream.batch(done)
        lengths = causal_lengths(batch["document_ids"])
        t_step = time.time()
        params, opt_state, loss = step(params, opt_state, shell, jnp.asarray(batch["tokens"]),
                                       jnp.asarray(batch["document_ids"]),
                                       None if lengths is None else jnp.asarray(lengths))
        losses.append(loss)
        done += 1
        if not decided:
            jax.block_until_ready(loss)
            step_times.append(time.time() - t_step)
        if t_log is None:  # the first step compiles: rates count from its end
            jax.block_until_ready(loss)
            t_log, n_log = time.time(), done
        if not decided and done >= min(r.target_warmup, steps) and len(step_times) >= 6:
            # the median step: compilations (the first step, the first batch of the other attention layout) and
            # checkpoint writes are outliers that a mean over the warmup would count
            rate = per_step / float(np.median(step_times[1:]))
            new = _target_steps(b, work, per_step, rate)
            decided = True
            b.log(f"target: {rate:.0f} tokens/s measured; {new} steps ({new * per_step / 1e6:.1f} M tokens) fit "
                  f"{r.target_minutes} min")
            if new != steps:
                steps, step = new, make_step(new)[1]
                log_every = max(1, min(50, steps // 20))
                if bar is not None:
                    bar.total = steps
                    bar.refresh()
        if done % log_every == 0 or done == steps:
            value = float(np.mean(jax.device_get(losses)))
            now = time.time()
            rate = (done - n_log) * per_step / max(now - t_log, 1e-9) if done > n_log else float("nan")
            history.append(dict(step=done, loss=value, tokens_per_s=rate))
            eta = (steps - done) * per_step / rate if rate == rate and rate > 0 else float("nan")
            if bar is not None:
                bar.set_postfix_str(f"loss {value:.3f} {rate / 1e3:.0f}k tok/s")
            else:
                b.log(f"target step {done}/{steps} loss {value:.4f} {rate:.0f} tok/s ETA {eta / 60:.1f} min")
            losses, t_log, n_log = [], now, done
        if bar is not None:
            bar.update(1)
        stopping = b.stop_now() and done < steps
        if done < steps and (stopping or time.time() - t_save >= b.save_seconds):
            ckpt.save(TrainState(jnp.asarray(done, jnp.int32), params, opt_state, state.rng,
                                 jnp.asarray(done, jnp.int32)))
            _write_json(history_path, history)
            t_save = time.time()
        if stopping:
            if bar is not None:
                bar.close()
            ckpt.close()
            raise Incomplete(f"target: stopped at step {done}/{steps} (checkpoint saved)")
    if bar is not None:
        bar.close()
    ckpt.close()
    trained = type(target)(target.config, target.graphdef, params)
    held = _eval_loss(b, trained, documents(b, "held_out"))
    b.log(f"target: held-out loss {held['loss']:.4f} (perplexity {held['perplexity']:.2f}) over "
          f"{held['tokens']} tokens")
    save_native_target(trained, hf, work / "model")
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    return dict(parameters=int(n_params), steps=steps, tokens=steps * per_step, history=history, held_out=held)


def load_code_target(b: Build, dtype=jnp.float32):
    from pjax.checkpoint import load_target
    return load_target(b.dir("target") / "model", dtype=dtype)


def _prompts(b: Build, split: str, count: int, seed: int) -> tuple[list[list[int]], int]:
    """`count` regeneration prompts of the split, shuffled with `seed`: regen_function_fraction of them functions'
    signatures and docstrings (`function_prompts`; BOS + the tokenized prompt, at most regen_prompt_tokens; fewer
    when the split has fewer), the rest prefixes of its files (BOS + 32..regen_prompt_tokens tokens, file and length
    drawn with `seed`). Returns (prompts, function prompts among them)."""
    from pjax.train.corpus import function_prompts, read_texts
    r = b.recipe
    rng = np.random.default_rng(seed)
    functions = []
    want = int(round(count * r.regen_function_fraction))
    if want:
        tok = load_tokenizer(b)
        for p in function_prompts(read_texts(b.dir("corpus") / f"{split}.jsonl")):
            ids = tok.encode(p.prompt).ids
            if len(ids) <= r.regen_prompt_tokens:
                functions.append(ids)
                if len(functions) == want:
                    break
    docs = [d for d in documents(b, split) if len(d.tokens) > 33]
    picks = rng.integers(0, len(docs), count - len(functions))
    lengths = [int(rng.integers(32, min(r.regen_prompt_tokens, len(docs[i].tokens) - 1) + 1)) for i in picks]
    prompts = functions + [docs[i].tokens[:n].tolist() for i, n in zip(picks, lengths)]
    return [prompts[i] for i in rng.permutation(len(prompts))], len(functions)


def _continue(b: Build, target, prompts: list[list[int]], seed: int, label: str):
    """The prompts continued by the target (`pjax.generate`, regen_temperature; stops at EOS) -> (token arrays, loss
    masks: 1 on the continuation, new tokens)."""
    import pjax
    r = b.recipe
    eos = special_ids(b)["eos_token"]
    bar = b.bar(len(prompts), label, unit="prompt")
    out_tokens, out_mask, t0, new = [], [], time.time(), 0
    for i in range(0, len(prompts), r.regen_batch):
        batch = prompts[i:i + r.regen_batch]
        res = pjax.generate(target, None, batch, max_new_tokens=r.regen_new_tokens, drafting="none",
                            temperature=r.regen_temperature, seed=[seed + i + j for j in range(len(batch))],
                            eos_token_id=eos, implementation=b.implementation)
        for p, g in zip(batch, res.tokens):
            out_tokens.append(np.asarray(p + g, np.int32))
            out_mask.append(np.concatenate([np.zeros(len(p), np.int8), np.ones(len(g), np.int8)]))
            new += len(g)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix_str(f"{new / (time.time() - t0):.0f} new tok/s")
    if bar is not None:
        bar.close()
    return out_tokens, out_mask, new


def _save_documents(work: Path, name: str, tokens, masks) -> None:
    np.save(work / f"{name}tokens.npy", np.concatenate(tokens))
    np.save(work / f"{name}loss_mask.npy", np.concatenate(masks))
    np.save(work / f"{name}offsets.npy", np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64))


def _load_documents(work: Path, name: str):
    from pjax.train.data import Document
    toks, mask = np.load(work / f"{name}tokens.npy"), np.load(work / f"{name}loss_mask.npy")
    offs = np.load(work / f"{name}offsets.npy")
    return [Document(toks[a:e], mask[a:e]) for a, e in zip(offs[:-1], offs[1:])]


def stage_regen(b: Build, work: Path) -> dict:
    """With head_data "regenerated": training-file prompts (`_prompts`) continued by the target (`_continue`) ->
    documents whose continuation is supervised; and regen_eval_prompts held-out-file prompts, continued the same way,
    for the heads' held-out evaluation. With "corpus": nothing to do."""
    r = b.recipe
    if r.head_data == "corpus":
        return dict(head_data="corpus")
    target = load_code_target(b, jnp.dtype(r.compute_dtype or "float32"))
    t0 = time.time()
    prompts, functions = _prompts(b, "train", r.regen_prompts, r.seed + 4)
    tokens, masks, new = _continue(b, target, prompts, r.seed + 4, "regenerate")
    _save_documents(work, "", tokens, masks)
    seconds = time.time() - t0
    b.log(f"regen: {len(tokens)} continuations ({functions} of functions' signatures and docstrings), "
          f"{new / 1e6:.2f} M new tokens in {seconds:.0f} s")
    prompts, held_functions = _prompts(b, "held_out", r.regen_eval_prompts, r.seed + 5)
    held, held_masks, held_new = _continue(b, target, prompts, r.seed + 5, "regenerate held-out")
    _save_documents(work, "held_out_", held, held_masks)
    b.log(f"regen: {len(held)} held-out continuations ({held_functions} of functions), {held_new / 1e6:.2f} M new "
          "tokens")
    prompt_tokens = int(sum(int(np.sum(m == 0)) for m in masks))
    return dict(head_data="regenerated", prompts=len(tokens), function_prompts=functions, prompt_tokens=prompt_tokens,
                new_tokens=new, seconds=round(seconds, 1), held_out_prompts=len(held),
                held_out_function_prompts=held_functions, held_out_new_tokens=held_new)


def head_documents(b: Build, split: str = "train"):
    """The heads' training (split "train") or evaluation ("held_out") documents: the corpus' files of that split, or
    the regenerated continuations of its prefixes."""
    if b.recipe.head_data == "corpus":
        return documents(b, split)
    return _load_documents(b.dir("regen"), "" if split == "train" else "held_out_")


def _head_config(b: Build, objective: str, target, docs):
    from pjax.train import (CodConfig, OptimConfig, TrainConfig, build_vocab_mapping, drafter_config_for_target,
                            token_frequencies)
    r, peagle = b.recipe, objective == "peagle"
    v = target.config.vocab_size
    vd = r.draft_vocab_size or v
    d2t = build_vocab_mapping(token_frequencies(docs, v), vd, v)[0] if vd < v else None
    dcfg = drafter_config_for_target(
        target.config, num_layers=r.peagle_layers if peagle else r.eagle3_layers, draft_vocab_size=vd,
        mask_token_id=special_ids(b)["mask_token"], aux_layer_ids=r.aux_layer_ids, model_kind=objective,
        num_depths=r.peagle_depths if peagle else None)
    cfg = TrainConfig(
        objective=objective, total_seq_len=r.head_seq_len, batch_rows=r.head_batch_rows, total_steps=r.head_steps,
        cod=CodConfig(num_depths=r.peagle_depths, down_sample_ratio=r.peagle_down_sample_ratio,
                      down_sample_ratio_min=r.peagle_down_sample_ratio_min, max_anchors=r.peagle_max_anchors),
        ttt_steps=r.eagle3_ttt_steps, num_segments=r.peagle_segments if peagle else 1,
        optim=OptimConfig(lr=r.peagle_lr if peagle else r.eagle3_lr, warmup_steps=r.head_warmup,
                          weight_decay=r.head_weight_decay, train_embeddings=peagle, optimizer=r.head_optimizer),
        compute_dtype=r.compute_dtype, remat=r.remat, seed=r.seed, implementation=b.implementation)
    return dcfg, d2t, cfg


def _train_head(b: Build, work: Path, objective: str) -> dict:
    from pjax.checkpoint import save_drafter
    from pjax.train import Checkpointer, RowStream, evaluate_drafter, init_drafter_for_target, make_mesh, train_drafter
    from pjax.train.loop import format_metrics
    from pjax.train.state import drafter_from_state, init_train_state
    from pjax.train.step import replicate
    r = b.recipe
    target32 = load_code_target(b)
    docs = head_documents(b)
    dcfg, d2t, cfg = _head_config(b, objective, target32, docs)
    drafter = init_drafter_for_target(target32, dcfg, jax.random.key(r.seed + (2 if objective == "peagle" else 3)),
                                      d2t=d2t)
    mesh = make_mesh(jax.devices()[:1])
    target = replicate(target32 if r.compute_dtype is None else target32.astype(r.compute_dtype), mesh)
    stream = RowStream(docs, r.head_seq_len, r.head_batch_rows, seed=r.seed + 1)
    state = replicate(init_train_state(drafter, cfg), mesh)
    ckpt = Checkpointer(work / "ckpt", max_to_keep=1)
    history_path = work / "history.json"
    history = []
    if ckpt.latest_step() is not None:
        state = ckpt.restore(state)
        history = json.loads(history_path.read_text()) if history_path.exists() else []
    start = int(jax.device_get(state.step))
    tokens = r.head_steps * r.head_batch_rows * r.head_seq_len
    b.log(f"{objective}: {dcfg.layer.num_layers} layer(s), aux layers {dcfg.aux_layer_ids}, "
          f"{'depths ' + str(r.peagle_depths) if objective == 'peagle' else 'ttt steps ' + str(r.eagle3_ttt_steps)}, "
          f"{r.head_steps} steps ({tokens / 1e6:.1f} M tokens){f', resuming at step {start}' if start else ''}")
    log_every = max(1, min(25, r.head_steps // 20))  # also the steps between time checks
    bar = b.bar(r.head_steps, f"train {objective}", initial=start, unit="step")
    t_save, done = time.time(), start
    while done < r.head_steps:
        stop = min(r.head_steps, done + log_every)
        res = train_drafter(target, drafter, stream, cfg, steps=stop, mesh=mesh, state=state, progress=False,
                            log_every=log_every)
        state, history = res.state, history + res.history
        if bar is not None:
            bar.update(stop - done)
            if res.history:
                bar.set_postfix_str(format_metrics(res.history[-1]).split(" ", 2)[2])
        elif res.history:
            rate = res.history[-1]["tokens_per_s"]
            eta = (r.head_steps - stop) * r.head_batch_rows * r.head_seq_len / rate if rate > 0 else float("nan")
            b.log(f"{objective} {format_metrics(res.history[-1])} ETA {eta / 60:.1f} min")
        done = stop
        stopping = b.stop_now() and done < r.head_steps
        if done < r.head_steps and (stopping or time.time() - t_save >= b.save_seconds):
            ckpt.save(state)
            _write_json(history_path, history)
            t_save = time.time()
        if stopping:
            if bar is not None:
                bar.close()
            ckpt.close()
            raise Incomplete(f"{objective}: stopped at step {done}/{r.head_steps} (checkpoint saved)")
    if bar is not None:
        bar.close()
    ckpt.close()
    held = evaluate_drafter(target, drafter, RowStream(head_documents(b, "held_out"), r.head_seq_len,
                                                       r.head_batch_rows, seed=r.seed + 6),
                            cfg, batches=r.head_eval_batches, state=state, mesh=mesh)
    save_drafter(drafter_from_state(drafter, state), work / "head", dtype="float32")
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    last = history[-1] if history else {}
    for name, m in (("final (training batches)", last), ("held-out", held)):
        if m:  # marginal, conditional (earlier depths right) and whole-chain accuracy per depth / step
            b.log(f"{objective}: {name} " + " ".join(f"{k}{_fmt(m[k])}" for k in ("acc", "cond_acc", "chain_acc")
                                                     if k in m))
    return dict(steps=r.head_steps, tokens=tokens, layers=dcfg.layer.num_layers, aux_layer_ids=dcfg.aux_layer_ids,
                final=last, held_out=held, history=history)


def stage_peagle(b: Build, work: Path) -> dict:
    return _train_head(b, work, "peagle")


def stage_eagle3(b: Build, work: Path) -> dict:
    return _train_head(b, work, "eagle3")


def stage_export(b: Build, work: Path) -> dict:
    """DIR/pair, written beside its place and renamed in (its previous copy replaced as a whole)."""
    from pjax.checkpoint import load_drafter, save_drafter
    from pjax.checkpoint.files import write_output_dir
    from pjax.checkpoint.hf_export import save_hf_target
    r = b.recipe
    final = b.out / "pair"
    target = load_code_target(b)
    summary = dict(recipe=dataclasses.asdict(r), written_at=_now(),
                   stages={s: (b.marker(s) or {}).get("summary") for s in ("corpus", "tokenizer", "tokens", "regen")},
                   target={k: v for k, v in b.marker("target")["summary"].items() if k != "history"},
                   heads={h: {k: v for k, v in b.marker(h)["summary"].items() if k != "history"}
                          for h in ("peagle", "eagle3")})
    with write_output_dir(final, force=True, kind=PAIR_KIND, metadata={"recipe": "examples/code_pair.py"}) as tmp:
        save_hf_target(target, tmp / "target", dtype=r.export_dtype, tokenizer_dir=b.dir("tokenizer"),
                       max_position_embeddings=r.target_seq_len)
        for head in ("peagle", "eagle3"):
            save_drafter(load_drafter(b.dir(head) / "head", dtype=jnp.float32), tmp / head, dtype=r.export_dtype,
                         verifier_name_or_path=str(final / "target"))
        shutil.copyfile(b.dir("corpus") / "prompts.jsonl", tmp / "prompts.jsonl")
        shutil.copyfile(b.dir("corpus") / "manifest.json", tmp / "corpus_manifest.json")
        _write_json(tmp / "pair.json", summary)
    b.log(f"export: {final} (target/, peagle/, eagle3/, prompts.jsonl, corpus_manifest.json, pair.json)")
    return dict(pair=str(final))


def stage_check(b: Build, work: Path) -> dict:
    import pjax
    r = b.recipe
    pair = b.out / "pair"
    target = pjax.load_target(pair / "target", dtype=jnp.dtype(r.export_dtype))
    tok = load_tokenizer(b)
    rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()]
    fits = [ids for ids in (tok.encode(row["prompt"]).ids for row in rows)
            if len(ids) + r.check_new_tokens <= r.target_seq_len]  # within the trained context
    prompts = fits[:r.check_prompts]
    if not prompts:
        raise RecipeError(f"no benchmark prompt fits {r.check_new_tokens} new tokens within the trained context of "
                          f"{r.target_seq_len}: lower --check-new-tokens")
    kw = dict(max_new_tokens=r.check_new_tokens, implementation=b.implementation)
    plain = pjax.generate(target, None, prompts, drafting="none", **kw)
    out = dict(prompts=len(prompts), new_tokens=r.check_new_tokens, dtype=r.export_dtype,
               plain_tokens_per_s=plain.stats["output_tokens_per_s"])
    for head, drafting, k in (("peagle", "parallel", r.peagle_depths), ("eagle3", "sequential", r.eagle3_ttt_steps)):
        drafter = pjax.load_drafter(pair / head, dtype=jnp.dtype(r.export_dtype), target=target)
        res = pjax.generate(target, drafter, prompts, drafting=drafting, num_speculative_tokens=k, **kw)
        same = sum(a == p for a, p in zip(res.tokens, plain.tokens))
        forced = _teacher_forced(b, target, drafter, head, k, prompts, plain.tokens)
        rates = res.stats["acceptance_rates"]
        out[head] = dict(k=k, mean_acceptance_length=res.stats["mean_acceptance_length"],
                         acceptance_rates=rates, identical_to_plain=same == len(prompts),
                         identical_rows=same, tokens_per_s=res.stats["output_tokens_per_s"], teacher_forced=forced)
        b.log(f"check {head}: K={k} mean acceptance length {res.stats['mean_acceptance_length']:.3f}, per-position "
              f"{[round(x, 3) for x in rates]}; {same}/{len(prompts)} rows identical to plain greedy decoding "
              f"({r.export_dtype})")
        conditional = [a / p if p else float("nan") for a, p in zip(rates, [1.0] + list(rates[:-1]))]
        b.log(f"check {head}: decoding, position i accepted given i - 1 {_fmt(conditional)}; the same sequences "
              f"teacher-forced: depth d right given depths < d {_fmt(forced['cond_acc'])}"
              + (f", chain 0..d right {_fmt(forced['chain_acc'])}" if "chain_acc" in forced else ""))
        if drafting == "parallel":
            out[head]["replay"] = rp = _replay(target, drafter, k, prompts, res.tokens, b.implementation)
            b.log(f"check {head}: decoding replayed from the teacher-forced drafts of its own outputs, per-position "
                  f"{_fmt(rp['acceptance_rates'])} over {rp['rounds']} rounds; every anchor of the same outputs: "
                  f"chain 0..d right {_fmt(rp['every_anchor_chain'])} over {rp['anchors']} anchors")
    return out


def _fmt(xs) -> str:
    return "[" + " ".join(f"{x:.2f}" for x in xs) + "]"


def _teacher_forced(b: Build, target, drafter, objective: str, k: int, prompts, outputs) -> dict:
    """The head's training metrics (`pjax.train.evaluate_drafter`, every anchor at every depth) on prompt + output
    sequences, the outputs supervised: what decoding them would accept if drafting and training agree."""
    from pjax.train import CodConfig, RowStream, TrainConfig, evaluate_drafter
    from pjax.train.data import Document
    r = b.recipe
    docs = [Document(np.asarray(p + o, np.int32), np.asarray([0] * len(p) + [1] * len(o), np.int8))
            for p, o in zip(prompts, outputs) if o]
    stream = RowStream(docs, r.head_seq_len, 1, shuffle=False)
    cfg = TrainConfig(objective=objective, total_seq_len=r.head_seq_len, batch_rows=1, total_steps=1,
                      cod=CodConfig(num_depths=k, down_sample_ratio=1.0, down_sample_ratio_min=1.0, max_anchors=None),
                      ttt_steps=k, compute_dtype=r.compute_dtype, seed=r.seed, implementation=b.implementation)
    return evaluate_drafter(target, drafter, stream, cfg, batches=stream.batches_per_epoch)


def _replay(target, drafter, k: int, prompts, outputs, implementation: str) -> dict:
    """Greedy parallel decoding of prompt + output sequences replayed from the head's teacher-forced drafts
    (`pjax.train.replay_rounds`): the replay's per-position acceptance (rounds whose draft i was accepted / rounds)
    and the chain accuracy over every anchor, both over anchors whose k drafts lie inside the sequence. Replay vs
    decoding = drafting vs training; every anchor vs replay = what the choice of round starts costs."""
    from pjax.train import replay_rounds, teacher_forced_drafts
    accepted, every = np.zeros(k), np.zeros(k)
    rounds = anchors = 0
    for p, o in zip(prompts, outputs):
        if len(o) <= k:  # no anchor has all k drafts inside the sequence
            continue
        seq = list(p) + list(o)
        chain, starts = replay_rounds(teacher_forced_drafts(target, drafter, seq, k, implementation=implementation),
                                      seq, len(p) - 1)
        every += chain.sum(0)
        anchors += len(chain)
        accepted += chain[starts].sum(0)
        rounds += len(starts)
    return dict(rounds=rounds, anchors=anchors, acceptance_rates=(accepted / max(rounds, 1)).tolist(),
                every_anchor_chain=(every / max(anchors, 1)).tolist())


RUN = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "tokens": stage_tokens, "target": stage_target,
       "regen": stage_regen, "peagle": stage_peagle, "eagle3": stage_eagle3, "export": stage_export, "check": stage_check}
TRAINING = ("target", "peagle", "eagle3")


def run_stage(b: Build, stage: str) -> str:
    """Run one stage unless it is done; returns "done" (skipped) or "built"."""
    missing = [u for u in _inputs(stage) if not b.done(u)]
    if missing:
        raise RecipeError(f"stage {stage} needs {', '.join(missing)} first (run without --stage, or --stage "
                          f"{missing[0]})")
    if b.done(stage):
        return "done"
    d = b.dir(stage)
    old = b.marker(stage)
    progress_file = d / "progress.json"
    started = json.loads(progress_file.read_text()) if progress_file.exists() else None
    stale = old if old is not None else (started if started and started.get("key") != b.key(stage) else None)
    if stale is not None:
        if not b.force:
            raise RecipeError(f"stage {stage} in {b.out} was {'built' if old else 'started'} with other settings "
                              f"({_differences(b, stage, stale)}); pass --force to rebuild it")
        shutil.rmtree(d)
    if b.stop_now():
        raise Incomplete(f"time limit reached before stage {stage}")
    ident = dict(key=b.key(stage), settings=b.settings(stage), inputs={u: b.key(u) for u in _inputs(stage)})
    t0 = time.time()
    if stage in TRAINING:
        d.mkdir(exist_ok=True)
        _write_json(progress_file, ident)
        summary = RUN[stage](b, d)
        work = d
    else:
        work = b.out / f".{stage}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        summary = RUN[stage](b, work)
    _write_json(work / "stage.json", dict(stage=stage, **ident, summary=summary, seconds=round(time.time() - t0, 1),
                                          finished_at=_now()))
    if work != d:
        os.rename(work, d)
    return "built"


def check_recipe(r: Recipe) -> None:
    """RecipeError naming the flag of a choice no stage can take (before any stage runs)."""
    if r.head_data not in ("corpus", "regenerated"):
        raise RecipeError(f"--head-data {r.head_data!r}: expected 'corpus' or 'regenerated'")
    if r.head_optimizer not in ("adamw", "muon"):
        raise RecipeError(f"--head-optimizer {r.head_optimizer!r}: expected 'adamw' or 'muon'")
    if not 0.0 <= r.regen_function_fraction <= 1.0:
        raise RecipeError(f"--regen-function-fraction {r.regen_function_fraction}: expected a fraction in [0, 1]")


def build(out, recipe: Recipe = FULL, *, stages=STAGES, force: bool = False, progress: bool = True,
          max_minutes: Optional[float] = None, save_minutes: float = 4.0, implementation: str = "auto",
          log: Callable[[str], None] = print,
          should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Run `stages` (in recipe order) of the build at `out`; returns {stage: "done" | "built"}. Raises Incomplete
    when the time limit (or `should_stop`) stopped it (the same call continues), RecipeError when it cannot go on."""
    check_recipe(recipe)
    out = open_build(out, force=force)
    deadline = None if max_minutes is None else time.time() + 60 * max_minutes
    b = Build(out, recipe, force=force, progress=progress, deadline=deadline, save_seconds=60 * save_minutes,
              implementation=implementation, log=log, should_stop=should_stop)
    result = {}
    for stage in [s for s in STAGES if s in stages]:
        t0 = time.time()
        with _locked(out, stage):
            result[stage] = run_stage(b, stage)
            if result[stage] == "built":
                log(f"stage {stage}: built in {time.time() - t0:.0f} s")
    return result


# ============================================================================================ command line
def _flag_type(tp):
    """(argparse type, nargs) for a Recipe field's annotation."""
    args = typing.get_args(tp)
    optional = type(None) in args
    inner = next((a for a in args if a is not type(None)), tp) if optional else tp
    if typing.get_origin(inner) is tuple:
        elem = typing.get_args(inner)[0]
        return elem, "+"
    if inner is bool:
        return bool, None

    def parse(text, inner=inner):
        if optional and text.lower() == "none":
            return None
        return inner(float(text)) if inner is int and ("e" in text.lower() or "_" in text) else inner(text)
    parse.__name__ = getattr(inner, "__name__", "value")
    return parse, None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="build directory (created; a re-run continues it)")
    p.add_argument("--tiny", action="store_true", help="tiny corpus, tokenizer, target and heads (CPU, minutes)")
    p.add_argument("--stage", choices=STAGES + ("heads",), help="run only this stage (its inputs must be built)")
    p.add_argument("--force", action="store_true", help="rebuild stages whose settings or inputs changed")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop cleanly after this many minutes (exit status 75; run again to continue)")
    p.add_argument("--save-minutes", type=float, default=4.0, help="training checkpoints at least this often")
    p.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto", help="the kernel switch")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")
    p.add_argument("--no-compilation-cache", action="store_true",
                   help="do not keep compiled programs in DIR/.jax_cache between runs")
    p.add_argument("--deterministic", action="store_true",
                   help="GPU: deterministic XLA reductions (same bits run to run, somewhat slower)")
    group = p.add_argument_group("recipe (defaults: the full build; --tiny changes some)")
    hints = typing.get_type_hints(Recipe)
    for f in dataclasses.fields(Recipe):
        flag = "--" + f.name.replace("_", "-")
        kind, nargs = _flag_type(hints[f.name])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(full: {f.default})")
        else:
            group.add_argument(flag, type=kind, nargs=nargs, default=None, metavar=f.name.split("_")[-1].upper(),
                               help=f"(full: {f.default})")
    return p.parse_args(argv)


def recipe_from_args(a) -> Recipe:
    base = TINY if a.tiny else FULL
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(Recipe) if getattr(a, f.name) is not None}
    return dataclasses.replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.deterministic:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    recipe = recipe_from_args(a)
    if not a.no_compilation_cache:
        from pjax.decode.compiled import use_compilation_cache
        use_compilation_cache(Path(a.out) / ".jax_cache")
    stages = STAGES if a.stage is None else (("peagle", "eagle3") if a.stage == "heads" else (a.stage,))
    t0 = time.time()
    try:
        result = build(a.out, recipe, stages=stages, force=a.force, progress=not a.no_progress,
                       max_minutes=a.max_minutes, save_minutes=a.save_minutes, implementation=a.implementation)
    except Incomplete as e:
        print(f"{e}; {time.time() - t0:.0f} s this run. Run the same command again to continue.", flush=True)
        sys.exit(EXIT_INCOMPLETE)
    except RecipeError as e:
        raise SystemExit(f"error: {e}") from None
    pair = Path(os.path.abspath(a.out)) / "pair"
    if a.stage is None:
        print(f"pair complete: {pair} ({time.time() - t0:.0f} s this run; stages {result})", flush=True)
    return result


if __name__ == "__main__":
    main()
