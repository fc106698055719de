"""Training documents: `Document` (tokens [n] int32 + loss_mask [n] int32, 1 = supervised, e.g. assistant
tokens) from chats (the tokenizer's chat template, loss on assistant turns), plain text or pre-tokenised jsonl rows;
`ByteTokenizer` for byte-level toy runs; a default corpus of Python standard-library sources."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["ByteTokenizer", "DataError", "Document", "chat_document", "check_token_ids", "default_corpus_files",
           "load_documents", "row_to_document", "text_document"]


class DataError(ValueError):
    """Malformed training data; the message names the file / row and what was expected."""


@dataclasses.dataclass
class Document:
    tokens: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] int32 (0/1)
    source: str = ""  # where it was read ("FILE:LINE", "FILE"), for error messages

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
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "input_ids" in row:
        ids = _int_list(row["input_ids"], "input_ids", where)
        lm = np.ones_like(ids) if row.get("loss_mask") is None else _int_list(row["loss_mask"], "loss_mask", where)
        if lm.shape != ids.shape or not np.isin(lm, (0, 1)).all():
            raise DataError(f"{where}: loss_mask must be {ids.size} values of 0 / 1 (one per input id)")
        return Document(ids, lm, where)
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


def _int_list(value, name: str, where: str) -> np.ndarray:
    """A row's list of integers -> int32 [n] (floats, strings, nesting and values past int32 are DataErrors)."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(f"{where}: {name} must be a list of integers")
    if value and not -2 ** 31 <= min(value) <= max(value) < 2 ** 31:
        raise DataError(f"{where}: {name} holds values outside int32")
    return np.asarray(value, np.int32)


def check_token_ids(docs: Sequence[Document], vocab_size: int) -> None:
    """DataError naming the first document (its source: file and line) with a token id outside [0, vocab_size)."""
    for i, d in enumerate(docs):
        bad = np.flatnonzero((d.tokens < 0) | (d.tokens >= vocab_size))
        if bad.size:
            raise DataError(f"{d.source or f'document {i}'}: token id {int(d.tokens[bad[0]])} (position "
                            f"{int(bad[0])}) is outside the target's vocabulary [0, {vocab_size})")


def _read_error(path, e: OSError) -> DataError:
    if isinstance(e, FileNotFoundError):
        return DataError(f"{path}: no such file")
    if isinstance(e, IsADirectoryError):
        return DataError(f"{path}: is a directory, expected a training file (.jsonl or text)")
    return DataError(f"{path}: cannot be read ({e.strerror or e})")


def load_documents(paths: Sequence[str], tokenizer=None, *, vocab_size: Optional[int] = None) -> list[Document]:
    """Read documents from .jsonl files (one row per line, see `row_to_document`) or any other text
    file (the whole file is one plain-text document). Every error is a DataError naming the file and line;
    vocab_size: token ids must lie in [0, vocab_size) (`check_token_ids`)."""
    docs = []
    for path in paths:
        try:
            if str(path).endswith(".jsonl"):
                with open(path, encoding="utf-8") as f:
                    n = 0
                    try:
                        for n, line in enumerate(f, 1):
                            if line.strip():
                                docs.append(_jsonl_document(line, tokenizer, f"{path}:{n}"))
                    except UnicodeDecodeError:
                        raise DataError(f"{path}: not UTF-8 text (after line {n})") from None
            else:
                if tokenizer is None:
                    raise DataError(f"{path}: text files need a tokenizer")
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                doc = _checked(f"{path}", text_document, text, tokenizer, getattr(tokenizer, "bos_token_id", None))
                docs.append(dataclasses.replace(doc, source=str(path)))
        except OSError as e:
            raise _read_error(path, e) from None
    if vocab_size is not None:
        check_token_ids(docs, vocab_size)
    return docs


def _jsonl_document(line: str, tokenizer, where: str) -> Document:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{where}: invalid JSON ({getattr(e, 'msg', e)})") from None
    doc = _checked(where, row_to_document, row, tokenizer, where=where)
    return dataclasses.replace(doc, source=where)


def _checked(at: str, fn, *args, **kwargs):
    """fn(...), its failures (a tokenizer or chat template refusing the row) as a DataError led by `at`."""
    try:
        return fn(*args, **kwargs)
    except DataError as e:
        raise e if str(e).startswith(at) else DataError(f"{at}: {e}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise DataError(f"{at}: {type(e).__name__}: {e}") from None


def default_corpus_files(max_files: int = 24, min_bytes: int = 4000, max_bytes: int = 60000) -> list[str]:
    """A small, always-available corpus: Python standard-library source files (sorted, deterministic)."""
    root = os.path.dirname(os.__file__)
    files = []
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if name.endswith(".py") and os.path.isfile(p) and min_bytes <= os.path.getsize(p) <= max_bytes:
            files.append(p)
    return files[:max_files]
