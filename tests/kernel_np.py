"""Independent numpy (float64) oracles for the kernel tests: counter hash, processing, acceptance, metadata."""
from __future__ import annotations

import math

import numpy as np

_MASK = 0xFFFFFFFF


def np_mix(x):
    x = x.astype(np.uint64)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    x ^= x >> 16
    return x


def np_bits(seed, pos, lane, stream):
    seed, pos, lane = (np.asarray(a).astype(np.int64) & _MASK for a in (seed, pos, lane))
    h = np_mix((seed ^ ((stream * 0x85EBCA6B + 0x27D4EB2F) & _MASK)).astype(np.uint64))
    h = np_mix((h + (pos.astype(np.uint64) * 0x9E3779B9 & _MASK)) & _MASK)
    return np_mix(h ^ ((lane.astype(np.uint64) * 0x9E3779B9) & _MASK))


def np_uniform(seed, pos, lane, stream):
    return ((np_bits(seed, pos, lane, stream) >> 9).astype(np.float64) * 2 + 1) * 2.0 ** -24


def np_keep(x, top_k, top_p):
    """x [V] float64 processed logits -> kept mask under the documented top-k then top-p law."""
    v = x.shape[0]
    keep = np.ones(v, bool)
    if top_k is not None and 0 < top_k < v:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p is not None and top_p < 1:
        p = np.where(keep, np.exp(x - x.max()), 0.0)
        p /= p.sum()
        above = np.array([p[p > p[i]].sum() for i in range(v)])
        keep &= above < top_p
        keep[np.argmax(x)] = True
    return keep


def np_probs(logits, temp, top_k=None, top_p=None):
    x = logits.astype(np.float64) / temp
    keep = np_keep(x, top_k, top_p)
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return p / p.sum(), keep


def np_accept(logits, drafts, q, temp, top_k, top_p, seed, pos, n):
    """One row, float64. logits [K+1, V]; drafts [K]; q [K, V] or None. Returns tokens [K+1]."""
    k1, v = logits.shape
    k = k1 - 1
    out = []
    for i in range(k + 1):
        if temp <= 0:
            am = int(np.argmax(logits[i]))
            if i < n and drafts[i] == am:
                out.append(am)
                continue
            out.append(am)
            break
        p, keep = np_probs(logits[i], temp, top_k, top_p)
        if i < n and 0 <= drafts[i] < v:
            d = drafts[i]
            qd = 1.0 if q is None else float(q[i, d])
            u = np_uniform(seed, pos + i, 0, 1)
            if qd > 0 and u * qd < p[d]:
                out.append(int(d))
                continue
        lanes = np.arange(v)
        g = -np.log(-np.log(np_uniform(seed, pos + i, lanes, 2)))
        x = logits[i].astype(np.float64) / temp
        if q is not None and i < n:
            res = np.maximum(p - q[i], 0)
            score = np.where(res > 0, np.log(np.where(res > 0, res, 1)) + g, -np.inf)
        else:
            excl = drafts[i] if i < n else -1
            score = np.where(keep & (lanes != excl), x + g, -np.inf)
        out.append(int(np.argmax(score)))
        break
    return np.array(out + [-1] * (k + 1 - len(out)))


def np_draft_inputs(n, vt, nxt, start, num_slots, mask_tok):
    k = vt.shape[0] - 1
    tok, pos, fr, wp, val = [], [], [], [], []
    for j in range(num_slots):
        pos.append(start + j)
        if j < n:
            tok.append(vt[j + 1]); fr.append(j); val.append(True)
        elif j == n:
            tok.append(nxt); fr.append(n); val.append(True)
        elif j < n + k:
            tok.append(mask_tok); fr.append(-1); val.append(True)
        else:
            tok.append(0); fr.append(-1); val.append(False)
        wp.append(pos[-1] if val[-1] else -1)
    return dict(tokens=tok, positions=pos, feature_row=fr, write_pos=wp, sample_idx=list(range(n, n + k)),
                valid=val)


def chi2_pvalue(counts, probs):
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation), cells with expected >= 5 pooled."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    c = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    if e[-1] == 0:
        assert c[-1] == 0, "mass on cells with zero probability"
        c, e = c[:-1], e[:-1]
    stat = float(((c - e) ** 2 / e).sum())
    dof = len(c) - 1
    return chi2_sf(stat, dof)


def chi2_sf(stat, dof):
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
