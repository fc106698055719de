"""Attention for training and long rows: one grouped-query masked softmax with sinks (`reference`), masks as data
(`mask`: positions, packed documents, causal rows; the drafter's layouts in `pjax.train.masks`), and fused
implementations with blockwise backward passes: a Pallas FlashAttention-2 kernel (`pallas`) and cuDNN (`cudnn`)
where its public API expresses the mask. See `pallas` for why the kernel exists, bytes moved and numerics."""
from pjax.kernels.flash_attention.api import IMPLEMENTATIONS, attention
from pjax.kernels.flash_attention.mask import (AttentionMask, causal_mask, document_mask, document_starts,
                                               position_mask)
from pjax.kernels.flash_attention.reference import MASK_VALUE

__all__ = ["IMPLEMENTATIONS", "MASK_VALUE", "AttentionMask", "attention", "causal_mask", "document_mask",
           "document_starts", "position_mask"]
