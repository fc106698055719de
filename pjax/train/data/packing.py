"""Packing documents into fixed-length rows (`PackedRow`: tokens, loss_mask, document_ids with -1 padding) and the
deterministic, step-indexed `RowStream` of batches (exact resume)."""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Iterator, Sequence

import numpy as np

from pjax.train.data.documents import DataError, Document

__all__ = ["PackedRow", "RowStream", "pack_documents", "split_document", "stack_rows"]


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

    def fingerprint(self) -> str:
        """A hash of every batch this stream yields: the documents (tokens, loss masks, order), the row geometry
        and the shuffling seed."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.total_seq_len, self.batch_rows, self.seed, self.shuffle, self.pad_id)).encode())
        for d in self.docs:
            h.update(np.int64(d.tokens.size).tobytes())
            h.update(d.tokens.tobytes())
            h.update(d.loss_mask.tobytes())
        return h.hexdigest()

    def __iter__(self) -> Iterator[dict]:
        i = 0
        while True:
            yield self.batch(i)
            i += 1
