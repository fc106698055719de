"""Offline target features: captured samples (vLLM `[n, A+1, Ht]` or split tensors) checked, stored as
.safetensors, shifted and packed into rows (`FeatureStream`), so training runs without the target forward."""
from __future__ import annotations

import hashlib
import os
from typing import Iterator, Sequence

import numpy as np

from pjax.train.data.documents import DataError

__all__ = ["FEATURE_KEYS", "FeatureStream", "feature_sample", "load_feature_sample", "save_feature_sample",
           "shift_and_pack_features"]


FEATURE_KEYS = ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states")


def feature_sample(sample: dict, *, where: str = "sample") -> dict:
    """One offline sample (unshifted, as captured) -> numpy dict of FEATURE_KEYS, checked.

    Takes input_ids [n], loss_mask [n] (default: all ones) and either hidden_states [n, A*Ht] with
    verifier_last_hidden_states [n, Ht], or vLLM's captured hidden_states [n, A+1, Ht] (the first A layers
    flattened are the drafter's input, the last is the verifier's final state; spec D.1)."""
    if "input_ids" not in sample or "hidden_states" not in sample:
        raise DataError(f"{where}: needs 'input_ids' and 'hidden_states', found {sorted(sample)}")
    ids = np.asarray(sample["input_ids"]).astype(np.int32)
    hs = np.asarray(sample["hidden_states"])
    n = ids.shape[0] if ids.ndim == 1 else -1
    if ids.ndim != 1 or n < 2:
        raise DataError(f"{where}: input_ids must be [n] with n >= 2, found shape {ids.shape}")
    if "verifier_last_hidden_states" in sample:
        last = np.asarray(sample["verifier_last_hidden_states"])
        if hs.ndim != 2 or last.ndim != 2 or hs.shape[0] != n or last.shape[0] != n:
            raise DataError(f"{where}: expected hidden_states [{n}, A*Ht] and verifier_last_hidden_states [{n}, Ht], "
                            f"found {hs.shape} and {last.shape}")
    elif hs.ndim == 3 and hs.shape[0] == n and hs.shape[1] >= 2:
        hs, last = hs[:, :-1].reshape(n, -1), hs[:, -1]
    else:
        raise DataError(f"{where}: hidden_states must be [{n}, A+1, Ht] (vLLM capture) or [{n}, A*Ht] with "
                        f"verifier_last_hidden_states [{n}, Ht], found {hs.shape}")
    lm = np.ones(n, np.int32) if sample.get("loss_mask") is None else np.asarray(sample["loss_mask"]).astype(np.int32)
    if lm.shape != (n,):
        raise DataError(f"{where}: loss_mask must be [{n}], found {lm.shape}")
    return dict(input_ids=ids, loss_mask=lm, hidden_states=hs, verifier_last_hidden_states=last)


def save_feature_sample(path, sample: dict) -> None:
    """Write one offline sample (any layout `feature_sample` takes) as a .safetensors file, atomically."""
    from pjax.checkpoint.safetensors import save_file
    save_file(feature_sample(sample, where=str(path)), path)


def load_feature_sample(path) -> dict:
    """Read a .safetensors sample written by `save_feature_sample` (or with the same tensor names)."""
    from pjax.checkpoint.safetensors import SafetensorsFile
    f = SafetensorsFile(path)
    return feature_sample({k: np.asarray(f.get(k)) for k in f.keys()}, where=str(path))


def _shifted(sample: dict) -> dict:
    """EAGLE shift of one checked sample (spec D.1): drop x_0, l_0, y_0 and g_{n-1} -> n - 1 positions."""
    return dict(input_ids=sample["input_ids"][1:], loss_mask=sample["loss_mask"][1:],
                hidden_states=sample["hidden_states"][:-1],
                verifier_last_hidden_states=sample["verifier_last_hidden_states"][1:])


def _feature_row(pieces: Sequence[dict], total_seq_len: int) -> dict:
    """Shifted pieces (each its own document, in order) -> one row of [S] / [S, D] arrays, zero padded."""
    first = pieces[0]
    out = dict(input_ids=np.zeros(total_seq_len, np.int32), loss_mask=np.zeros(total_seq_len, np.int32),
               document_ids=np.full(total_seq_len, -1, np.int32),
               hidden_states=np.zeros((total_seq_len,) + first["hidden_states"].shape[1:],
                                      first["hidden_states"].dtype),
               verifier_last_hidden_states=np.zeros((total_seq_len,) + first["verifier_last_hidden_states"].shape[1:],
                                                    first["verifier_last_hidden_states"].dtype))
    o = 0
    for k, piece in enumerate(pieces):
        n = len(piece["input_ids"])
        for key in FEATURE_KEYS:
            out[key][o:o + n] = piece[key]
        out["document_ids"][o:o + n] = k
        o += n
    return out


