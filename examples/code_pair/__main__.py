"""`python -m examples.code_pair ...` (from the repository root): see `examples/code_pair/__init__.py`."""
from examples.code_pair.cli import main

main()
