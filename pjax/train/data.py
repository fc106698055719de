"""Training data: tokenised documents, packing into fixed-length rows, the EAGLE shift (spec D.1).

A `Document` is `tokens [n] int32` + `loss_mask [n] int32` (1 = supervised, e.g. assistant tokens).
Documents are packed greedily into rows of `total_seq_len` (`PackedRow`: tokens, loss_mask,
document_ids with -1 padding). The frozen target sees the raw (unshifted) row; the drafter sees the
EAGLE-shifted row, built by `shift_index` / `eagle_shift` inside jit: shifted slot p of a document
pairs token x_{p+1}, target feature g_p, target distribution from y_{p+1} and loss flag l_{p+1}
(speculators `shift_batch`, applied per document before packing). The shifted row keeps the length
`total_seq_len`; each document gives up one slot, which becomes padding at the end of the row.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Iterator, Optional, Sequence

import jax.numpy as jnp
import numpy as np


class DataError(ValueError):
    """Malformed training data; the message names the file / row and what was expected."""


@dataclasses.dataclass
class Document:
    tokens: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] int32 (0/1)

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, np.int32)
        if self.tokens.shape != self.loss_mask.shape or self.tokens.ndim != 1:
            raise DataError(f"document tokens {self.tokens.shape} and loss_mask {self.loss_mask.shape} must be "
                            f"equal 1-D shapes")


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, then pad, bos, eos, mask (vocab_size 260 by default).

    Implements `encode`, `decode` and a minimal `apply_chat_template` so chat rows work without a
    Hugging Face tokenizer (tests, the tiny end-to-end example).
    """

    def __init__(self, extra_vocab: int = 0):
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.mask_token_id = 256, 257, 258, 259
        self.vocab_size = 260 + extra_vocab

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True):
        ids = [self.bos_token_id]
        for m in messages:
            ids += self.encode(f"<|{m['role']}|>\n") + self.encode(m["content"]) + [self.eos_token_id]
        if add_generation_prompt:
            ids += self.encode("<|assistant|>\n")
        return ids


def _template_ids(tokenizer, messages, add_generation_prompt):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def chat_document(messages: Sequence[dict], tokenizer) -> Document:
    """Render a chat with the tokenizer's chat template; loss_mask = 1 on assistant turns.

    Each assistant turn i covers the tokens between the rendering of messages[:i] with a
    generation prompt and the rendering of messages[:i+1] (the usual prefix-difference method).
    """
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"chat message {j} must be a dict with 'role' and 'content', got {m!r}")
    full = _template_ids(tokenizer, messages, False)
    mask = np.zeros(len(full), np.int32)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:i], True)) if i else 0
        end = len(_template_ids(tokenizer, messages[:i + 1], False))
        mask[start:min(end, len(full))] = 1
    return Document(np.asarray(full, np.int32), mask)


def text_document(text: str, tokenizer, bos: Optional[int] = None) -> Document:
    """Plain text: every token is supervised (loss_mask 1), optional leading BOS (not supervised)."""
    ids = [int(i) for i in tokenizer.encode(text)]
    mask = [1] * len(ids)
    if bos is not None:
        ids, mask = [bos] + ids, [0] + mask
    return Document(np.asarray(ids, np.int32), np.asarray(mask, np.int32))


def row_to_document(row: dict, tokenizer, *, where: str = "") -> Document:
    """A jsonl row: {"input_ids", "loss_mask"} (pre-tokenised), {"messages"|"conversations"} (chat)
    or {"text"} (plain text)."""
    if "input_ids" in row:
        ids = np.asarray(row["input_ids"], np.int32)
        lm = np.asarray(row.get("loss_mask", np.ones_like(ids)), np.int32)
        return Document(ids, lm)
    msgs = row.get("messages", row.get("conversations"))
    if msgs is not None:
        if tokenizer is None:
            raise DataError(f"{where}: chat rows need a tokenizer")
        return chat_document(msgs, tokenizer)
    if "text" in row:
        if tokenizer is None:
            raise DataError(f"{where}: text rows need a tokenizer")
        return text_document(row["text"], tokenizer, getattr(tokenizer, "bos_token_id", None))
    raise DataError(f"{where}: expected one of 'input_ids', 'messages', 'conversations', 'text'; "
                    f"found keys {sorted(row)}")


