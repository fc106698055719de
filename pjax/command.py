"""What every `python -m pjax` subcommand shares: exit codes, and bad input turned into one line instead of a
traceback."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from pjax.dtypes import parse_dtype

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "InputError", "checked", "dtype_flag",
           "one_line", "run_command"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class InputError(ValueError):
    """Bad input to a command (a flag's value, a file or directory, the address); the message names it."""


def checked(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), a loading or checking step whose ValueError / TypeError (each naming what is wrong)
    becomes an InputError led by `what` (the flag)."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise InputError(f"{what}: {e}" if what else str(e)) from e


def one_line(e: BaseException) -> str:
    """The error as one line (an OSError as "path: reason")."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split()) or type(e).__name__


def run_command(fn: Callable[[], int], *, user_errors: tuple, interrupted: str = "interrupted") -> int:
    """fn() -> exit code; an exception of `user_errors` (bad flags, files, values) prints `error: <one line>` and
    gives EXIT_USAGE, Ctrl-C prints `interrupted` and gives EXIT_INTERRUPTED."""
    try:
        return fn()
    except user_errors as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED


def dtype_flag(text: str) -> str:
    """argparse type of a `--dtype` flag: any `pjax.dtypes` spelling -> the dtype's name ("bf16" -> "bfloat16")."""
    try:
        return parse_dtype(text, what="--dtype").name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--dtype=")) from None
