"""Training-side API (COD layouts, losses, the training loop). Re-exports only."""
from pjax.models.drafter import cod_attention_mask, draft_logits

__all__ = [
    "cod_attention_mask",
    "draft_logits",
]
