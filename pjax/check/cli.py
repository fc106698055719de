"""Check pjax on this device: every kernel with every implementation against its reference, every target family
against transformers in float32, and a P-EAGLE head against a float64 reference of its forward.

    python -m pjax check                     # representative shapes (an H200: about 3 minutes)
    python -m pjax check --quick             # tiny shapes: a fast GPU pass, or a CPU run (interpret mode, about
                                             # 5 minutes on 2 cores)
    python -m pjax check --only kernels,drafter --json out/check.json

Sections (`pjax.check`): kernels, targets (needs transformers and torch; skipped, not failed, without them),
drafter. Float32 products run at full precision (matmul precision "highest", the engine's setting for float32
models), so float32 kernels must match their reference to 1e-5 (max abs error / max |reference|); bf16 attention to
2e-2 absolute (unit-normal inputs), the bf16 expert matmul to 1e-2 relative, the models to 1e-4 (relative
Frobenius). Prints one table (op, implementation, shape, max abs / relative error, bound, result, the Pallas kernels
the traced call ran). --json PATH writes the rows, atomically.

Exit status: 0 every row passed, 1 a row failed, 2 bad usage (an unknown --only section, a --json path that cannot be
written), 130 interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import jax

from pjax._io import OutputError, write_json
from pjax.check import drafter, kernels, targets
from pjax.check.report import HEADER, Report, say
from pjax.command import EXIT_FAILED, EXIT_OK, one_line, run_command

__all__ = ["SECTIONS", "build_parser", "main"]

SECTIONS = {"kernels": kernels.CHECKS, "targets": targets.CHECKS, "drafter": drafter.CHECKS}


def sections_flag(text: str) -> tuple[str, ...]:
    """argparse type of --only: comma-separated section names, in the order given, each once."""
    names = [s.strip() for s in text.split(",")]
    for s in names:
        if s not in SECTIONS:
            raise argparse.ArgumentTypeError(f"unknown section {s!r} (choose from {','.join(SECTIONS)}, "
                                             "comma-separated)")
    return tuple(dict.fromkeys(names))


def build_parser(prog: str = "python -m pjax check") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes: a fast GPU pass, or a CPU run (Pallas kernels in interpret mode)")
    p.add_argument("--only", type=sections_flag, default=tuple(SECTIONS), metavar="SECTIONS",
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write the rows to this JSON file (atomically; missing parent directories are created)")
    return p


def check_json_path(path: Path) -> None:
    """Refuse before the run a --json PATH that cannot be written: a directory, or no writable directory above it."""
    if path.is_dir():
        raise OutputError(f"--json {path}: is a directory (give a file path)")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--json {path}: cannot be written ({parent} is not a writable directory)")


def run(args) -> int:
    if args.json is not None:
        check_json_path(args.json)
    report = Report()
    dev = jax.devices()[0]
    t0 = time.time()
    say(f"# pjax check: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"{'quick' if args.quick else 'full'}, matmul precision highest\n")
    say(HEADER)
    with jax.default_matmul_precision("highest"):
        for section in args.only:
            for check in SECTIONS[section]:
                t, rows = time.time(), len(report.rows)
                check(report, args.quick)
                if len(report.rows) > rows:
                    say(f"| _{check.__name__}: {time.time() - t:.0f} s_ | | | | | | | |")
    failed = report.failed
    skipped = f", skipped: {', '.join(report.skipped)}" if report.skipped else ""
    say(f"\n{len(report.rows) - len(failed)} passed, {len(failed)} failed{skipped} in {time.time() - t0:.0f} s")
    for r in failed:
        say(f"FAILED: {r.op} [{r.impl}] {r.shape}: abs {r.abs_err:.3e} rel {r.rel_err:.3e} ({r.bound})")
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.json, [dataclasses.asdict(r) for r in report.rows])
        except OSError as e:
            raise OutputError(f"--json {args.json}: cannot be written ({e.strerror or one_line(e)})") from None
        say(f"wrote {args.json}")
    return EXIT_FAILED if failed else EXIT_OK


def main(argv=None, prog: str = "python -m pjax check") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_command(lambda: run(args), user_errors=(OutputError,))
