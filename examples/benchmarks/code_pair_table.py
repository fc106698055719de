"""The trained pair's speed table in one command: build the pair with `python -m examples.code_pair` (stage by stage; a
re-run continues), then run the table's `python -m pjax bench` invocations, most informative first, each into
OUT/NAME (bench.md, bench.json, plots) with its log beside it.

    python examples/benchmarks/code_pair_table.py --build /tmp/cpb --out bench/pair                 # all of it
    python examples/benchmarks/code_pair_table.py --build /tmp/cpb --out bench/pair --deadline-minutes 36
    python examples/benchmarks/code_pair_table.py --build /tmp/cpb --out bench/pair --dry-run       # the commands

On one H200 the build takes about 19 minutes and the benchmarks below about 20 more, most of it compiling (each
configuration builds its own programs; they are kept in OUT/.jax_cache for a re-run). `--deadline-minutes M` fits
the whole into a machine held for a limited time: every benchmark gets a `--time-budget` from what is left (its
last configurations are cut first) and one that would start with under a minute left is skipped and logged.
`--skip-build` benchmarks a pair already built in --build. OUT/table.log has the stage and run times.

At the end OUT/table.md sums the runs up (`summary`: per run, setting and concurrency, plain
decoding and the best K of each head, P-EAGLE's speedups over both) with a plot of those speedups
(OUT/speedups.png); `--summary` writes only that, from every OUT/*/bench.json.

`--gpus 0,1` spreads the work over a machine's GPUs: the two heads train at once, one per GPU, and each benchmark
runs whole on one GPU, the next in order starting on the first GPU free (each GPU keeps its own compilation cache,
OUT/.jax_cache-GPU). A benchmark's comparisons (its configurations, one after another) stay on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("corpus", "tokenizer", "tokens", "target", "regen", "peagle", "eagle3", "export")
HELD_OUT = "{pair}/prompts.jsonl"  # the build's held-out functions (signature + docstring -> body)
RUNS = (  # name, planned seconds (the share of a deadline it may take), bench arguments
    ("c8-64-heldout", 300, "--scheduling static --dataset {held_out} --num-prompts 128 --concurrency 64,32,8 "
                           "--k 3,5,7,1"),
    ("c1-tree", 300, "--scheduling static --dataset humaneval --concurrency 1 --k 7,5 --tree-budget 12,24"),
    ("c8-64-tree", 400, "--scheduling static --dataset humaneval --concurrency 8,64 --k 3 --tree-budget 6,12"),
    ("c1-tree-min", 300, "--scheduling static --dataset humaneval --concurrency 1 --k 7,5 --tree-budget 12,24 "
                         "--tree-score min"),
    ("c8-64-tree-min", 400, "--scheduling static --dataset humaneval --concurrency 8,64 --k 3 --tree-budget 6,12 "
                            "--tree-score min"),
    ("c1-128-auto", 500, "--scheduling static --dataset humaneval --drafting parallel,none --concurrency 1,8,32,64,128 "
                         "--k 7,3,auto"),
    ("c1-humaneval", 380, "--scheduling static --dataset humaneval --concurrency 1 --k 11,7,5,3,1,9"),
    ("c1-t1-sampled", 130, "--scheduling static --dataset humaneval --num-prompts 82 --concurrency 1 --temperature 1 "
                           "--draft-sampling sample --k 3,7"),
    ("c1-t1-argmax", 130, "--scheduling static --dataset humaneval --num-prompts 82 --concurrency 1 --temperature 1 "
                          "--draft-sampling argmax --k 3,7"),
    ("c8-64-humaneval", 250, "--scheduling static --dataset humaneval --concurrency 8,32,64 --k 3,5"),
    ("c64-continuous", 250, "--scheduling continuous --rounds-per-step 32 --dataset {held_out} --num-prompts 128 "
                            "--concurrency 64 --k 3,5"),
    ("c1-heldout", 150, "--scheduling static --dataset {held_out} --num-prompts 100 --concurrency 1 --k 7,5"),
    ("c1-2048", 90, "--scheduling static --dataset humaneval --num-prompts 4 --concurrency 1 --max-new-tokens 2048 "
                    "--ignore-eos --k 7"),
)
MARGIN_S = 40  # kept back at a deadline: writing the last results
MIN_RUN_S = 60  # a benchmark with less time than this left is skipped


def build_commands(build: Path, stages=STAGES) -> list[list[str]]:
    return [[sys.executable, "-m", "examples.code_pair", "--out", str(build), "--no-progress", "--stage", s]
            for s in stages]


def build_groups(gpus: int) -> list[tuple[str, ...]]:
    """The build's stages in order, grouped into what runs at once: with two GPUs or more, the two heads."""
    heads = ("peagle", "eagle3")
    groups = [(s,) for s in STAGES if gpus < 2 or s not in heads]
    if gpus >= 2:
        groups.insert(STAGES.index(heads[0]), heads)
    return groups


