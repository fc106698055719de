"""The recipe's settings (`Recipe`: every field is also a flag), its stages, what each reads and which settings
each depends on."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Optional

from examples.code_pair.corpus import DEFAULT_PACKAGES

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
    # split's files (`corpus.function_prompts`, the form a code drafter is asked to continue), the rest
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
# The whole path on a CPU, still a demo that shows something: a near-byte vocabulary and 400 target steps give a
# target that writes words, if repetitive ones (held-out loss 3.4 nats a token; 60 steps of a 1,024-id vocabulary
# left one that wrote only spaces, against which no P-EAGLE draft was accepted), and 120 steps give heads that learn
# (held-out depth-0 accuracy 0.20 P-EAGLE, 0.32 EAGLE-3; decoding acceptance length 1.72 for P-EAGLE at K = 4).
TINY = dataclasses.replace(
    FULL, packages=("stdlib",), max_files=160, held_out_fraction=0.1, max_file_bytes=40_000, prompts=8, min_prompts=2,
    vocab_size=320, tokenizer_sample_bytes=2_000_000, target_layers=4, target_hidden=64, target_heads=4,
    target_kv_heads=2, target_intermediate=176, target_seq_len=256, target_batch_rows=4, target_tokens=400 * 4 * 256,
    target_lr=3e-3, target_warmup=20, eval_rows=8, head_seq_len=256, head_batch_rows=4, head_steps=120,
    regen_prompts=24, regen_prompt_tokens=64, regen_new_tokens=24, regen_batch=8, regen_eval_prompts=24,
    head_eval_batches=2,
    head_data="corpus", peagle_layers=2, peagle_depths=4, peagle_max_anchors=None, peagle_lr=3e-3, eagle3_lr=3e-3,
    compute_dtype=None, export_dtype="float32", check_prompts=2, check_new_tokens=32)

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


def inputs(stage: str) -> tuple[str, ...]:
    """Every stage a stage reads (its upstream closure)."""
    out = []
    for u in UPSTREAM[stage]:
        for x in inputs(u) + (u,):
            if x not in out:
                out.append(x)
    return tuple(out)


def check_recipe(r: Recipe) -> None:
    """RecipeError naming the flag of a choice no stage can take (before any stage runs)."""
    if r.head_data not in ("corpus", "regenerated"):
        raise RecipeError(f"--head-data {r.head_data!r}: expected 'corpus' or 'regenerated'")
    if r.head_optimizer not in ("adamw", "muon"):
        raise RecipeError(f"--head-optimizer {r.head_optimizer!r}: expected 'adamw' or 'muon'")
    if not 0.0 <= r.regen_function_fraction <= 1.0:
        raise RecipeError(f"--regen-function-fraction {r.regen_function_fraction}: expected a fraction in [0, 1]")


def jsonable(v):
    return list(v) if isinstance(v, tuple) else v


def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, written beside it and renamed in."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(obj, indent=1, default=jsonable) + "\n")
    os.replace(tmp, path)


def resume(work: Path, state):
    """A training stage's (checkpointer, state, logged history): restored from its checkpoint under `work` when
    there is one, else (a new checkpointer, `state`, []). The history lives in work / "history.json"."""
    from pjax.train.checkpoint import Checkpointer
    ckpt = Checkpointer(work / "ckpt", max_to_keep=1)
    if ckpt.latest_step() is None:
        return ckpt, state, []
    path = work / "history.json"
    return ckpt, ckpt.restore(state), json.loads(path.read_text()) if path.exists() else []


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def fmt(xs) -> str:
    return "[" + " ".join(f"{x:.2f}" for x in xs) + "]"


MIN_FIRST_ACCURACY = 0.1  # a head whose held-out depth-0 accuracy is below this has not learned
MIN_ACCEPTANCE_LENGTH = 1.1  # a head below this acceptance length drafts almost nothing the target accepts


def not_learned(head: str, *, first_accuracy: Optional[float] = None,
                acceptance_length: Optional[float] = None) -> Optional[str]:
    """A warning when a head's held-out depth-0 accuracy or decoding acceptance length says it has not learned,
    else None."""
    if first_accuracy is not None and first_accuracy < MIN_FIRST_ACCURACY:
        return (f"warning: the {head} head has not learned: held-out depth-0 accuracy {first_accuracy:.2f} (below "
                f"{MIN_FIRST_ACCURACY}); train it longer (--head-steps) or check the target's held-out loss")
    if acceptance_length is not None and acceptance_length < MIN_ACCEPTANCE_LENGTH:
        return (f"warning: the {head} head has not learned: mean acceptance length {acceptance_length:.2f} (below "
                f"{MIN_ACCEPTANCE_LENGTH}), the target rejects almost every draft")
    return None