def shift_and_pack_features(samples: Sequence[dict], total_seq_len: int) -> dict:
    """Offline features (speculators layout, see `feature_sample`) shifted one by one and packed into one
    row of total_seq_len (the last sample is truncated, later ones dropped) -> dict of [1, S] arrays +
    document_ids (-1 padding)."""
    pieces, o = [], 0
    for smp in samples:
        sh = _shifted(feature_sample(smp))
        n = min(len(sh["input_ids"]), total_seq_len - o)
        if n <= 0:
            break
        pieces.append({k: v[:n] for k, v in sh.items()})
        o += n
    return {k: v[None] for k, v in _feature_row(pieces, total_seq_len).items()}


class FeatureStream:
    """Deterministic batches of packed offline-feature rows: the `RowStream` of training without the target
    forward (features captured once, e.g. by vLLM or `pjax.train.target_features`, reused every epoch).

    samples: a sequence of sample dicts (`feature_sample` layouts) or .safetensors paths (loaded when a batch
    needs them). Each sample is shifted, cut into pieces of at most total_seq_len positions (each piece its
    own document) and packed greedily; epoch e shuffles the sample order with `seed + e`. Batch i is rows
    [i*B, (i+1)*B) of the concatenated epochs (a batch never straddles two epochs). Batches are dicts of
    [B, S] input_ids / loss_mask / document_ids and [B, S, A*Ht] hidden_states, [B, S, Ht]
    verifier_last_hidden_states, already shifted: `train_drafter` takes them in place of raw token rows."""

    def __init__(self, samples: Sequence, total_seq_len: int, batch_rows: int, seed: int = 0, shuffle: bool = True):
        if not samples:
            raise DataError("no offline feature samples")
        self.samples, self.total_seq_len, self.batch_rows = samples, total_seq_len, batch_rows
        self.seed, self.shuffle = seed, shuffle
        self._lengths = [self._length(i) for i in range(len(samples))]
        self._plans: dict[int, list] = {}
        first = self._plan(0)
        if len(first) < batch_rows:
            raise DataError(f"the samples pack into {len(first)} rows of {total_seq_len} positions, fewer than "
                            f"batch_rows={batch_rows}")
        self.batches_per_epoch = len(first) // batch_rows

    def _length(self, i: int) -> int:
        """Shifted positions of sample i (from the file header for paths)."""
        smp = self.samples[i]
        if isinstance(smp, (str, os.PathLike)):
            from pjax.checkpoint.safetensors import SafetensorsFile
            if not os.path.isfile(smp):
                raise DataError(f"{smp}: no such feature file")
            f = SafetensorsFile(smp)
            if "input_ids" not in f.keys() or len(f.shape("input_ids")) != 1:
                raise DataError(f"{smp}: expected an 'input_ids' tensor of shape [n], found tensors {sorted(f.keys())}")
            return f.shape("input_ids")[0] - 1
        return len(smp["input_ids"]) - 1

    def _load(self, i: int) -> dict:
        smp = self.samples[i]
        if isinstance(smp, (str, os.PathLike)):
            return load_feature_sample(smp)
        return feature_sample(smp, where=f"sample {i}")

    def _plan(self, e: int) -> list:
        """Rows of epoch e as lists of (sample index, start, length) pieces of shifted positions."""
        if e not in self._plans:
            order = np.arange(len(self.samples))
            if self.shuffle:
                order = np.random.default_rng(self.seed + e).permutation(len(self.samples))
            rows, cur, used, s = [], [], 0, self.total_seq_len
            for i in order:
                for start in range(0, self._lengths[i], s):
                    n = min(s, self._lengths[i] - start)
                    if used + n > s:
                        rows.append(cur)
                        cur, used = [], 0
                    cur.append((int(i), start, n))
                    used += n
            if cur:
                rows.append(cur)
            self._plans = {e: rows}
        return self._plans[e]

    def batch(self, index: int) -> dict:
        e, r = divmod(int(index), self.batches_per_epoch)
        plan = self._plan(e)[r * self.batch_rows:(r + 1) * self.batch_rows]
        cache: dict[int, dict] = {}
        rows = []
        for pieces in plan:
            for i, _, _ in pieces:
                if i not in cache:
                    cache[i] = _shifted(self._load(i))
            rows.append(_feature_row([{k: v[a:a + n] for k, v in cache[i].items()} for i, a, n in pieces],
                                     self.total_seq_len))
        return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

    def fingerprint(self) -> str:
        """A hash of the samples (each file's path and size, or each in-memory sample's arrays), the row geometry
        and the shuffling seed."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.total_seq_len, self.batch_rows, self.seed, self.shuffle)).encode())
        for smp in self.samples:
            if isinstance(smp, (str, os.PathLike)):
                h.update(f"{os.path.abspath(smp)}:{os.path.getsize(smp)}".encode())
            else:
                for k in sorted(smp):
                    h.update(k.encode())
                    h.update(np.ascontiguousarray(smp[k]).tobytes())
        return h.hexdigest()

    def __iter__(self) -> Iterator[dict]:
        i = 0
        while True:
            yield self.batch(i)
            i += 1
