"""Draft vocabulary selection (spec A.8): token frequencies of supervised tokens -> d2t / t2d."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from pjax.train.data.documents import DataError, Document

__all__ = ["build_vocab_mapping", "token_frequencies"]


def token_frequencies(docs: Iterable[Document], vocab_size: Optional[int] = None) -> dict[int, int]:
    """Counts of loss-masked tokens (the input of the draft-vocabulary selection, spec A.8)."""
    counts: dict[int, int] = {}
    for d in docs:
        ids, c = np.unique(d.tokens[d.loss_mask.astype(bool)], return_counts=True)
        for i, n in zip(ids.tolist(), c.tolist()):
            if vocab_size is not None and not 0 <= i < vocab_size:
                raise DataError(f"token id {i} outside the target vocabulary [0, {vocab_size})")
            counts[i] = counts.get(i, 0) + n
    return counts


def build_vocab_mapping(freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int):
    """(d2t int64 [Vd] offsets, t2d bool [V]) from token frequencies (spec A.8, speculators
    `build_vocab_mappings_from_distribution`): the Vd most frequent ids (ties -> lower id), padded with
    the lowest unused ids, sorted ascending; target_id = draft_id + d2t[draft_id]."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise DataError(f"draft_vocab_size={draft_vocab_size} must be in [1, target vocab {target_vocab_size}]")
    ranked = sorted(freq, key=lambda t: (-freq[t], t))[:draft_vocab_size]
    chosen = set(ranked)
    t = 0
    while len(ranked) < draft_vocab_size:
        if t not in chosen:
            ranked.append(t)
            chosen.add(t)
        t += 1
    ids = np.sort(np.asarray(ranked, np.int64))
    d2t = ids - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, bool)
    t2d[ids] = True
    return d2t, t2d