def load_documents(paths: Sequence[str], tokenizer=None) -> list[Document]:
    """Read documents from .jsonl files (one row per line, see `row_to_document`) or any other text
    file (the whole file is one plain-text document)."""
    docs = []
    for path in paths:
        if str(path).endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{n}: invalid JSON ({e})") from None
                        docs.append(row_to_document(row, tokenizer, where=f"{path}:{n}"))
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append(text_document(f.read(), tokenizer, getattr(tokenizer, "bos_token_id", None)))
    return docs


def default_corpus_files(max_files: int = 24, min_bytes: int = 4000, max_bytes: int = 60000) -> list[str]:
    """A small, always-available corpus: Python standard-library source files (sorted, deterministic)."""
    root = os.path.dirname(os.__file__)
    files = []
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if name.endswith(".py") and os.path.isfile(p) and min_bytes <= os.path.getsize(p) <= max_bytes:
            files.append(p)
    return files[:max_files]


@dataclasses.dataclass
class PackedRow:
    tokens: np.ndarray  # [S] int32 (pad 0)
    loss_mask: np.ndarray  # [S] int32
    document_ids: np.ndarray  # [S] int32, 0.. per document, -1 = padding


def split_document(doc: Document, max_len: int, min_len: int = 2) -> list[Document]:
    """Cut a long document into consecutive pieces of at most max_len tokens (pieces < min_len dropped)."""
    out = []
    for s in range(0, len(doc.tokens), max_len):
        piece = Document(doc.tokens[s:s + max_len], doc.loss_mask[s:s + max_len])
        if len(piece.tokens) >= min_len:
            out.append(piece)
    return out


def pack_documents(docs: Iterable[Document], total_seq_len: int, pad_id: int = 0) -> list[PackedRow]:
    """Greedy in-order packing into rows of total_seq_len (documents longer than a row are split;
    documents shorter than 2 tokens are dropped since the EAGLE shift leaves nothing of them)."""
    rows, cur = [], []
    used = 0

    def flush():
        nonlocal cur, used
        if not cur:
            return
        toks = np.full(total_seq_len, pad_id, np.int32)
        lm = np.zeros(total_seq_len, np.int32)
        doc = np.full(total_seq_len, -1, np.int32)
        o = 0
        for k, d in enumerate(cur):
            n = len(d.tokens)
            toks[o:o + n], lm[o:o + n], doc[o:o + n] = d.tokens, d.loss_mask, k
            o += n
        rows.append(PackedRow(toks, lm, doc))
        cur, used = [], 0

    for d in docs:
        for piece in split_document(d, total_seq_len):
            if used + len(piece.tokens) > total_seq_len:
                flush()
            cur.append(piece)
            used += len(piece.tokens)
    flush()
    return rows


def stack_rows(rows: Sequence[PackedRow]) -> dict:
    """Batch of rows -> dict of [B, S] int32 numpy arrays (tokens, loss_mask, document_ids)."""
    return {k: np.stack([getattr(r, k) for r in rows]) for k in ("tokens", "loss_mask", "document_ids")}


