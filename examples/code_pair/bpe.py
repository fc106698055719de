"""A byte-level BPE tokenizer for source code, trained with the `tokenizers` library and written in the Hugging Face
layout (`tokenizer.json` + `tokenizer_config.json`), so `transformers.AutoTokenizer` loads it.

Pre-tokenization (a regular expression, then the byte-level alphabet): identifiers with their underscores and
digits (`__init__`, `float32`) and one leading non-letter (` self`, `.shape`); digits in groups of at most three;
runs of punctuation with an optional leading space and trailing newlines; newlines with the whitespace before
them; whitespace runs (indentation) that leave their last space to the next word. No normalization: decoding
returns the exact bytes. Special tokens take the first ids, in `SPECIAL_TOKENS` order: BOS, EOS, PAD, MASK (the
P-EAGLE mask token) and the two chat-turn markers. Encoding adds BOS in front (as Llama 3's tokenizer does;
`add_special_tokens=False` leaves it out); the chat template renders ChatML turns after BOS.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["CHAT_TEMPLATE", "PRETOKENIZE_PATTERN", "SPECIAL_TOKENS", "TOKENIZER_FILES", "train_bpe_tokenizer",
           "write_tokenizer_files"]

PRETOKENIZE_PATTERN = (r"[^\r\n\p{L}\p{N}_]?[\p{L}_][\p{L}\p{N}_]*|\p{N}{1,3}| ?[^\s\p{L}\p{N}_]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = dict(bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", mask_token="<|mask|>",
                      turn_start="<|im_start|>", turn_end="<|im_end|>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _new_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, length: Optional[int] = None,
                        progress: bool = False):
    """Train a byte-level BPE `tokenizers.Tokenizer` of `vocab_size` ids (special tokens and the 256-byte alphabet
    included) on `texts`; length: the number of texts, for the progress bar. Training is deterministic: the same
    texts in the same order give the same merges."""
    from tokenizers import pre_tokenizers, processors, trainers
    specials = list(SPECIAL_TOKENS.values())
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the {len(specials)} special tokens plus the "
                         f"{len(alphabet)}-byte alphabet")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=progress)
    tok.train_from_iterator(texts, trainer, length=length)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def write_tokenizer_files(tokenizer, out_dir, *, model_max_length: int = 4096) -> Path:
    """Write `tokenizer` (from `train_bpe_tokenizer`) into `out_dir` (created) as tokenizer.json,
    tokenizer_config.json (special tokens, chat template, PreTrainedTokenizerFast) and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, token in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) is None:
            raise ValueError(f"the tokenizer has no {key} {token!r}: train it with train_bpe_tokenizer")
    named = {k: SPECIAL_TOKENS[k] for k in ("bos_token", "eos_token", "pad_token", "mask_token")}
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=model_max_length,
                  clean_up_tokenization_spaces=False, add_prefix_space=False, chat_template=CHAT_TEMPLATE,
                  additional_special_tokens=[SPECIAL_TOKENS["turn_start"], SPECIAL_TOKENS["turn_end"]], **named)
    special_map = dict(named, additional_special_tokens=config["additional_special_tokens"])
    files = {"tokenizer.json": tokenizer.to_str(pretty=True),
             "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
             "special_tokens_map.json": json.dumps(special_map, indent=2) + "\n"}
    for name, text in files.items():
        tmp = out / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)
    return out
