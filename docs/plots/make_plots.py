"""Draw the figures of docs/performance.md from the tables in that file (the numbers live in one place).

    python docs/plots/make_plots.py        # needs matplotlib; writes docs/img/*.png

Each figure reads the markdown table whose header row starts with the given text; a table that is missing or changed
its columns is an error naming it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parents[1]
SOURCE = DOCS / "performance.md"
OUT = DOCS / "img"


def table(text: str, header_start: str) -> list[dict[str, str]]:
    """The rows (header -> cell) of the first markdown table whose header row starts with `header_start`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(header_start):
            continue
        header = [c.strip() for c in line.strip("|").split("|")]
        rows = []
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            if len(cells) != len(header):
                raise SystemExit(f"{SOURCE}: table {header_start!r}: row {row!r} has {len(cells)} cells, expected "
                                 f"{len(header)}")
            rows.append(dict(zip(header, cells)))
        return rows
    raise SystemExit(f"{SOURCE}: no table whose header starts with {header_start!r}")


def cell(row: dict[str, str], column: str) -> str:
    if column not in row:
        raise SystemExit(f"{SOURCE}: a table has no column {column!r} (columns: {list(row)})")
    return row[column]


def number(cell: str) -> float:
    """The first number of a cell ('**24.4 us** (27.6, 112.4)' -> 24.4, '63%' -> 63)."""
    m = re.search(r"-?\d+(\.\d+)?", cell.replace(",", ""))
    if m is None:
        raise SystemExit(f"{SOURCE}: no number in table cell {cell!r}")
    return float(m.group())


def drafter_step(text: str):
    rows = table(text, "| K | parallel")
    ks = [number(cell(r, "K")) for r in rows]
    par = [number(cell(r, "parallel (P-EAGLE: one pass over 2K slots) ms")) for r in rows]
    seq = [number(cell(r, "sequential (EAGLE-3: K passes) ms")) for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=120)
    ax.plot(ks, seq, "o-", label="sequential (EAGLE-3: K drafter passes)")
    ax.plot(ks, par, "o-", label="parallel (P-EAGLE: one drafter pass)")
    ax.set_xlabel("speculative tokens K")
    ax.set_ylabel("drafter step, ms")
    ax.set_xticks(ks)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_title("Drafter step, 8B-shaped target, 4-layer head, batch 1 (H200)", fontsize=9)
    return fig, "drafter-step-vs-k.png"


def attention_share(text: str):
    triton = [r for r in table(text, "| B | context | T | XLA us | Pallas us") if cell(r, "context") == "16384"]
    mosaic = table(text, "| B | Llama T = 22")
    groups = {f"T = {t} (Triton)": [number(cell(r, "% of 4.34 TB/s")) for r in triton if cell(r, "T") == str(t)]
              for t in (4, 14)}
    groups["T = 22 (Mosaic)"] = [number(cell(r, "Llama, % of 4.34 TB/s")) for r in mosaic]
    groups["GPT-OSS T = 12 (Mosaic)"] = [number(cell(r, "GPT-OSS, % of 4.34 TB/s")) for r in mosaic]
    batches = ["1", "8", "64"]
    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=120)
    width = 0.8 / len(groups)
    for j, (name, values) in enumerate(groups.items()):
        if len(values) != len(batches):
            raise SystemExit(f"{SOURCE}: expected batch 1 / 8 / 64 rows for {name}, found {len(values)}")
        ax.bar([i + (j - (len(groups) - 1) / 2) * width for i in range(len(batches))], values, width, label=name)
    ax.axhline(70, color="grey", lw=0.8, ls="--")
    ax.text(len(batches) - 0.5, 71, "70%", color="grey", fontsize=7, ha="right", va="bottom")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("% of 4.34 TB/s (K/V bytes)")
    ax.set_ylim(0, 110)
    ax.legend(frameon=False, fontsize=7, ncol=3, loc="upper left")
    ax.set_title("Cache attention at 16K context, whole op; Llama geometry unless named (H200)", fontsize=9)
    return fig, "cache-attention-hbm.png"


def main() -> int:
    text = SOURCE.read_text()
    OUT.mkdir(exist_ok=True)
    for make in (drafter_step, attention_share):
        fig, name = make(text)
        fig.tight_layout()
        fig.savefig(OUT / name)
        plt.close(fig)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
