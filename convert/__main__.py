"""`python -m convert` from a pjax checkout: the converter command (`python -m pjax convert` once installed).

    python -m convert inspect PATH            validate a target or head, print its geometry and dtypes
    python -m convert target HF_DIR OUT_DIR   pjax-native copy of a Hugging Face target
    python -m convert drafter SRC OUT_DIR     a head re-written in the speculators format

Exit status 0 when done, 2 for bad usage or bad input (one `error: ...` line), 130 when interrupted.

The converters themselves are library code in `pjax.checkpoint`; this folder only holds the entry point, so a
top-level import name as generic as `convert` is never installed into a user's environment.
"""
import sys

from pjax.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m convert"))
