class CheckpointError(ValueError):
    """A checkpoint is malformed or does not match the model; the message names file, tensor, expectation."""


class OutputError(CheckpointError):
    """An output directory may not be written or replaced there; the message names the path and the reason."""
