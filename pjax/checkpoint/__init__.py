"""Checkpoints: Hugging Face targets (FP8 / MXFP4 dequantised), P-EAGLE / EAGLE-3 heads (speculators and
vLLM-native layouts), pjax-native target copies (checksummed), the output-directory rule every pjax writer
follows (`write_output_dir`, from `pjax._io`), and the converter command (`cli`)."""
from pjax._io import OutputError, output_kind, prepare_output, write_output_dir
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.heads import load_drafter, save_drafter
from pjax.checkpoint.native import save_native_target
from pjax.checkpoint.target import load_target

__all__ = ["CheckpointError", "OutputError", "load_drafter", "load_target", "output_kind", "prepare_output",
           "save_drafter", "save_native_target", "write_output_dir"]
