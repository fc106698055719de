"""The rows of `python -m pjax check`: one comparison each (errors, bound, pass), printed as a markdown table row
as it is recorded; the bounds; the error measures."""
from __future__ import annotations

import dataclasses

import numpy as np

from pjax.kernels.jaxpr import pallas_kernel_names

__all__ = ["BF16_ATTN_BOUND", "BF16_REL_BOUND", "F32_BOUND", "PARITY_BOUND", "Report", "Row", "float_errors",
           "frobenius_rel", "kernels_in"]

# float32 kernels vs their reference (max abs error / max |reference|); bf16 attention (absolute, unit-normal inputs);
# bf16 expert matmul (relative); a model against transformers or a float64 forward (relative Frobenius)
F32_BOUND, BF16_ATTN_BOUND, BF16_REL_BOUND, PARITY_BOUND = 1e-5, 2e-2, 1e-2, 1e-4

HEADER = ("| op | implementation | shape | max abs err | rel err | bound | result | ran |\n"
          "|---|---|---|---|---|---|---|---|")


@dataclasses.dataclass
class Row:
    section: str
    op: str
    impl: str
    shape: str
    abs_err: float
    rel_err: float
    bound: str
    ok: bool
    ran: str = ""  # the Pallas kernels the traced call contains ("-": none)


@dataclasses.dataclass
class Report:
    """The rows of one run, and the sections it skipped (section -> why)."""
    rows: list[Row] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def record(self, section, op, impl, shape, *, abs_err, rel_err, bound: str, ok: bool, ran: str = "") -> Row:
        row = Row(section, op, impl, shape, float(abs_err), float(rel_err), bound, bool(ok), ran)
        self.rows.append(row)
        say(f"| {op} | {impl} | {shape} | {row.abs_err:.2e} | {row.rel_err:.2e} | {bound} | "
            f"{'pass' if row.ok else 'FAIL'} | {ran} |")
        return row

    def skip(self, section: str, why: str) -> None:
        self.skipped[section] = why
        say(f"skipped: {why}")

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]


def say(*a) -> None:
    print(*a, flush=True)


def float_errors(got, want) -> tuple[float, float]:
    """(max abs error, max abs error / max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    return err, (err / max(float(np.max(np.abs(want))), 1e-30) if want.size else 0.0)


def frobenius_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def kernels_in(fn, *args) -> str:
    """The Pallas kernels fn(*args) runs, comma-separated without the `pjax_` prefix ("-": none)."""
    names = sorted({n.removeprefix("pjax_") for n in pallas_kernel_names(fn, *args)})
    return ",".join(names) or "-"
