"""jnp reference of speculative acceptance (chain rejection sampling), and the glue shared with the kernel.

Semantics (one row b, drafts d_1..d_n, n = num_drafts[b] <= K, emitted index i has absolute position
positions[b] + i):
- processing: x = logits_f32 * (1 / temperature); top-k keeps lanes with x >= the k-th largest x (ties
  kept); top-p then keeps lanes whose strictly-larger probability mass is < top_p (ties kept together,
  the top lane always kept); p = softmax of the kept lanes in float32 (vLLM GPU order: temperature,
  top-k, top-p).
- greedy rows (temperature <= 0): accept d_i iff d_i == argmax(logits[i]) (ties -> lowest id); next
  token = argmax at the first mismatch, or at index n if all matched.
- stochastic rows: u_i = rng.uniform(seed, pos + i, 0, STREAM_ACCEPT); accept d_i iff q_i(d_i) > 0 and
  u_i * q_i(d_i) < p_i(d_i) (q one-hot when draft_probs is None). At the first rejection (index a) the
  recovered token is the exponential race argmax_v log(max(p_a - q_a, 0)(v)) + G_v, with
  G_v = -log(-log(rng.uniform(seed, pos + a, v, STREAM_RACE))); for argmax drafts this is
  argmax_v x_v + G_v over kept v != d_a (no normalisation needed). All n accepted: bonus =
  argmax_v x_v + G_v at index n.
Invalid drafts (index >= n, id outside [0, V)) are rejected. Outputs are -1 after the next token.

The work is split in the three stages the Pallas path also uses, so both paths share the glue:
`position_stats` (per position: raw argmax, kept max m, kept sum z; the vocabulary pass),
`accept_walk` (tiny [B, K] arithmetic), `race` (one vocabulary pass over row `a` only).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pjax.kernels import rng

NEG_INF = float("-inf")


class AcceptResult(NamedTuple):
    tokens: jax.Array  # [B, K+1] int32, -1 padded
    num_accepted: jax.Array  # [B] int32 accepted drafts
    next_token: jax.Array  # [B] int32 recovered or bonus token = tokens[b, num_accepted[b]]


def check_inputs(logits, draft_ids, draft_probs, temperature, seeds, positions, num_drafts, top_k, top_p):
    """Shape checks with readable errors; returns (B, K, V)."""
    if logits.ndim != 3:
        raise ValueError(f"accept: logits must be [B, K+1, V], found shape {logits.shape}")
    b, k1, v = logits.shape
    k = k1 - 1
    want = {"draft_ids": (draft_ids, (b, k)), "temperature": (temperature, (b,)), "seeds": (seeds, (b,)),
            "positions": (positions, (b,)), "num_drafts": (num_drafts, (b,)), "top_k": (top_k, (b,)),
            "top_p": (top_p, (b,)), "draft_probs": (draft_probs, (b, k, v))}
    for name, (arr, shape) in want.items():
        if arr is not None and tuple(jnp.shape(arr)) != shape:
            raise ValueError(f"accept: {name} must have shape {shape} (logits {logits.shape}), "
                             f"found {tuple(jnp.shape(arr))}")
    return b, k, v


def inverse_temperature(temperature):
    """(greedy [B] bool, inv_t [B] f32); greedy rows get inv_t = 1 (unused)."""
    t = jnp.asarray(temperature, jnp.float32)
    greedy = t <= 0
    return greedy, jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, t))


def scaled(logits, inv_t):
    """logits [B, R, V] (any float) -> float32 x = logits * inv_t[b]."""
    return logits.astype(jnp.float32) * inv_t[:, None, None]


def truncation_threshold(x, top_k=None, top_p=None):
    """x [B, R, V] processed logits -> thr [B, R] f32: lanes with x >= thr are kept (-inf = keep all).

    Sort-based (one full sort of the vocabulary per position); shared by both implementations, so
    the kept sets are identical.
    """
    b, r, v = x.shape
    thr = jnp.full((b, r), NEG_INF, jnp.float32)
    if top_k is None and top_p is None:
        return thr
    xs = -jnp.sort(-x, axis=-1)  # descending
    if top_k is not None:
        k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32)[:, None], (b, r))
        kth = jnp.take_along_axis(xs, jnp.clip(k - 1, 0, v - 1)[..., None], axis=-1)[..., 0]
        thr = jnp.where((k > 0) & (k < v), kth, thr)
    if top_p is not None:
        tp = jnp.asarray(top_p, jnp.float32)[:, None, None]
        xk = jnp.where(xs >= thr[..., None], xs, NEG_INF)
        e = jnp.exp(xk - xs[..., :1])
        p = e / jnp.sum(e, axis=-1, keepdims=True)
        excl = jnp.concatenate([jnp.zeros_like(p[..., :1]), jnp.cumsum(p, axis=-1)[..., :-1]], axis=-1)
        n = jnp.maximum(jnp.sum(excl < tp, axis=-1), 1)
        thr_p = jnp.take_along_axis(xs, (n - 1)[..., None], axis=-1)[..., 0]
        thr = jnp.where(tp[..., 0] < 1.0, jnp.maximum(thr, thr_p), thr)
    return thr


def position_stats(logits, inv_t, thr):
    """Per position: raw argmax [B, R] i32, kept max m [B, R] f32, kept sum z = sum exp(x - m) [B, R]."""
    x_raw = logits.astype(jnp.float32)
    amax = jnp.argmax(x_raw, axis=-1).astype(jnp.int32)
    x = x_raw * inv_t[:, None, None]
    keep = x >= thr[..., None]
    m = jnp.max(jnp.where(keep, x, NEG_INF), axis=-1)
    z = jnp.sum(jnp.where(keep, jnp.exp(x - m[..., None]), 0.0), axis=-1)
    return amax, m, z


def kept_prob(x_tok, thr, m, z):
    """p(token) from its processed logit x_tok and its position's statistics (all [B, R] f32): exp(x - m) / z
    where kept (x >= thr), else 0."""
    return jnp.where(x_tok >= thr, jnp.exp(x_tok - m) / z, 0.0)


def sample_lanes(x, allowed, seeds, positions):
    """The exponential race: argmax_v x_v + G_v over lanes where allowed, G_v = gumbel(seed, position, v), a sample
    of softmax(x) restricted to them. x [B, V] f32 processed logits, allowed [B, V] bool, seeds [B] u32, positions
    [B] i32 (the token's absolute position) -> [B] i32."""
    lanes = jnp.arange(x.shape[-1], dtype=jnp.int32)
    g = rng.gumbel(seeds[:, None], positions[:, None], lanes[None])
    return jnp.argmax(jnp.where(allowed, x + g, NEG_INF), axis=-1).astype(jnp.int32)


class Walk(NamedTuple):
    num_accepted: jax.Array  # [B] i32
    row: jax.Array  # [B] i32 index of the next token (= num_accepted)
    excl: jax.Array  # [B] i32 lane excluded from the race (argmax draft rejected there), else -1
    use_q: jax.Array  # [B] bool race on max(p - q, 0) (a rejection with draft_probs)
    n: jax.Array  # [B] i32 valid drafts


def accept_walk(logits, draft_ids, draft_probs, *, greedy, inv_t, thr, amax, m, z, seeds, positions,
                num_drafts):
    """Acceptance tests and the accepted prefix length from the per-position statistics."""
    b, k1, v = logits.shape
    k = k1 - 1
    n = jnp.full((b,), k, jnp.int32) if num_drafts is None else jnp.clip(num_drafts.astype(jnp.int32), 0, k)
    d = draft_ids.astype(jnp.int32)
    idx = jnp.arange(k, dtype=jnp.int32)
    valid = (idx[None] < n[:, None]) & (d >= 0) & (d < v)
    dc = jnp.clip(d, 0, v - 1)
    x_d = jnp.take_along_axis(logits[:, :k], dc[..., None], axis=-1)[..., 0].astype(jnp.float32) * inv_t[:, None]
    p_d = kept_prob(x_d, thr[:, :k], m[:, :k], z[:, :k])
    if draft_probs is None:
        q_d = jnp.ones_like(p_d)
    else:
        q_d = jnp.take_along_axis(draft_probs, dc[..., None], axis=-1)[..., 0].astype(jnp.float32)
    u = rng.uniform(seeds[:, None], positions[:, None] + idx[None], 0, rng.STREAM_ACCEPT)
    acc_s = (q_d > 0) & (u * q_d < p_d)
    acc_g = d == amax[:, :k]
    acc = valid & jnp.where(greedy[:, None], acc_g, acc_s)
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    rejected = a < n
    d_a = jnp.take_along_axis(d, jnp.clip(a, 0, k - 1)[:, None], axis=-1)[:, 0] if k > 0 else jnp.full((b,), -1)
    has_q = draft_probs is not None
    excl = jnp.where(rejected & (not has_q), d_a, -1).astype(jnp.int32)
    use_q = rejected & has_q
    return Walk(a, a, excl, use_q, n)


def gather_rows(arr, row):
    """arr [B, R, ...] -> arr[b, row[b]]."""
    r = jnp.clip(row, 0, arr.shape[1] - 1)
    return jnp.take_along_axis(arr, r.reshape((-1, 1) + (1,) * (arr.ndim - 2)), axis=1)[:, 0]


def race(logits, draft_probs, w: Walk, *, inv_t, thr, m, z, seeds, positions):
    """Recovered / bonus token of stochastic rows [B] i32: one vocabulary pass over row w.row."""
    v = logits.shape[-1]
    x = gather_rows(logits, w.row).astype(jnp.float32) * inv_t[:, None]
    thr_r, m_r, z_r = gather_rows(thr, w.row), gather_rows(m, w.row), gather_rows(z, w.row)
    lanes = jnp.arange(v, dtype=jnp.int32)
    keep = x >= thr_r[:, None]
    tok = sample_lanes(x, keep & (lanes[None] != w.excl[:, None]), seeds, positions + w.row)
    if draft_probs is not None:
        g = rng.gumbel(seeds[:, None], (positions + w.row)[:, None], lanes[None])
        q = gather_rows(draft_probs, w.row).astype(jnp.float32)
        p = kept_prob(x, thr_r[:, None], m_r[:, None], z_r[:, None])
        res = jnp.maximum(p - q, 0.0)
        sq = jnp.where(res > 0, jnp.log(res) + g, NEG_INF)
        tok_q = jnp.argmax(sq, axis=-1)
        tok = jnp.where(w.use_q & (jnp.max(sq, axis=-1) > NEG_INF), tok_q, tok)
    return tok.astype(jnp.int32)


def assemble(draft_ids, w: Walk, next_token):
    b, k = draft_ids.shape
    i = jnp.arange(k + 1, dtype=jnp.int32)[None]
    d = jnp.concatenate([draft_ids.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    a = w.num_accepted[:, None]
    tokens = jnp.where(i < a, d, jnp.where(i == a, next_token[:, None], -1))
    return AcceptResult(tokens.astype(jnp.int32), w.num_accepted, next_token.astype(jnp.int32))


def accept(logits, draft_ids, draft_probs=None, *, temperature, top_k=None, top_p=None, seeds, positions,
           num_drafts=None) -> AcceptResult:
    """XLA reference; see the module docstring for the exact rule. Shapes as `pjax.kernels.acceptance.accept`."""
    check_inputs(logits, draft_ids, draft_probs, temperature, seeds, positions, num_drafts, top_k, top_p)
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    positions = jnp.asarray(positions, jnp.int32)
    greedy, inv_t = inverse_temperature(temperature)
    thr = truncation_threshold(scaled(logits, inv_t), top_k, top_p)
    amax, m, z = position_stats(logits, inv_t, thr)
    w = accept_walk(logits, draft_ids, draft_probs, greedy=greedy, inv_t=inv_t, thr=thr, amax=amax, m=m, z=z,
                    seeds=seeds, positions=positions, num_drafts=num_drafts)
    tok = race(logits, draft_probs, w, inv_t=inv_t, thr=thr, m=m, z=z, seeds=seeds, positions=positions)
    nxt = jnp.where(greedy, gather_rows(amax, w.row), tok)
    return assemble(draft_ids, w, nxt)
