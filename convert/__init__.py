"""Checkpoint converters: Hugging Face targets, P-EAGLE / EAGLE-3 heads, pjax-native copies."""
from convert.errors import CheckpointError
from convert.drafter import load_drafter, save_drafter
from convert.target import load_target

__all__ = ["CheckpointError", "load_drafter", "load_target", "save_drafter"]
