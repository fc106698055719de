"""Greedy parallel decoding replayed from teacher forcing: where a P-EAGLE head's acceptance is lost.

`teacher_forced_drafts` gives the head's dense COD prediction at every anchor of a finished sequence (what training
scores): anchor a holds the target's feature at a and token a + 1, and depths 0..K-1 predict tokens a+2..a+K+1.
The engine's drafts in each round are these predictions at the anchor just before the round's bonus token
(tests/test_parallel_consistency.py). `replay_rounds` walks a sequence as greedy decoding does: a round accepts the
drafts' matching prefix, the target's next token is the new bonus, and the next round's anchor is just before it.
Comparing a replay with the engine's acceptance checks drafting against training; comparing it with the accuracy at
every anchor measures what the choice of round starts costs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pjax.decode.inputs import bucket_length
from pjax.models.drafter import Drafter, draft_to_target
from pjax.models.pairing import check_pair
from pjax.models.target import Target
from pjax.train.data.shift import eagle_shift
from pjax.train.losses import draft_logits
from pjax.train.target_features import target_features

__all__ = ["replay_rounds", "teacher_forced_drafts"]


def teacher_forced_drafts(target: Target, drafter: Drafter, seq, k: int, *, implementation: str = "auto"):
    """seq [S] token ids -> [S, k] target-vocabulary ids: row a = the head's predictions of tokens a+2..a+k+1 from
    anchor a (depths 0..k-1; the target's features of the whole sequence, one document). One compiled program per
    power-of-two length: the sequence is padded at its end (a separate document), which no anchor of it attends."""
    s = len(seq)
    n = bucket_length(s)
    toks = np.zeros(n, np.int32)
    toks[:s] = np.asarray(seq, np.int32)
    doc = np.where(np.arange(n) < s, 0, -1).astype(np.int32)
    return np.asarray(_dense_drafts(target, drafter, jnp.asarray(toks), jnp.asarray(doc), k=k,
                                    implementation=implementation))[:s]


@functools.partial(jax.jit, static_argnames=("k", "implementation"))
def _dense_drafts(target, drafter, toks, doc, *, k: int, implementation: str):
    """toks, doc [N] -> [N, k] (`teacher_forced_drafts` of one padded row)."""
    n = toks.shape[0]
    aux, final = target_features(target, toks[None], doc[None], check_pair(target.config, drafter.config),
                                 implementation=implementation)
    sh = eagle_shift(toks, (doc >= 0).astype(jnp.int32), doc, aux[0], final[0])
    anchors = jnp.tile(jnp.arange(n, dtype=jnp.int32), k)
    depths = jnp.repeat(jnp.arange(k, dtype=jnp.int32), n)
    logits = draft_logits(drafter, sh["hidden_states"][None], sh["input_ids"][None], sh["document_ids"][None],
                          anchors, depths)
    return draft_to_target(drafter, jnp.argmax(logits, -1)).reshape(k, n).T


def replay_rounds(drafts, seq, first: int):
    """drafts [S, k] (`teacher_forced_drafts`), seq [S], first = the first round's anchor (the last prompt token:
    prefill emits the first generated token) -> (chain [n, k] bool: at anchor first + i, drafts 0..d all equal the
    sequence, for the n anchors whose k drafts lie inside it; starts: indices into chain of the rounds greedy
    decoding runs). Round i accepts chain[starts[i]].sum() drafts."""
    seq = np.asarray(seq)
    k = drafts.shape[1]
    right = [drafts[a] == seq[a + 2:a + 2 + k] for a in range(first, len(seq) - k - 1)]
    chain = np.cumprod(np.asarray(right, bool).reshape(-1, k), axis=1).astype(bool)
    starts, i = [], 0
    while i < len(chain):
        starts.append(i)
        i += int(chain[i].sum()) + 1
    return chain, starts
