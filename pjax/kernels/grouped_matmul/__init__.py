"""Grouped matmul for MoE prefill and training: rows sorted by expert, each group of rows times its expert's
weight, cost growing with the rows (not rows x experts). See `reference` for the contract and `pallas` for the
kernel's tiling."""
from pjax.kernels.grouped_matmul.api import grouped_matmul

__all__ = ["grouped_matmul"]
