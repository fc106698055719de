class CheckpointError(ValueError):
    """A checkpoint is malformed or does not match the model; the message names file, tensor, expectation."""

