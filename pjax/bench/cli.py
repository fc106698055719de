"""`python -m pjax bench`: speculative decoding on your target, head, prompts and concurrency, swept over drafting
modes and K: output tokens/s, TPOT, TTFT, acceptance length and per-position acceptance (as `vllm bench serve`
defines them), and exactness against plain decoding at temperature 0.

    python -m pjax bench --target DIR --head DIR --dataset mt-bench --drafting parallel,sequential,none \\
        --k 3,7,11 --concurrency 1,8,64 --max-new-tokens 256 --out DIR

--tree-budget 8,16,32 adds, for each speculative mode at each K, a run that verifies a tree of N draft tokens per
round for each N >= K (parallel: the N most probable paths of the head's per-position distributions; sequential:
EAGLE-2's dynamic tree, grown depth by depth).

Targets: a Hugging Face or pjax-native directory, or `random:llama3.1-8b|gpt-oss-20b|qwen3-30b-a3b` (random
weights of that geometry: time large shapes with --simulate-acceptance; `random:gpt-oss-20b-mxfp4|gpt-oss-120b|
qwen3-30b-a3b-fp8` keep their experts packed as the checkpoints ship them). Heads: a P-EAGLE / EAGLE-3 directory or
`random:N` (N layers shaped for the target). Datasets: mt-bench, spec-bench, humaneval, or a .jsonl file with
"prompt" or "messages" per line. Outputs in --out: bench.json, requests.jsonl, bench.md, PNG plots.

Timing large shapes with random weights (acceptance is then ~0, so it is simulated):

    python -m pjax bench --target random:llama3.1-8b --head random:4 --sequential-head random:1 \\
        --simulate-acceptance 0.75,0.67,0.64,0.64,0.64,0.64,0.64,0.64,0.64,0.64,0.64 --k 3,7,11 \\
        --concurrency 1,8,64 --num-prompts 4,16,64 --prompt-len 128 --max-new-tokens 256 --out DIR

These rates are conditional (draft i accepted given drafts 1..i-1 were): those of a trained P-EAGLE head
(RedHatAI/Qwen3-8B-speculator.peagle at K = 7: 74.9/49.9/31.9/20.4/13.1/8.5/5.5 % per position, i.e. 0.75, 0.67,
then ~0.64 each), continued at 0.64 up to K = 11. Both modes get the same rates, so the table isolates the cost
of drafting (one pass of a 4-layer P-EAGLE head against K passes of a 1-layer EAGLE-3 head); trained EAGLE-3 heads
accept less at large K, so the simulated P-EAGLE-over-EAGLE-3 speedups are conservative. Configurations run in the
order of --concurrency (none first, then sequential and parallel per K): with --time-budget the ones cut are the
last.

Several devices: --tensor-parallel N splits the target over the first N devices (tensor / expert parallel,
`pjax.models.sharding`; the head replicated), a random target generated in place on them.

Scheduling: --scheduling continuous (default) keeps c requests in flight in the serving engine, the next joining as
one finishes (vLLM's --max-concurrency c); --scheduling static decodes c requests as one batch, the next c when all
have finished.

Exit status: 0 done; 2 bad input (one line `error: ...` naming the flag or file; nothing written to --out);
130 interrupted; an unexpected failure prints its traceback (status 1). After each configuration --out holds the
results so far (bench.md says "Partial output" until the run completes), so an interrupted or killed run keeps
what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from typing import Optional

import jax.numpy as jnp

from pjax._io import OutputError, prepare_output
from pjax.bench.backend import SCHEDULING, BatchBackend, EngineBackend
from pjax.bench.datasets import DATASET_NAMES, load_dataset
from pjax.bench.errors import BenchError
from pjax.bench.exactness import NEAR_TIE_EPS, next_token_logits
from pjax.bench.models import RANDOM_SHAPES, RANDOM_TARGETS, geometry, parse_random, random_head, random_target
from pjax.bench.report import PLOTS_MISSING, plots_available, write_outputs
from pjax.bench.runner import BenchSettings, build_prompt_set, environment, run_bench
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.heads import load_drafter
from pjax.checkpoint.target import load_target
from pjax.command import run_command
from pjax.config import ConfigError
from pjax.bench.simulate import SimulatedAcceptance
from pjax.decode import EngineConfig, make_spec
from pjax.decode.drafting import resolve
from pjax.decode.settings import (add_compilation_cache_flag, add_flags, add_mesh_flag, config_from_flags,
                                  mesh_from_flags, use_compilation_cache_flag)
from pjax.models.families import config_from_hf
from pjax.dtypes import parse_dtype
from pjax.decode.engine import STOP_WIDTH, mesh_config

CHAT = ("auto", "on", "off")
SETTINGS_FLAGS = ("cache_dtype", "implementation", "prefill", "rounds_per_step", "max_admit_rows", "draft_sampling",
                  "tree_score")


def _ints(flag: str, auto: bool = False):
    """Comma-separated integers (and "auto" where `auto`: kept as the string)."""
    def parse(text: str) -> tuple:
        try:
            return tuple(x.strip() if auto and x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected comma-separated integers"
                                             + (" or auto" if auto else "")) from None
    return parse


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None


def build_parser(prog: str = "python -m pjax bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    m = p.add_argument_group("models")
    m.add_argument("--target", required=True,
                   help="target directory (Hugging Face or pjax-native), or random:SHAPE with SHAPE one of "
                        f"{', '.join(RANDOM_TARGETS)} (random weights)")
    m.add_argument("--head", default=None,
                   help="drafter head directory (P-EAGLE / EAGLE-3, either layout) or random:N (a random head of N "
                        "layers shaped for the target); needed for parallel / sequential drafting")
    m.add_argument("--sequential-head", default=None,
                   help="head for sequential (EAGLE-3) drafting when it differs from --head (e.g. a 1-layer EAGLE-3 "
                        "head against a 4-layer P-EAGLE one); random:N makes an EAGLE-3 head")
    m.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the target directory); with a random target it gives the "
                        "prompts' token lengths")
    m.add_argument("--dtype", default="bf16", help="parameter / compute dtype: bf16 (default), f32, f16")
    m.add_argument("--no-finite-check", action="store_true",
                   help="accept NaN / inf weights (by default every floating tensor is checked, on device)")
    add_flags(m, "cache_dtype", "implementation", "prefill")  # (--drafting, --k, --temperature: the sweep's own)
    add_mesh_flag(m)
    d = p.add_argument_group("prompts")
    d.add_argument("--dataset", action="append", default=None, metavar="NAME_OR_FILE",
                   help=f"{', '.join(DATASET_NAMES)}, or a .jsonl file with 'prompt' or 'messages' per line; "
                        "comma-separated or repeated for several (default: mt-bench)")
    d.add_argument("--num-prompts", type=_ints("--num-prompts"), default=None,
                   help="prompts per configuration: one count, or one per concurrency (default: every prompt); an "
                        "even spread over the dataset's categories")
    d.add_argument("--chat", choices=CHAT, default="auto",
                   help="apply the tokenizer's chat template: auto (when it has one; default), on, off")
    d.add_argument("--prompt-len", type=int, default=None,
                   help="random targets: prompts of this many random token ids (default: the dataset's token "
                        "lengths under --tokenizer)")
    s = p.add_argument_group("sweep")
    s.add_argument("--drafting", default="parallel,sequential,none",
                   help="comma-separated modes: parallel (P-EAGLE), sequential (EAGLE-3), none (plain decoding; "
                        "the reference of speedups and exactness); default all three")
    s.add_argument("--k", type=_ints("--k", auto=True), default=(3, 7, 11),
                   help="drafts per round, comma-separated (default 3,7,11); auto: also each speculative mode with "
                        "a budget that follows the load (K from 0 to 7 chosen per device chunk)")
    s.add_argument("--tree-budget", type=_ints("--tree-budget"), default=(), metavar="N1,N2",
                   help="each speculative mode also runs, at each K, a tree of N draft tokens per round for each "
                        "N >= K, comma-separated (default: chains only)")
    s.add_argument("--concurrency", type=_ints("--concurrency"), default=(1,),
                   help="requests in flight, comma-separated (default 1)")
    s.add_argument("--scheduling", choices=SCHEDULING, default="continuous",
                   help="continuous (default): c requests in flight in the serving engine, the next joining as one "
                        "finishes (vLLM's --max-concurrency); static: c requests decoded as one batch, the next c "
                        "when all have finished")
    add_flags(s, "rounds_per_step", "max_admit_rows")
    s.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per request at most (default 256)")
    s.add_argument("--ignore-eos", action="store_true", help="every request runs --max-new-tokens tokens")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy, "
                                                                  "exactness checked)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (prompt i: seed + i)")
    add_flags(s, "draft_sampling", "tree_score")
    s.add_argument("--simulate-acceptance", type=_floats, default=None, metavar="P1,...,PK",
                   help="simulated verdicts for timing random weights: draft i accepted with probability p_i (the "
                        "chain stops at the first rejection); at least max(--k) values, the first K used at K")
    add_compilation_cache_flag(s)
    s.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start a configuration only while the time since start plus the longest configuration "
                        "so far fits in SECONDS (the rest are listed as not run)")
    o = p.add_argument_group("output")
    o.add_argument("--out", required=True, help="output directory: a new path, or with --force an empty directory "
                                                 "or an earlier pjax bench output")
    o.add_argument("--force", action="store_true",
                   help="replace --out when it is an earlier pjax bench output (anything else is refused)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _settings(args) -> BenchSettings:
    """The sweep as given (EOS ids are added once the tokenizer is known)."""
    drafting = tuple(x.strip() for x in args.drafting.split(",") if x.strip())
    return BenchSettings(drafting=drafting, ks=tuple(k for k in args.k if k != "auto"), auto="auto" in args.k,
                         tree_budgets=tuple(args.tree_budget),
                         concurrency=tuple(args.concurrency),
                         num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed,
                         simulate_acceptance=args.simulate_acceptance, time_budget_s=args.time_budget).validate()


def _dtype(value: Optional[str], flag: str):
    if value is None:
        return None
    try:
        return parse_dtype(value, what=flag)
    except ValueError as e:
        raise BenchError(str(e)) from None


def _tokenizer(args, random_target_: bool):
    """The tokenizer, or None for a random target without --tokenizer (then --prompt-len is needed)."""
    path = args.tokenizer or (None if random_target_ else args.target)
    if path is None:
        if args.prompt_len is None:
            raise BenchError(f"--target {args.target}: a random target needs --prompt-len N (random prompts of N "
                             "tokens) or --tokenizer DIR (random prompts of the dataset's token lengths)")
        return None
    flag = "--tokenizer" if args.tokenizer else "--target"
    from pjax.text import load_tokenizer  # needs the `tokenizers` package (the text / bench extras)
    try:
        tok = load_tokenizer(path)
    except (ValueError, OSError) as e:
        hint = "" if args.tokenizer else "; pass --tokenizer DIR"
        raise BenchError(f"{flag} {path}: no usable tokenizer ({' '.join(str(e).split())}){hint}") from None
    if args.chat == "on" and not tok.has_chat_template:
        raise BenchError(f"--chat on: the tokenizer of {path} has no chat template")
    return tok


def _head(spec: str, flag: str, target, dtype, *, parallel: bool, shape: Optional[str], check_finite: bool = True):
    n = parse_random(spec, flag)
    if n is not None:
        return random_head(target, n, parallel=parallel, dtype=dtype, shape=shape, flag=flag)
    try:
        return load_drafter(spec, dtype, target=target, check_finite=check_finite)
    except (CheckpointError, ConfigError) as e:
        raise BenchError(f"{flag}: {e}") from None


def _heads(args, settings: BenchSettings, target, dtype, shape: Optional[str]) -> dict:
    """The head of each speculative mode (sequential: --sequential-head when given, whose random:N is an EAGLE-3
    head; else --head), every (mode, K) checked against the engine's rules before anything runs."""
    heads, loaded = {}, {}
    for mode in settings.speculative:
        own = mode == "sequential" and args.sequential_head is not None
        flag, spec = ("--sequential-head", args.sequential_head) if own else ("--head", args.head)
        if spec is None:
            raise BenchError(f"--drafting {mode} needs --head DIR or --head random:N (or drop {mode} from "
                             "--drafting)")
        if (spec, own) not in loaded:
            loaded[(spec, own)] = _head(spec, flag, target, dtype, parallel=not own, shape=shape,
                                        check_finite=not args.no_finite_check)
        heads[mode] = loaded[(spec, own)]
        for k in settings.ks:
            trees = [n for n in settings.tree_budgets if n >= k]
            for n in [None] + trees:
                try:
                    sim = settings.simulated(k)
                    make_spec(target, heads[mode], EngineConfig(num_speculative_tokens=k, drafting=mode,
                                                                tree_budget=n),
                              max_new_tokens=settings.max_new_tokens,
                              acceptance=None if sim is None else SimulatedAcceptance(sim))
                except (ValueError, TypeError) as e:
                    tree = "" if n is None else f" --tree-budget {n}"
                    raise BenchError(f"{flag} {spec} with --drafting {mode} --k {k}{tree}: {e}") from None
        k_max = resolve(heads[mode], mode, "auto")[1]
        sim = settings.simulated("auto")
        if settings.auto and sim is not None and len(sim) < k_max:
            raise BenchError(f"--simulate-acceptance gives {len(sim)} values but --k auto with --drafting {mode} "
                             f"drafts up to {k_max}: give one probability per draft position up to {k_max}")
    return heads


