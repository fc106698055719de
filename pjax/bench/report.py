"""The benchmark's outputs: `bench.json` (one row per configuration), `requests.jsonl` (one line per request),
`bench.md` (a table per dataset with speedups vs `none` and vs the best sequential K, acceptance by category,
mismatches), and PNG plots (matplotlib, the `bench` extra: without it the plots are skipped and bench.md says so).
Everything is written into a temporary directory and installed as `--out` in one rename (`write_output_dir`).
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

from pjax._io import write_json, write_output_dir
from pjax.bench.runner import BenchResult

__all__ = ["PLOTS_MISSING", "k_cell", "markdown", "plots_available", "write_outputs", "write_plots"]

PLOTS_MISSING = 'plots skipped: matplotlib is not installed (pip install "pjax[bench]")'
MODES = ("none", "sequential", "parallel")
COLORS = {"none": "black", "sequential": "tab:blue", "parallel": "tab:red"}


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "dataset"


def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _order(rows: Iterable[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["concurrency"], MODES.index(r["drafting"]), r["k"] == "auto",
                                       0 if r["k"] == "auto" else r["k"], r.get("tree_budget") or 0))


def k_cell(r: dict) -> str:
    """A row's K cell: "K", "K, tree N" (a tree of N draft tokens), "auto (mean B)" (a budget that follows the
    load: B drafts verified per round on average), "-" without drafting."""
    if not r["k"]:
        return "-"
    if r["k"] == "auto":
        return f"auto (mean {_f(r.get('mean_budget'), 1)})"
    return f"{r['k']}" + (f", tree {r['tree_budget']}" if r.get("tree_budget") else "")


def _mode(r: dict) -> str:
    """A row's line in the plots: its drafting, "parallel tree N" for a tree of N, "parallel auto"."""
    return r["drafting"] + (f" tree {r['tree_budget']}" if r.get("tree_budget") else "") + \
        (" auto" if r["k"] == "auto" else "")


def _shade(r: dict, rows: Sequence[dict]) -> float:
    """A line's opacity: larger K darker ("auto" as the largest)."""
    top = max([x["k"] for x in rows if x["k"] != "auto" and x["k"]] or [1])
    return 0.35 + 0.65 * min(1.0, (top if r["k"] == "auto" else r["k"]) / top)


def best_per_mode(rows: Iterable[dict]) -> dict[int, dict[str, dict]]:
    """Per concurrency: drafting mode -> its fastest row (the best K of each mode, the best of its chains and trees;
    `none` has one)."""
    best: dict[int, dict[str, dict]] = {}
    for r in rows:
        if r["output_tokens_per_s"] is None:
            continue
        at = best.setdefault(r["concurrency"], {})
        if r["output_tokens_per_s"] > at.get(r["drafting"], {}).get("output_tokens_per_s", -1.0):
            at[r["drafting"]] = r
    return best


def _speedups(rows: Sequence[dict]) -> tuple[dict, dict]:
    """Per concurrency: OTPS of `none`, and (OTPS, K cell) of the best sequential K (chain or tree)."""
    best = best_per_mode(rows)
    none = {c: m["none"]["output_tokens_per_s"] for c, m in best.items() if "none" in m}
    seq = {c: (m["sequential"]["output_tokens_per_s"], k_cell(m["sequential"])) for c, m in best.items()
           if "sequential" in m}
    return none, seq