def bench_command(build: Path, out: Path, name: str, args: str, budget_s=None, cache: str = ".jax_cache") -> list[str]:
    pair = build / "pair"
    cmd = [sys.executable, "-m", "pjax", "bench", "--target", str(pair / "target"), "--head", str(pair / "peagle"),
           "--sequential-head", str(pair / "eagle3"), "--chat", "off", "--no-progress",
           "--compilation-cache", str(out / cache), "--out", str(out / name)]
    cmd += shlex.split(args.format(held_out=HELD_OUT.format(pair=pair)))
    return cmd + (["--time-budget", str(int(budget_s))] if budget_s is not None else [])


# ------------------------------------------------------------------------------------------- the summary table
def fmt2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def setting_of(r: dict) -> str:
    """What a row's comparisons hold fixed besides concurrency: dataset, temperature, draft sampling, scheduling."""
    drafts = f", {r['draft_sampling']} drafts" if r["temperature"] else ""
    return (f"{r['dataset']}, {r['max_new_tokens']} tokens, T = {r['temperature']:g}{drafts}, "
            f"{r['scheduling'].split()[0]}")


def summary(runs: dict[str, Sequence[dict]]) -> list[dict]:
    """Across benchmark runs (run name -> its bench.json rows), one line per run, setting and concurrency: plain
    decoding and the best K of each drafting mode, with P-EAGLE's (`parallel`) speedups over both. Ratios only
    within a run (one process, one GPU)."""
    from pjax.bench.report import MODES, best_per_mode, k_cell
    lines = []
    for run, rows in runs.items():
        for setting in dict.fromkeys(setting_of(r) for r in rows):
            measured = [r for r in rows if setting_of(r) == setting and r["output_tokens_per_s"] is not None]
            for c, best in sorted(best_per_mode(measured).items()):
                otps = {m: best[m]["output_tokens_per_s"] if m in best else None for m in MODES}
                par = otps["parallel"]
                lines.append(dict(run=run, setting=setting, concurrency=c,
                                  configurations=sum(r["concurrency"] == c for r in measured), **{
                    f"{m}_{f}": (best[m].get(f) if m in best else None) for m in ("sequential", "parallel")
                    for f in ("k", "tree_budget", "mean_acceptance_length")}, **{
                    f"{m}_budget": k_cell(best[m]) if m in best else None for m in ("sequential", "parallel")},
                    **{f"{m}_tokens_per_s": otps[m] for m in MODES},
                    parallel_vs_none=None if par is None or otps["none"] is None else par / otps["none"],
                    parallel_vs_sequential=(None if par is None or otps["sequential"] is None
                                            else par / otps["sequential"])))
    return lines


