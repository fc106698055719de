"""`python -m pjax COMMAND ...`: generate, bench, convert, serve, check (see `python -m pjax COMMAND --help`)."""
import sys

from pjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
