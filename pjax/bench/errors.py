class BenchError(ValueError):
    """Bad benchmark input: the message names the flag, file (and line) or value, and what was expected."""