def summary_markdown(lines: Sequence[dict]) -> str:
    """The summary as a markdown table (the best budget of each mode: K, "K, tree N" or "auto (mean B)"; tokens/s and
    acceptance length)."""
    out = ["| run | setting | c | none tok/s | EAGLE-3 (sequential) best K: tok/s (AL) | P-EAGLE (parallel) best "
           "K: tok/s (AL) | P-EAGLE / none | P-EAGLE / EAGLE-3 |", "|---|---|---|---|---|---|---|---|"]
    for ln in lines:
        cell = {m: "-" if ln[f"{m}_tokens_per_s"] is None else
                f"K = {ln[f'{m}_budget']}: {ln[f'{m}_tokens_per_s']:,.1f} ({fmt2(ln[f'{m}_mean_acceptance_length'])})"
                for m in ("sequential", "parallel")}
        none = "-" if ln["none_tokens_per_s"] is None else f"{ln['none_tokens_per_s']:,.1f}"
        out.append(f"| {ln['run']} | {ln['setting']} | {ln['concurrency']} | {none} | {cell['sequential']} | "
                   f"{cell['parallel']} | {ratio(ln['parallel_vs_none'])} | {ratio(ln['parallel_vs_sequential'])} |")
    return "\n".join(out) + "\n"


def write_summary_plot(lines: Sequence[dict], path: Path) -> None:
    """P-EAGLE's speedup over plain decoding and over EAGLE-3 (best K each) vs concurrency, a line per setting (its
    points may come from several runs; each ratio is within one). Where runs share a setting and concurrency, the
    line goes through the one that measured the most configurations there, the others are markers."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 4.5))
    axes = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for key, ax, title in (("parallel_vs_none", axes[0], "P-EAGLE / no speculation"),
                           ("parallel_vs_sequential", axes[1], "P-EAGLE / EAGLE-3")):
        for i, label in enumerate(dict.fromkeys(ln["setting"] for ln in lines)):
            pts = [ln for ln in lines if ln["setting"] == label and ln[key] is not None]
            main = {}
            for p in pts:
                if p["configurations"] > main.get(p["concurrency"], {}).get("configurations", 0):
                    main[p["concurrency"]] = p
            if pts:
                cs = sorted(main)
                ax.plot(cs, [main[c][key] for c in cs], marker="o", color=f"C{i}", label=label)
                rest = [p for p in pts if main[p["concurrency"]] is not p]
                ax.plot([p["concurrency"] for p in rest], [p[key] for p in rest], "o", color=f"C{i}", alpha=0.5)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        cs = sorted({ln["concurrency"] for ln in lines})
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set(xlabel="concurrency (requests in flight)", ylabel="output tokens/s ratio (best K each)", title=title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")


def write_atomic(path: Path, write) -> None:
    """write(tmp) to a temporary file beside `path`, then renamed to `path`."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def write_summary(out: Path) -> bool:
    """OUT/table.md (and OUT/speedups.png where matplotlib is installed) from every OUT/*/bench.json, the table's
    runs first in their order; False when there is none."""
    from pjax.bench.report import plots_available
    found = {p.parent.name: json.loads(p.read_text()) for p in sorted(out.glob("*/bench.json"))}
    if not found:
        return False
    names = [n for n, _, _ in RUNS]
    lines = summary({n: found[n] for n in sorted(found, key=lambda n: (
        names.index(n) if n in names else len(names), n))})
    text = ["# The pair's table", "", "Each run's plain decoding and best K of each head, from OUT/RUN/bench.json "
            "(ratios within a run: one process, one GPU). AL: mean acceptance length.", "",
            summary_markdown(lines)]
    if plots_available():
        write_atomic(out / "speedups.png", lambda tmp: write_summary_plot(lines, tmp))
        text += ["![P-EAGLE's speedups vs concurrency](speedups.png)", ""]
    write_atomic(out / "table.md", lambda tmp: tmp.write_text("\n".join(text)))
    return True


