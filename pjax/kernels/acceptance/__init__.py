"""Fused speculative acceptance (chain rejection sampling) from target logits.

Why a kernel: the XLA path reads the [B, K+1, V] logits several times (argmax, max, sum-exp, then the
recovered-token race) and launches several small fusions; the kernel reads each logit once for all
per-position statistics (online max / sum / argmax over vocabulary tiles) and once more only for the
single row per request where the next token is drawn. See `reference` for the exact rule and `pallas`
for bytes moved and numerics.
"""
from pjax.kernels.acceptance.api import accept
from pjax.kernels.acceptance.reference import AcceptResult

__all__ = ["AcceptResult", "accept"]
