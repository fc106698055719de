"""Frozen-target features computed online (inside the jitted train step).

The target runs over raw packed rows with causal attention restricted to each document and
positions restarting at 0 in every document (exactly what per-sample vLLM capture sees), and returns
the residual streams entering the drafter's aux layers ([B, S, A*Ht], id order) and the final
pre-norm state ([B, S, Ht]). Attention runs under a document mask (`pjax.kernels.flash_attention.document_mask`):
the flash kernel on a GPU, or the query-chunked reference, so long rows never materialise S x S scores.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from pjax.kernels.flash_attention import document_mask, document_starts
from pjax.models.target import Target
from pjax.precision import float32_products


def document_positions(document_ids):
    """[..., S] -> position of each token inside its document (0-based; padding gets 0)."""
    doc = jnp.asarray(document_ids, jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(doc.shape[-1], dtype=jnp.int32), doc.shape)
    return jnp.where(doc == -1, 0, idx - document_starts(doc))


@float32_products
def target_features(target: Target, tokens, document_ids, aux_layer_ids: Sequence[int], *,
                    chunk: Optional[int] = None, implementation: str = "auto"):
    """tokens, document_ids [B, S] -> (aux [B, S, A*Ht], final [B, S, Ht]), gradient-stopped.
    chunk: query rows per chunk of the reference attention (None = automatic); implementation: the kernel switch
    ("xla" | "pallas" | "auto")."""
    tokens = jnp.asarray(tokens, jnp.int32)
    doc = jnp.asarray(document_ids, jnp.int32)
    out = target.module(tokens, document_positions(doc), None, mask=document_mask(doc, chunk),
                        aux_layer_ids=tuple(aux_layer_ids), return_final=True, implementation=implementation)
    return jax.lax.stop_gradient(out.aux), jax.lax.stop_gradient(out.final)
