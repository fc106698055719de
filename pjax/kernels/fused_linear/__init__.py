"""Fused few-row linear layers of a decoder layer: the RMSNorm folded into the q/k/v and gate/up products, RoPE
(and Qwen3's q/k-norm) and SwiGLU into their epilogues, the residual add into the o- and down-projections. See
`reference` for the contracts and `pallas` for why the kernels exist and what they move."""
from pjax.kernels.fused_linear.api import linear_residual, norm_linear, norm_qkv, norm_swiglu, use_kernel

__all__ = ["linear_residual", "norm_linear", "norm_qkv", "norm_swiglu", "use_kernel"]
