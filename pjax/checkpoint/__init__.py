"""Checkpoints: Hugging Face targets (FP8 / MXFP4 dequantised), P-EAGLE / EAGLE-3 heads (speculators and
vLLM-native layouts), pjax-native target copies, and the converter command (`cli`)."""
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.heads import load_drafter, save_drafter
from pjax.checkpoint.native import save_native_target
from pjax.checkpoint.target import load_target

__all__ = ["CheckpointError", "load_drafter", "load_target", "save_drafter", "save_native_target"]
