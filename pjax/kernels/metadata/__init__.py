"""Drafter-input metadata of one P-EAGLE round (token ids, positions, feature rows, KV write slots,
sample indices, valid mask), built from the acceptance result in one fused kernel. See `reference` for
the slot layout and `pallas` for why the kernel exists and what it moves."""
from pjax.kernels.metadata.api import build_draft_inputs
from pjax.kernels.metadata.reference import DraftInputs

__all__ = ["DraftInputs", "build_draft_inputs"]
