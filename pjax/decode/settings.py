"""The decoding settings: one frozen `EngineConfig` with one set of defaults, shared by `pjax.generate`, the text API,
the benchmark, the server and every CLI (whose flags for these settings come from `FLAGS`, defined once here), and
`make_spec`, which checks them against a (target, drafter) pair and returns the static `EngineSpec`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional, Union

from pjax.decode import inputs as I
from pjax.decode.budget import TREE_CANDIDATES, is_auto
from pjax.decode.compiled import use_compilation_cache
from pjax.decode.drafting import Drafting, resolve
from pjax.decode.state import DRAFT_SAMPLING, EngineSpec
from pjax.decode.tree import SCORES, beam_width, candidate_count, path_count
from pjax.kernels import IMPLEMENTATIONS
from pjax.models.target import Target

__all__ = ["DEFAULT_MAX_LEN", "FLAGS", "EngineConfig", "add_compilation_cache_flag", "add_flags", "add_mesh_flag",
           "check_tree", "config_from_flags", "configure", "make_spec", "mesh_from_flags", "number_flag",
           "use_compilation_cache_flag"]

DEFAULT_MAX_LEN = 2048


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Decoding settings (validated when an engine is built).

    drafting: "parallel" (P-EAGLE) | "sequential" (EAGLE-3) | "none" (plain decoding); None = the head's kind
      (none without a head). num_speculative_tokens: K drafts per round; None = the drafting's default (7 for
      parallel, at most the head's trained depth; 3 for sequential); "auto" = a budget that follows the load: each
      device chunk runs the K of best expected tokens per second, 0 (plain decoding) to 7 (at most the head's
      trained depth for parallel drafting), from round times measured at warm-up and while running and the
      acceptance seen so far (`pjax.decode.budget`; one compiled program per budget, none after warm-up).
    draft_sampling: "argmax" (vLLM's default) | "sample" (drafts sampled from the drafter's distribution).
    tree_budget: None (each round verifies a chain of K drafts), or N >= K: each round verifies a tree of N draft
      tokens of depth <= K in one target pass (argmax drafts; greedy and sampled rows alike,
      `pjax.decode.tree.accept_tree`): parallel drafting's N most probable paths of the drafter's per-position
      distributions, or sequential drafting's dynamic tree, grown depth by depth (`pjax.decode.tree.grow_tree`);
      "auto" (parallel drafting, num_speculative_tokens None or "auto"): each device chunk runs the chain budget K
      or the tree of 8, 16 or 32 nodes (depth K_max) of best tokens per second (`pjax.decode.budget`).
    tree_score: how a tree ranks paths: "product" of the per-depth probabilities, or their "min" (deeper trees;
      `pjax.decode.tree.build_tree`).
    temperature / top_k / top_p: the sampling of a request that gives none (0 = greedy; 0 and 1 = no filter).
    prefill: the target prefill's layout, "auto" | "packed" | "padded" (`pjax.generate`).
    rounds_per_step: rounds per device chunk: requests join, tokens stream and host stops apply between chunks (a
      static batch run to its end, `pjax.generate`, takes chunks of about 0.5 s instead, the first 4 x this).
    max_slots: requests decoded at once (the device holds that many rows rounded up to a power of two);
      `pjax.generate` uses one per prompt. max_len: KV positions per request (prompt + max_new_tokens + 2 K must
      fit); None = what the batch needs for `pjax.generate`, DEFAULT_MAX_LEN (at most the target's
      max_position_embeddings) for the serving engine.
    max_admit_rows: requests prefilled by one admission program at most (rounded up to a power of two); None = every
      free slot at once (`pjax.generate`: one prefill of the whole batch). Larger admissions launch fewer programs
      (at c = 64, 64 rows run 1.13x faster than 8: `docs/performance.md`); smaller ones hold running requests for a
      shorter prefill and compile fewer admission programs.
    implementation: the kernel switch, "xla" | "pallas" | "auto". cache_dtype: KV cache dtype (None: the model's).
    allow_tf32: float32 models run full-precision products unless True. compiler_options: XLA options.
    """
    drafting: Optional[str] = None
    num_speculative_tokens: Optional[Union[int, str]] = None
    draft_sampling: str = "argmax"
    tree_budget: Optional[Union[int, str]] = None
    tree_score: str = "product"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    prefill: str = "auto"
    rounds_per_step: int = 8
    max_slots: int = 8
    max_len: Optional[int] = None
    max_admit_rows: Optional[int] = 64
    implementation: str = "auto"
    cache_dtype: Optional[str] = None
    allow_tf32: bool = False
    compiler_options: Optional[dict] = dataclasses.field(default=None, hash=False)