def _prompt_sets(args, settings: BenchSettings, datasets, tok, shape: Optional[str]) -> tuple[list, bool]:
    """(requests for every dataset, whether the chat template was applied): the tokenizer's ids (chat template per
    --chat), or for a random target random ids of --prompt-len or of the rendered lengths."""
    chat = tok is not None and (args.chat == "on" or (args.chat == "auto" and tok.has_chat_template))
    if shape is not None:
        how = (f"random ids, {args.prompt_len} per prompt" if args.prompt_len else
               f"random ids of the prompts' token lengths under {args.tokenizer}"
               + (" with the chat template" if chat else ""))
    else:
        how = "the tokenizer" + (" with the chat template" if chat else " (no chat template)")

    def render(content):
        try:
            return tok.render(content, chat=chat)
        except (ValueError, TypeError) as e:
            raise BenchError(f"rendering a prompt with the tokenizer of {args.tokenizer or args.target} failed: "
                             f"{e}") from None
    vocab = config_from_hf(RANDOM_SHAPES[geometry(shape)]).vocab_size if shape is not None else None
    count = None if settings.num_prompts is None else max(settings.num_prompts)
    return [build_prompt_set(ds, count, render=render if tok is not None else None, random_vocab=vocab,
                             prompt_len=args.prompt_len, seed=settings.seed, how=how) for ds in datasets], chat


