"""Fused kernels of the speculative round. Each op package has `reference.py` (jnp oracle and CPU path),
`pallas.py` (pl.pallas_call: Triton on GPU, interpret mode on CPU), `config.py` (the kernel's tuning values) and
`api.py` (the public op). Every op takes `implementation=` one of IMPLEMENTATIONS ("xla" | "pallas" | "auto"; the
contract is in `pjax.kernels.dispatch`); hardware sizes come from `pjax.kernels.hardware`.

The ops: `accept` (chain acceptance from target logits), `cache_attention` (attention over the KV cache),
`attention` (masked attention for training and long rows, with the masks it takes), `build_draft_inputs` (a
P-EAGLE round's drafter inputs), `expert_matmul` (few-row MoE expert products), `grouped_matmul` (many-row MoE
expert products over rows sorted by expert). Packed MXFP4 / FP8 weights: `pjax.kernels.quantized`."""
from pjax.kernels.acceptance import AcceptResult, accept
from pjax.kernels.cache_attention import cache_attention
from pjax.kernels.dispatch import IMPLEMENTATIONS
from pjax.kernels.expert_matmul import expert_matmul
from pjax.kernels.flash_attention import AttentionMask, attention, causal_mask, document_mask, position_mask
from pjax.kernels.grouped_matmul import grouped_matmul
from pjax.kernels.metadata import DraftInputs, build_draft_inputs

__all__ = ["IMPLEMENTATIONS", "AcceptResult", "AttentionMask", "DraftInputs", "accept", "attention",
           "build_draft_inputs", "cache_attention", "causal_mask", "document_mask", "expert_matmul", "grouped_matmul",
           "position_mask"]