def configure(config: Optional[EngineConfig] = None, **settings) -> EngineConfig:
    """`config` (default: EngineConfig()) with the fields in `settings` replaced; unknown names are a TypeError."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be a pjax.decode.EngineConfig, got {type(config).__name__}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    bad = sorted(set(settings) - fields)
    if bad:
        raise TypeError(f"unknown setting(s) {', '.join(bad)}: expected EngineConfig fields "
                        f"({', '.join(sorted(fields))})")
    return dataclasses.replace(config, **settings)


# ------------------------------------------------------------------------------------------ the pair

def make_spec(target, drafter, config: EngineConfig, *, max_new_tokens: int,
              acceptance: Optional[Callable] = None) -> EngineSpec:
    """Check `config`'s drafting settings and the (target, drafter) pair; returns the static EngineSpec (output
    buffer for `max_new_tokens`; num_speculative_tokens "auto": K = state_k = K_max, the spec of admissions, whose
    rounds' specs replace K by each budget; tree_budget "auto": also state_tree = N_max, the largest tree budget
    the draft vocabulary allows (at most 32), and tree_budget None). acceptance: None, or a hashable function
    replacing the acceptance rule of a round (`EngineSpec.acceptance`)."""
    if not isinstance(target, Target):
        raise TypeError(f"target must be a pjax Target (load one with pjax.load_target(path)), got "
                        f"{type(target).__name__}" + (" (a path? use pjax.load_target)" if isinstance(target, str)
                                                        else ""))
    c = config
    if c.draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling={c.draft_sampling!r}: expected one of {DRAFT_SAMPLING}")
    if c.implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={c.implementation!r}: expected one of {IMPLEMENTATIONS}")
    if not I.is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    tree_auto = is_auto(c.tree_budget)
    if tree_auto:
        if c.num_speculative_tokens not in (None, "auto"):
            raise ValueError(f"tree_budget='auto' chooses among chains and trees: num_speculative_tokens must be "
                             f"'auto' or None, got {c.num_speculative_tokens!r}")
        c = dataclasses.replace(c, num_speculative_tokens="auto")
    drafting, k = resolve(drafter, c.drafting, c.num_speculative_tokens)
    aux = drafting.check_pair(target, drafter, k)
    mask_id = 0
    if drafting.speculative and drafter.config.mask_token_id is not None:
        mask_id = drafter.config.mask_token_id
    if acceptance is not None and not drafting.speculative:
        raise ValueError("an acceptance rule needs drafting='parallel' or 'sequential'")
    auto = is_auto(c.num_speculative_tokens) and drafting.speculative
    n_max = None
    if tree_auto:
        if drafting is not Drafting.PARALLEL:
            raise ValueError(f"tree_budget='auto' needs drafting='parallel' (its rounds keep the argmax chain beside "
                             f"the tree), got drafting={drafting.value!r}")
        top = TREE_CANDIDATES[-1]
        n_max = max(k, min(top, path_count(k, drafter.config.draft_vocab_size, top)))
        check_tree(dataclasses.replace(c, tree_budget=n_max), drafting, k, drafter, acceptance)
    elif c.tree_budget is not None:
        if auto:
            raise ValueError("num_speculative_tokens='auto' takes chains only (tree_budget must be None, or 'auto' "
                             "for chains and trees)")
        check_tree(c, drafting, k, drafter, acceptance)
    return EngineSpec(num_speculative_tokens=k, drafting=drafting, max_new_tokens=int(max_new_tokens),
                      draft_sampling=c.draft_sampling, aux_layer_ids=aux, mask_token_id=int(mask_id),
                      implementation=c.implementation, acceptance=acceptance,
                      tree_budget=None if c.tree_budget is None or tree_auto else int(c.tree_budget),
                      tree_score=c.tree_score, state_k=k if auto else None, state_tree=n_max)


def check_tree(c: EngineConfig, drafting: Drafting, k: int, drafter, acceptance) -> None:
    """A tree budget's settings: an integer N >= K, drafting (parallel or sequential), argmax drafts (the tree's
    tokens), a draft vocabulary with N distinct paths of depth <= K (sequential: N nodes among those `grow_tree`
    generates), no replaced acceptance rule; else a ValueError naming them."""
    n = c.tree_budget
    if c.tree_score not in SCORES:
        raise ValueError(f"tree_score={c.tree_score!r}: expected one of {SCORES}")
    if not I.is_int(n) or n < 1:
        raise ValueError(f"tree_budget must be an integer >= 1 (draft tokens per tree), 'auto' or None, got {n!r}")
    if not drafting.speculative:
        raise ValueError(f"tree_budget needs drafting='parallel' or 'sequential' (a drafter), got "
                         f"drafting={drafting.value!r}")
    if n < k:
        raise ValueError(f"tree_budget={n} must be >= num_speculative_tokens={k} (the tree's depth)")
    if c.draft_sampling != "argmax":
        raise ValueError(f"tree_budget needs draft_sampling='argmax', got {c.draft_sampling!r}")
    if acceptance is not None:
        raise ValueError("tree_budget: a replaced acceptance rule (simulated acceptance) takes chains only")
    vd = drafter.config.draft_vocab_size
    if drafting.one_pass:
        if path_count(k, vd, n) < n:
            raise ValueError(f"tree_budget={n} exceeds the {path_count(k, vd, n)} paths of depth <= {k} over the "
                             f"draft vocabulary of {vd} tokens")
    elif candidate_count(beam_width(n, k, vd), k) < n:
        w = beam_width(n, k, vd)
        raise ValueError(f"tree_budget={n} exceeds the {candidate_count(w, k)} nodes a sequential tree of depth {k} "
                         f"generates over the draft vocabulary of {vd} tokens (frontier width {w})")


# ------------------------------------------------------------------------------------------ command-line flags

def number_flag(kind, low=None, high=None, low_open=False, high_open=False):
    """An argparse type: int / float within bounds (argparse names the flag on error)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got "
                                             f"{text!r}") from None
        if kind is float and v != v:
            raise argparse.ArgumentTypeError("NaN is not a value")
        if low is not None and (v < low or (low_open and v == low)):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and (v > high or (high_open and v == high)):
            raise argparse.ArgumentTypeError(f"{text} must be {'<' if high_open else '<='} {high}")
        return v
    parse.__name__ = kind.__name__
    return parse