def _load_target(args, shape: Optional[str], dtype, sets, mesh=None):
    if shape is not None:
        return random_target(shape, dtype, mesh=mesh)
    try:
        target = load_target(args.target, dtype, check_finite=not args.no_finite_check, mesh=mesh)
    except (CheckpointError, ConfigError) as e:
        raise BenchError(f"--target: {e}") from None
    vocab = target.config.vocab_size
    for ps in sets:
        top = max(max(r.tokens) for r in ps.requests)
        if top >= vocab:
            raise BenchError(f"--tokenizer {args.tokenizer or args.target}: {ps.dataset.name} renders to token id "
                             f"{top}, outside the target's vocabulary [0, {vocab})")
    return target


def _header(args, settings: BenchSettings, target, meta: dict, cache_dtype, argv) -> dict:
    """bench.md's description of the run."""
    cfg = target.config
    eos = settings.eos_token_ids
    return {
        "target": f"`{args.target}` ({cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
                  f"{cfg.vocab_size}{', random weights' if args.target.startswith('random:') else ''})",
        "heads": "; ".join(f"{m}: `{h}`" for m, h in meta["heads"].items()) or "-",
        "dtype": f"{meta['dtype']} (KV cache: {cache_dtype.name if cache_dtype is not None else 'the same'}), "
                 f"kernels: {meta['implementation']}"
                 + (f", tensor parallel over {meta['tensor_parallel']} devices" if meta["tensor_parallel"] > 1 else ""),
        "hardware": meta["hardware"],
        "software": f"JAX {meta['jax_version']}, jaxlib {meta['jaxlib_version']}, pjax {meta['pjax_version']}, "
                    f"Python {meta['python_version']}",
        "date": meta["date"],
        "settings": f"max_new_tokens {settings.max_new_tokens}"
                    + (", EOS ignored" if not eos else f", stops at EOS {list(eos)}")
                    + f", temperature {settings.temperature}"
                    + (f" ({meta['draft_sampling']} drafts)" if settings.temperature > 0 else "")
                    + f", seed {settings.seed}, prefill {meta['prefill']}",
        "exactness": f"temperature 0: each speculative output vs `none`'s at the same concurrency; near-tie "
                     f"threshold {NEAR_TIE_EPS} x eps({meta['dtype']}) x max(1, abs(top logit))",
        "timing": "compilation excluded: every configuration compiles and warms up before it is timed; output "
                  "tok/s = output tokens / wall time of the configuration's run",
        "command": f"`{shlex.join(['python', '-m', 'pjax', 'bench'] + list(argv))}`",
    }


