"""Checkpoint converters: Hugging Face targets, P-EAGLE / EAGLE-3 heads, pjax-native copies."""
from convert.errors import CheckpointError
from convert.target import load_target

__all__ = ["CheckpointError", "load_target"]