_positive = number_flag(int, low=1)


def _budget(text):
    """--k, --tree-budget: a positive integer, or "auto" (a budget that follows the load)."""
    if text == "auto":
        return text
    try:
        return _positive(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or auto)") from None


_budget.__name__ = "K"


# field -> (flag, argparse keywords, help); the help's "(default ...)" is added from EngineConfig
FLAGS: dict[str, tuple[str, dict, str]] = {
    "drafting": ("--drafting", dict(choices=Drafting.names()),
                 "parallel (P-EAGLE), sequential (EAGLE-3) or none (plain decoding); default: the head's kind"),
    "num_speculative_tokens": ("--k", dict(type=_budget, metavar="K"),
                               "draft tokens per round, or auto (each device chunk picks 0..7 by measured round "
                               "times and acceptance); default: 7 parallel (at most the head's trained depth), "
                               "3 sequential"),
    "draft_sampling": ("--draft-sampling", dict(choices=DRAFT_SAMPLING),
                       "argmax drafts, or drafts sampled from the drafter's distribution"),
    "tree_budget": ("--tree-budget", dict(type=_budget, metavar="N"),
                    "verify a tree of N draft tokens (depth <= K) per round instead of a chain of K (argmax "
                    "drafts), or auto (each device chunk picks a chain of 0..7 or a tree of 8, 16 or 32 nodes; "
                    "parallel drafting); default: a chain"),
    "tree_score": ("--tree-score", dict(choices=SCORES),
                   "how a tree ranks paths: the product of the per-depth probabilities, or their minimum"),
    "temperature": ("--temperature", dict(type=number_flag(float, low=0.0), metavar="T"), "sampling temperature (0: "
                    "greedy)"),
    "top_k": ("--top-k", dict(type=number_flag(int, low=0), metavar="N"), "top-k sampling (0: off)"),
    "top_p": ("--top-p", dict(type=number_flag(float, low=0.0, high=1.0, low_open=True), metavar="P"),
              "nucleus sampling (1: off)"),
    "prefill": ("--prefill", dict(choices=I.PREFILL_LAYOUTS),
                "the target prefill's layout: prompts packed into one row, or one padded row each"),
    "rounds_per_step": ("--rounds-per-step", dict(type=_positive, metavar="N"),
                        "rounds per device chunk: requests join, text streams and stops apply between chunks"),
    "max_slots": ("--max-slots", dict(type=_positive, metavar="N"),
                  "requests decoded at once: the device batch (rounded up to a power of two)"),
    "max_len": ("--max-len", dict(type=_positive, metavar="N"),
                f"KV positions per request: prompt + new tokens + 2K (default {DEFAULT_MAX_LEN}, or the target's "
                "max_position_embeddings when smaller)"),
    "max_admit_rows": ("--max-admit-rows", dict(type=_positive, metavar="N"),
                       "requests prefilled by one admission program at most (larger admissions run as several)"),
    "implementation": ("--implementation", dict(choices=IMPLEMENTATIONS),
                       "kernels: xla (no Pallas kernel), pallas (every kernel) or auto"),
    "cache_dtype": ("--cache-dtype", dict(metavar="DTYPE"), "KV cache dtype: bfloat16, float16, float32; default: "
                    "the model's"),
}


