"""The command line: every `Recipe` field is a flag (--target-layers 24, --peagle-max-anchors none, --no-remat ...)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing
from pathlib import Path

import examples.code_pair as package
from examples.code_pair.build import build
from examples.code_pair.recipe import EXIT_INCOMPLETE, FULL, STAGES, TINY, Incomplete, Recipe, RecipeError


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
    p = argparse.ArgumentParser(prog="python -m examples.code_pair", description=package.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
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