class RowStream:
    """Deterministic batches of packed rows for step-indexed training (exact resume).

    Epoch e shuffles the document order with `seed + e` and packs; batch `i` is rows
    [i*B, (i+1)*B) of the concatenated epochs (a batch never straddles two epochs: the tail of an
    epoch that does not fill a batch is dropped). The data position is just the batch index.
    """

    def __init__(self, docs: Sequence[Document], total_seq_len: int, batch_rows: int, seed: int = 0,
                 shuffle: bool = True, pad_id: int = 0):
        if not docs:
            raise DataError("no training documents")
        self.docs, self.total_seq_len, self.batch_rows = list(docs), total_seq_len, batch_rows
        self.seed, self.shuffle, self.pad_id = seed, shuffle, pad_id
        self._epochs: dict[int, list[PackedRow]] = {}
        first = self._epoch(0)
        if len(first) < batch_rows:
            raise DataError(f"the corpus packs into {len(first)} rows of {total_seq_len} tokens, fewer than "
                            f"batch_rows={batch_rows}")
        self.batches_per_epoch = len(first) // batch_rows

    def _epoch(self, e: int) -> list[PackedRow]:
        if e not in self._epochs:
            order = np.arange(len(self.docs))
            if self.shuffle:
                order = np.random.default_rng(self.seed + e).permutation(len(self.docs))
            self._epochs = {e: pack_documents([self.docs[i] for i in order], self.total_seq_len, self.pad_id)}
        return self._epochs[e]

    def batch(self, index: int) -> dict:
        e, i = divmod(int(index), self.batches_per_epoch)
        rows = self._epoch(e)[i * self.batch_rows:(i + 1) * self.batch_rows]
        return stack_rows(rows)

    def __iter__(self) -> Iterator[dict]:
        i = 0
        while True:
            yield self.batch(i)
            i += 1


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


# ----------------------------------------------------------------------------------- EAGLE shift


def shift_index(document_ids):
    """document_ids [..., S] (contiguous documents, -1 padding) -> src [..., S] int32: the raw index of
    token x_{p+1} for shifted slot p (its target feature g_p is at src-1), -1 for padding slots.

    Raw index i that is not the first of its document moves to slot i - (number of document starts
    at or before i). Pure jnp (usable inside jit)."""
    doc = jnp.asarray(document_ids, jnp.int32)
    s = doc.shape[-1]
    prev = jnp.concatenate([jnp.full(doc.shape[:-1] + (1,), -2, jnp.int32), doc[..., :-1]], axis=-1)
    is_start = (doc != -1) & (doc != prev)
    keep = (doc != -1) & ~is_start
    dest = jnp.arange(s, dtype=jnp.int32) - jnp.cumsum(is_start.astype(jnp.int32), axis=-1)
    dest = jnp.where(keep, dest, s)
    flat_dest = dest.reshape(-1, s)
    src_vals = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), flat_dest.shape)
    out = jnp.full(flat_dest.shape, -1, jnp.int32)
    rows = jnp.arange(flat_dest.shape[0])[:, None]
    out = out.at[rows, flat_dest].set(src_vals, mode="drop")
    return out.reshape(doc.shape)


def _take(x, idx, fill=0):
    """x [S, ...] gathered at idx [S] (-1 -> fill)."""
    g = jnp.take(x, jnp.clip(idx, 0, x.shape[0] - 1), axis=0)
    ok = (idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(ok, g, jnp.asarray(fill, x.dtype))


def eagle_shift(tokens, loss_mask, document_ids, aux=None, final=None):
    """Shift one raw packed row ([S] arrays; aux [S, A*Ht], final [S, Ht] target features or None).

    Returns dict(input_ids, loss_mask, document_ids, hidden_states, verifier_last_hidden_states, src),
    all of length S (shifted layout of spec D.1; padding: token 0, loss 0, doc -1, zero features)."""
    src = shift_index(document_ids)
    out = dict(input_ids=_take(jnp.asarray(tokens, jnp.int32), src),
               loss_mask=_take(jnp.asarray(loss_mask, jnp.int32), src),
               document_ids=_take(jnp.asarray(document_ids, jnp.int32), src, -1), src=src)
    out["hidden_states"] = None if aux is None else _take(aux, jnp.where(src >= 0, src - 1, -1))
    out["verifier_last_hidden_states"] = None if final is None else _take(final, src)
    return out


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
    from convert.safetensors_io import save_file
    save_file(feature_sample(sample, where=str(path)), path)


def load_feature_sample(path) -> dict:
    """Read a .safetensors sample written by `save_feature_sample` (or with the same tensor names)."""
    from convert.safetensors_io import SafetensorsFile
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
            from convert.safetensors_io import SafetensorsFile
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

    def __iter__(self) -> Iterator[dict]:
        i = 0
        while True:
            yield self.batch(i)
            i += 1
