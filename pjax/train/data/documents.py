"""Training documents: `Document` (tokens [n] int32 + loss_mask [n] int32, 1 = supervised, e.g. assistant
tokens) from chats (the tokenizer's chat template, loss on assistant turns), plain text or pre-tokenised jsonl rows;
`ByteTokenizer` for byte-level toy runs; a default corpus of Python standard-library sources."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["ByteTokenizer", "DataError", "Document", "chat_document", "default_corpus_files", "load_documents",
           "row_to_document", "text_document"]


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
