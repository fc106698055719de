"""Few-row expert matmul for MoE decode and verify: each row times the weight of its own expert, reading every
selected expert once. See `reference` for the contract and `pallas` for why the kernel exists."""
from pjax.kernels.expert_matmul.api import expert_matmul

__all__ = ["expert_matmul"]