def add_flags(parser, *fields: str):
    """Add the flags of these EngineConfig fields (`FLAGS`) to an argparse parser or group. A flag left out keeps
    the EngineConfig default (its dest is the field name, its parsed default None)."""
    defaults = EngineConfig()
    for name in fields:
        flag, kwargs, text = FLAGS[name]
        value = getattr(defaults, name)
        if value is not None and "default" not in text:
            text += f" (default {value})"
        parser.add_argument(flag, dest=name, default=None, help=text, **kwargs)


def add_mesh_flag(parser):
    """Add --tensor-parallel N (dest tensor_parallel, default 1): the target split over N devices."""
    parser.add_argument("--tensor-parallel", dest="tensor_parallel", type=_positive, default=1, metavar="N",
                        help="split the target over the first N devices (tensor parallel: attention by heads, MLP by "
                             "the intermediate dimension, MoE by experts, embedding and LM head by vocabulary; the "
                             "head replicated; default 1)")


def add_compilation_cache_flag(parser, why: str = ""):
    """Add --compilation-cache DIR (JAX's persistent compilation cache; `use_compilation_cache_flag`); why: a
    sentence appended to its help."""
    parser.add_argument("--compilation-cache", metavar="DIR",
                        help="keep compiled programs in DIR (JAX's persistent cache, created if missing): a later run "
                             "with the same models, shapes and settings loads them instead of compiling" + why)


def use_compilation_cache_flag(path, error=ValueError):
    """Apply --compilation-cache (None: nothing): a path that is not a directory raises `error` naming the flag."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"--compilation-cache {path}: exists and is not a directory")
    use_compilation_cache(path)


def mesh_from_flags(args):
    """The mesh of --tensor-parallel N (`add_mesh_flag`): 1 x N over the first N devices, or None for N = 1;
    ValueError naming the flag when fewer devices exist."""
    import jax

    from pjax.models.sharding import make_mesh
    n = getattr(args, "tensor_parallel", 1) or 1
    if n == 1:
        return None
    if n > jax.device_count():
        raise ValueError(f"--tensor-parallel {n}: only {jax.device_count()} device(s) are visible")
    return make_mesh(data=1, model=n, devices=jax.devices()[:n])


def config_from_flags(args, fields=tuple(FLAGS), **fixed) -> EngineConfig:
    """The EngineConfig of the parsed flags of `fields` (those not given keep their default); `fixed` fields win."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return EngineConfig(**{**given, **fixed})