def _dataset_section(name: str, rows: list[dict], plots: list[str]) -> list[str]:
    rows = _order(rows)
    first = rows[0]
    sim = " (simulated acceptance)" if any(r["simulated"] for r in rows) else ""
    counts = sorted({r["num_prompts"] for r in rows})
    lines = [f"## {name}{sim}", "",
             f"{'/'.join(map(str, counts))} prompts from {first['dataset_source']}"
             + (f"; token ids: {first['prompts']}." if first["prompts"] else "."), ""]
    none, best = _speedups(rows)
    lines += ["| drafting | K | concurrency | prompts | output tok/s | vs none | vs best sequential | TPOT median ms "
              "| TPOT p99 ms | TTFT median ms | E2E p99 ms | acceptance length | per request p10-p90 "
              "| acceptance per position | exact |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, otps = r["concurrency"], r["output_tokens_per_s"]
        vs_none = otps / none[c] if otps is not None and c in none else None
        vs_seq = otps / best[c][0] if otps is not None and c in best else None
        rates = "/".join(f"{x:.2f}" for x in r["acceptance_rates"]) if r["acceptance_rates"] else "-"
        spread = (f"{r['acceptance_length_p10']:.2f}-{r['acceptance_length_p90']:.2f}"
                  if r.get("acceptance_length_p10") is not None else "-")
        if r["exact_matches"] is not None:
            exact = f"{r['exact_matches']}/{r['num_prompts']}"
            if r["mismatches"]:
                exact += f" ({r['mismatches']} differ: {r['near_tie_mismatches']} near-tie)"
        else:
            exact = "ref" if r["drafting"] == "none" else "-"
        lines.append(f"| {r['drafting']} | {k_cell(r)} | {c} | {r['num_prompts']} | {_f(otps)} | "
                     f"{_f(vs_none, 2)} | {_f(vs_seq, 2)} | {_f(r['tpot_ms_median'], 2)} | "
                     f"{_f(r['tpot_ms_p99'], 2)} | {_f(r['ttft_ms_median'], 2)} | {_f(r['e2el_ms_p99'], 1)} | "
                     f"{_f(r['mean_acceptance_length'], 2)} | {spread} | {rates} | {exact} |")
    lines.append("")
    notes = ["*vs none*: output tokens/s over `none` at the same concurrency; *vs best sequential*: over the "
             "fastest sequential K at the same concurrency"]
    if best:
        notes.append("best sequential K: " + ", ".join(f"c={c}: K={k}" for c, (_, k) in sorted(best.items())))
    lines += ["; ".join(notes) + ". TPOT = (end-to-end - TTFT) / (output tokens - 1) per request; acceptance "
              "length = 1 + accepted / drafts; acceptance per position = rounds whose draft i was accepted / drafts "
              "(as `vllm bench serve`); per request p10-p90: the spread of each request's own acceptance length; "
              "E2E p99: the slowest requests' end-to-end latency (a static batch lasts as long as its slowest "
              "row).", ""]
    spec = [r for r in rows if r["drafting"] != "none" and r.get("categories")]
    if spec:
        c0 = min(r["concurrency"] for r in spec)
        cats = list(spec[0]["categories"])
        lines += [f"### {name}: acceptance length by category (concurrency {c0})", "",
                  "| drafting | K | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats)]
        for r in spec:
            if r["concurrency"] == c0:
                cells = " | ".join(_f(r["categories"].get(cat, {}).get("mean_acceptance_length"), 2) for cat in cats)
                lines.append(f"| {r['drafting']} | {k_cell(r)} | {cells} |")
        lines.append("")
    bad = [(r, m) for r in rows for m in r.get("mismatch_details", [])]
    if bad:
        lines += [f"### {name}: outputs that differ from `none`", "",
                  "First differing position of each; near-tie = both tokens within the threshold of the target's "
                  "top logit on the shared prefix (rounding can flip them; see `pjax.bench.exactness`).", "",
                  "| drafting | K | concurrency | prompt | position | token / none's | top-2 margin | gap | threshold "
                  "| near-tie |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r, m in bad:
            toks = f"{m['token']} / {m['reference_token']}"
            tie = "-" if m["near_tie"] is None else ("yes" if m["near_tie"] else "**no**")
            lines.append(f"| {r['drafting']} | {k_cell(r)} | {r['concurrency']} | {m['prompt_id']} | {m['position']} "
                         f"| {toks} | {_f(m['margin'], 4)} | {_f(m['gap'], 4)} | {_f(m['threshold'], 4)} | {tie} |")
        lines.append("")
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    return lines


def markdown(result: BenchResult, header: dict, plots: Optional[dict[str, list[str]]]) -> str:
    """bench.md: the run's description (`header`: label -> value), one section per dataset, the skipped
    configurations. plots: dataset -> PNG file names, or None when matplotlib is missing."""
    rows = result.rows
    sim = any(r["simulated"] for r in rows)
    lines = [f"# pjax bench{' (simulated acceptance)' if sim else ''}", ""]
    if sim:
        p = max((r["simulate_acceptance"] for r in rows if r["simulated"]), key=len)
        lines += [f"**Simulated acceptance**: draft i is accepted with probability p_i, p_1..p_{len(p)} = "
                  f"{', '.join(map(str, p))} (the first K at K; the chain stops at the first rejection, so these "
                  "are conditional rates). Throughput and latency are those of "
                  "the real computation at these acceptance rates; the outputs are not the target's and are not "
                  "checked for exactness.", ""]
    if result.partial:
        lines += [f"**Partial output**: {len(rows)} of {result.planned} configurations so far, written while the "
                  "benchmark ran; the run either goes on (and replaces this output when it finishes) or was "
                  "stopped.", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in header.items()]
    lines += [f"| scheduling | {result.scheduling} |", ""]
    if not rows:
        lines += ["No configuration ran.", ""]
    for name in dict.fromkeys(r["dataset"] for r in rows):
        lines += _dataset_section(name, [r for r in rows if r["dataset"] == name], (plots or {}).get(name, []))
    if plots is None and rows:
        lines += [PLOTS_MISSING[0].upper() + PLOTS_MISSING[1:] + ".", ""]
    if result.skipped:
        lines += ["## Not run", ""]
        lines += [f"- {s['dataset']} {s['drafting']}" + (f" K={s['k']}" if s["k"] else "")
                  + (f" tree {s['tree_budget']}" if s.get("tree_budget") else "")
                  + f" concurrency {s['concurrency']}: {s['reason']}" for s in result.skipped]
        lines.append("")
    return "\n".join(lines)


def write_plots(rows: Sequence[dict], directory: Path) -> dict[str, list[str]]:
    """Per dataset: output tokens/s vs concurrency (a line per mode and K), acceptance length and output tokens/s
    vs K, per-position acceptance at the lowest concurrency. Returns dataset -> file names written."""
    from matplotlib.figure import Figure
    out: dict[str, list[str]] = {}
    for name in dict.fromkeys(r["dataset"] for r in rows):
        rs = _order(r for r in rows if r["dataset"] == name and r["output_tokens_per_s"] is not None)
        if not rs:
            continue
        sim = " (simulated acceptance)" if any(r["simulated"] for r in rs) else ""
        slug, files = _slug(name), []
        series: dict[tuple[str, int], list[dict]] = {}
        for r in rs:
            series.setdefault((_mode(r), r["k"]), []).append(r)

        fig = Figure(figsize=(7, 4.5))
        ax = fig.add_subplot()
        for (mode, k), pts in series.items():
            base = pts[0]["drafting"]
            ax.plot([p["concurrency"] for p in pts], [p["output_tokens_per_s"] for p in pts], marker="o",
                    color=COLORS[base], alpha=1.0 if base == "none" else _shade(pts[0], rs),
                    linestyle="--" if mode != base else "-",
                    label=mode if base == "none" or k == "auto" else f"{mode} K={k}")
        cs = sorted({r["concurrency"] for r in rs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set(xlabel="concurrency (requests in flight)", ylabel="output tokens/s",
               title=f"{name}: output tokens/s vs concurrency{sim}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        files.append(f"{slug}-otps-vs-concurrency.png")
        fig.savefig(directory / files[-1], dpi=120, bbox_inches="tight")

        spec = [r for r in rs if r["drafting"] != "none" and r["k"] != "auto"]  # (K sweeps: "auto" has no K)
        if spec:
            c0 = min(r["concurrency"] for r in spec)
            fig = Figure(figsize=(11, 4.5))
            ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            for mode in dict.fromkeys(_mode(r) for r in spec):  # sequential, parallel, then each tree budget
                pts = [r for r in spec if _mode(r) == mode and r["concurrency"] == c0]
                color = COLORS[mode.split()[0]]
                if pts:
                    ax1.plot([p["k"] for p in pts], [p["mean_acceptance_length"] or 1.0 for p in pts], marker="o",
                             color=color, label=mode, linestyle="--" if "tree" in mode else "-")
                for c in sorted({r["concurrency"] for r in spec}):
                    pts = [r for r in spec if _mode(r) == mode and r["concurrency"] == c]
                    if pts:
                        ax2.plot([p["k"] for p in pts], [p["output_tokens_per_s"] for p in pts], marker="o",
                                 color=color, label=f"{mode} c={c}",
                                 linestyle=["-", "--", ":", "-."][sorted({r["concurrency"] for r in spec}).index(c) % 4])
            for r in rs:
                if r["drafting"] == "none":
                    ax2.axhline(r["output_tokens_per_s"], color="black", linewidth=0.8, linestyle=":")
                    ax2.annotate(f"none c={r['concurrency']}", (1.0, r["output_tokens_per_s"]),
                                 xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7)
            ks = sorted({r["k"] for r in spec})
            for a in (ax1, ax2):
                a.set_xticks(ks, [str(k) for k in ks])
            ax1.set(xlabel="K (drafts per round)", ylabel="mean acceptance length",
                    title=f"acceptance length vs K (concurrency {c0})")
            ax2.set(xlabel="K (drafts per round)", ylabel="output tokens/s",
                    title="output tokens/s vs K (dotted: none)")
            for a in (ax1, ax2):
                a.grid(alpha=0.3)
                a.legend(fontsize=8)
            fig.suptitle(f"{name}{sim}")
            files.append(f"{slug}-k-sweep.png")
            fig.savefig(directory / files[-1], dpi=120, bbox_inches="tight")

            fig = Figure(figsize=(7, 4.5))
            ax = fig.add_subplot()
            for r in rs:
                if r["drafting"] != "none" and r["concurrency"] == c0 and r["acceptance_rates"]:
                    ax.plot(range(1, len(r["acceptance_rates"]) + 1), r["acceptance_rates"], marker="o",
                            color=COLORS[r["drafting"]], alpha=_shade(r, spec),
                            linestyle="--" if r.get("tree_budget") or r["k"] == "auto" else "-",
                            label=_mode(r) if r["k"] == "auto" else f"{_mode(r)} K={r['k']}")
            ax.set_xticks(range(1, max(len(r["acceptance_rates"] or ()) for r in rs) + 1))
            ax.set(xlabel="draft position (a tree's: depth)", ylabel="acceptance rate (accepted / drafts)",
                   ylim=(0, 1.02),
                   title=f"{name}: acceptance per position (concurrency {c0}){sim}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            files.append(f"{slug}-acceptance-per-position.png")
            fig.savefig(directory / files[-1], dpi=120, bbox_inches="tight")
        out[name] = files
    return out


def write_outputs(out, result: BenchResult, header: dict, *, force: bool, sources: Sequence = (),
                  plots: bool = True) -> Path:
    """Write bench.json, requests.jsonl, the plots (where `plots` and matplotlib) and bench.md into `out`
    atomically (`write_output_dir`, kind "bench": --force replaces only an earlier benchmark output). Returns
    `out` as written."""
    with write_output_dir(out, force=force, kind="bench", sources=sources) as d:
        write_json(d / "bench.json", result.rows)
        with open(d / "requests.jsonl", "w") as f:
            for line in result.requests:
                f.write(json.dumps(line, sort_keys=True) + "\n")
        drawn = ({} if not plots else write_plots(result.rows, d) if plots_available() else None)
        (d / "bench.md").write_text(markdown(result, header, drawn))
    return Path(out)
