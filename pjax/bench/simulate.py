"""Simulated acceptance: the benchmark's acceptance rule for timing random-weight models at a trained pair's rates.
An `EngineSpec.acceptance` hook (the engine's one extension point of a round): the verdict of draft position i is a
seeded draw of probability p_i (chain: the first reject stops), and the target's argmax follows the accepted drafts.
The outputs are then not the target's."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pjax.kernels import rng
from pjax.kernels.acceptance import AcceptResult

__all__ = ["SimulatedAcceptance"]

STREAM_SIMULATE = 0x53  # counter-hash stream of the verdicts (distinct from the acceptance and draft streams)


@dataclasses.dataclass(frozen=True)
class SimulatedAcceptance:
    """probabilities: p_1..p_K, one per draft position, each in [0, 1]. Hashable: a static argument of the round."""
    probabilities: tuple[float, ...]

    def __post_init__(self):
        p = tuple(float(x) for x in self.probabilities)
        if not p or not all(0.0 <= x <= 1.0 for x in p):
            raise ValueError(f"simulated acceptance needs one probability in [0, 1] per draft position, got "
                             f"{list(self.probabilities)}")
        object.__setattr__(self, "probabilities", p)

    def __call__(self, logits, drafts, sampling, positions, num_drafts, spec) -> AcceptResult:
        """logits [B, K+1, V], drafts [B, K], positions [B] (of draft 1), num_drafts [B] -> AcceptResult (the first K
        probabilities: a budget that follows the load gives K_max, each round uses its K)."""
        k = spec.k
        if len(self.probabilities) < spec.k_max:
            raise ValueError(f"simulated acceptance gives {len(self.probabilities)} probabilities for K = "
                             f"{spec.k_max} draft positions")
        idx = jnp.arange(k, dtype=jnp.int32)[None]
        u = rng.uniform(sampling.seed.astype(jnp.uint32)[:, None], positions.astype(jnp.int32)[:, None] + idx, 0,
                        STREAM_SIMULATE)
        ok = (u < jnp.asarray(self.probabilities[:k], jnp.float32)[None]) & (idx < num_drafts[:, None])
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        nxt = jnp.argmax(jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)
        j = jnp.arange(k + 1, dtype=jnp.int32)[None]
        padded = jnp.concatenate([drafts, jnp.zeros((drafts.shape[0], 1), drafts.dtype)], axis=1)
        tokens = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], nxt[:, None], -1))
        return AcceptResult(tokens.astype(jnp.int32), n, nxt)