def run(args, argv) -> int:
    t_start = time.perf_counter()
    settings = _settings(args)
    dtype = _dtype(args.dtype, "--dtype")
    cache_dtype = _dtype(args.cache_dtype, "--cache-dtype")
    if args.prompt_len is not None and args.prompt_len < 1:
        raise BenchError(f"--prompt-len {args.prompt_len}: must be >= 1")
    use_compilation_cache_flag(args.compilation_cache, BenchError)
    shape = parse_random(args.target, "--target")
    if shape is not None and geometry(shape) not in RANDOM_SHAPES:
        raise BenchError(f"--target {args.target}: unknown shape (expected one of "
                         f"{', '.join('random:' + s for s in RANDOM_TARGETS)})")
    if shape is None and args.prompt_len is not None:
        raise BenchError("--prompt-len applies to random targets only (a real target's prompts are the dataset's)")
    names = [n.strip() for value in (args.dataset or ["mt-bench"]) for n in value.split(",") if n.strip()]
    if not names:
        raise BenchError("--dataset: give a dataset name or file")
    local = [x for x in (args.target, args.head, args.sequential_head, args.tokenizer) + tuple(names)
             if x is not None and not x.startswith("random:") and x not in DATASET_NAMES]
    prepare_output(args.out, force=args.force, kind="bench", sources=local)  # refuse before any work
    datasets = [load_dataset(n) for n in names]
    tok = _tokenizer(args, shape is not None)
    sets, chat = _prompt_sets(args, settings, datasets, tok, shape)
    if not (args.ignore_eos or tok is None or shape is not None):
        settings = dataclasses.replace(settings, eos_token_ids=tuple(tok.eos_token_ids))
    if len(settings.eos_token_ids) > STOP_WIDTH:
        raise BenchError(f"the tokenizer has {len(settings.eos_token_ids)} EOS ids, the engine takes {STOP_WIDTH} at "
                         "most (use --ignore-eos)")

    try:
        mesh = mesh_from_flags(args)
    except ValueError as e:
        raise BenchError(str(e)) from None
    target = _load_target(args, shape, dtype, sets, mesh)
    heads = _heads(args, settings, target, dtype, shape)
    config = config_from_flags(args, SETTINGS_FLAGS)
    if mesh is not None:
        try:
            config = mesh_config(config, mesh)
        except ValueError as e:
            raise BenchError(f"--implementation with --tensor-parallel: {e}") from None
    meta = {"target": args.target,
            "heads": {m: (args.sequential_head if m == "sequential" and args.sequential_head else args.head)
                      for m in settings.speculative},
            "dtype": jnp.dtype(dtype).name, "implementation": config.implementation, "prefill": config.prefill,
            "draft_sampling": config.draft_sampling, "tensor_parallel": args.tensor_parallel,
            "chat_template": chat, "seed": settings.seed, "near_tie_eps": NEAR_TIE_EPS,
            **environment()}
    backend = (EngineBackend if args.scheduling == "continuous" else BatchBackend)(target, heads, config, mesh)
    from tqdm.auto import tqdm
    header = _header(args, settings, target, meta, cache_dtype, argv)
    written = False

    def write_partial(partial) -> None:  # after each configuration: a run stopped from outside keeps its rows
        nonlocal written
        write_outputs(args.out, partial, header, force=args.force or written, sources=local, plots=False)
        written = True

    result = run_bench(backend, sets, settings, meta=meta,
                       next_logits=lambda ids: next_token_logits(target, ids, config.implementation),
                       compute_dtype=dtype, progress=not args.no_progress, t_start=t_start,
                       log=lambda msg: tqdm.write(msg, file=sys.stderr), on_partial=write_partial)

    out = write_outputs(args.out, result, header, force=args.force or written, sources=local)
    print(f"wrote {out}: bench.json, requests.jsonl, bench.md"
          + ("" if plots_available() else f" ({PLOTS_MISSING})"))
    for r in result.rows:
        print(f"  {r['dataset']} {r['drafting']}" + (f" K={r['k']}" if r["k"] else "")
              + (f" tree {r['tree_budget']}" if r["tree_budget"] else "")
              + f" c={r['concurrency']}: {r['output_tokens_per_s']:.1f} output tok/s"
              + (f", AL {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "")
              + (f", exact {r['exact_matches']}/{r['num_prompts']}" if r["exact_matches"] is not None else ""))
    if result.skipped:
        print(f"  {len(result.skipped)} configuration(s) not run (time budget): see bench.md")
    return 0


def main(argv=None, prog: str = "python -m pjax bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    return run_command(lambda: run(args, argv), user_errors=(BenchError, CheckpointError, ConfigError, OutputError),
                       interrupted="interrupted (the configurations that finished are in --out)")


if __name__ == "__main__":
    sys.exit(main())