def budget(planned_s: float, elapsed_s: float, deadline_s):
    """(run?, --time-budget or None): without a deadline every run is whole."""
    if deadline_s is None:
        return True, None
    left = deadline_s - elapsed_s - MARGIN_S
    return left >= MIN_RUN_S, min(planned_s, left)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, type=Path, help="the pair's build directory (python -m examples.code_pair)")
    ap.add_argument("--out", required=True, type=Path, help="directory for the benchmarks (one folder per run)")
    ap.add_argument("--deadline-minutes", type=float, default=None, help="finish within this many minutes")
    ap.add_argument("--skip-build", action="store_true", help="the pair in --build is complete: benchmark only")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated runs, in the order to run them, of {', '.join(n for n, _, _ in RUNS)}")
    ap.add_argument("--gpus", default=None,
                    help="comma-separated GPU indices to spread the work over (the heads train at once; each "
                         "benchmark runs on one GPU); default: the processes see every GPU and use the first")
    ap.add_argument("--summary", action="store_true", help="only write OUT/table.md from the runs in OUT")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    a = ap.parse_args(argv)
    names = [n for n, _, _ in RUNS]
    only = names if a.only is None else a.only.split(",")
    if set(only) - set(names):
        ap.error(f"--only {a.only!r}: expected names of {', '.join(names)}")
    runs = [next(r for r in RUNS if r[0] == n) for n in only]
    deadline = None if a.deadline_minutes is None else 60 * a.deadline_minutes
    if a.dry_run:
        for cmd in ([] if a.skip_build else build_commands(a.build)) + [
                bench_command(a.build, a.out, n, args) for n, _, args in runs]:
            print(shlex.join(cmd))
        return 0
    if a.summary:
        if not write_summary(a.out):
            ap.error(f"--summary: no run in {a.out} (expected {a.out}/RUN/bench.json)")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    log_lock = threading.Lock()

    def log(line: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {line}"
        with log_lock:
            print(line, flush=True)
            with open(a.out / "table.log", "a") as f:
                f.write(line + "\n")

    def run(cmd, log_path: Path, gpu) -> int:
        env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        with open(log_path, "a") as f:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode

    def stage(name: str, log_path: Path, gpu, ok: list) -> None:
        t = time.monotonic()
        rc = run(build_commands(a.build, (name,))[0], log_path, gpu)
        log(f"stage {name} failed: see {log_path}" if rc else
            f"stage {name} took {time.monotonic() - t:.0f} s (total {time.monotonic() - t0:.0f} s)"
            + ("" if gpu is None else f" on GPU {gpu}"))
        ok.append(not rc)

    gpus = [None] if a.gpus is None else a.gpus.split(",")
    if not a.skip_build:
        for group in build_groups(len(gpus)):  # one stage: the build's log; two at once: one log each
            ok = []
            threads = [threading.Thread(target=stage, args=(
                name, a.out / ("build.log" if len(group) == 1 else f"build-{name}.log"), gpu, ok))
                for name, gpu in zip(group, gpus)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if not all(ok):
                return 1
    queue, qlock = list(runs), threading.Lock()

    def worker(gpu) -> None:
        cache = ".jax_cache" if a.gpus is None else f".jax_cache-{gpu}"
        while True:
            with qlock:
                if not queue:
                    return
                name, planned, args = queue.pop(0)
                go, time_budget = budget(planned, time.monotonic() - t0, deadline)
            if not go:
                log(f"bench {name} skipped: the deadline is too close")
                continue
            t = time.monotonic()
            rc = run(bench_command(a.build, a.out, name, args, time_budget, cache), a.out / f"{name}.log", gpu)
            log(f"bench {name} {'failed (see its log)' if rc else 'done'} in {time.monotonic() - t:.0f} s"
                + ("" if gpu is None else f" on GPU {gpu}"))

    workers = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if write_summary(a.out):
        log(f"summary: {a.out / 'table.md'}")
    log("table done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
