"""The data stages: the corpus (`corpus`), its BPE tokenizer (`bpe`), every file's tokens; and their readers."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np

from examples.code_pair.corpus import (DEFAULT_PACKAGES, CorpusPackage, benchmark_prompts, collect_corpus, read_texts,
                                       write_prompts)
from examples.code_pair.bpe import SPECIAL_TOKENS, train_bpe_tokenizer, write_tokenizer_files
from examples.code_pair.recipe import RecipeError


def stage_corpus(b, work: Path) -> dict:
    r = b.recipe
    known = {p.name: p for p in DEFAULT_PACKAGES}
    unknown = [n for n in r.packages if n not in known]
    if unknown:
        raise RecipeError(f"--packages: {unknown} are not in the recipe's licence table "
                          f"(examples.code_pair.corpus.DEFAULT_PACKAGES: {sorted(known)})")
    pkgs: list[CorpusPackage] = [known[n] for n in r.packages]
    m = collect_corpus(work, pkgs, held_out_fraction=r.held_out_fraction, include_tests=r.include_tests,
                       max_file_bytes=r.max_file_bytes, max_files=r.max_files, progress=b.progress)
    prompts = benchmark_prompts(read_texts(work / "held_out.jsonl"), read_texts(work / "train.jsonl"),
                                max_prompts=r.prompts)
    if len(prompts) < r.min_prompts:
        raise RecipeError(f"the held-out files yield {len(prompts)} benchmark prompts, fewer than --min-prompts "
                          f"{r.min_prompts}: raise --held-out-fraction or add packages")
    write_prompts(prompts, work / "prompts.jsonl")
    absent = [p["name"] for p in m["packages"] if not p["installed"]]
    b.log(f"corpus: {m['train']['files']} training files ({m['train']['bytes'] / 1e6:.1f} MB), "
          f"{m['held_out']['files']} held out ({m['held_out']['fraction_of_files']:.1%}), {len(prompts)} prompts; "
          f"sha256 {m['sha256'][:16]}; not installed: {absent or 'none'}")
    return dict(sha256=m["sha256"], train=m["train"], held_out=m["held_out"], prompts=len(prompts), absent=absent)


def _sample(b):
    """Training texts for the tokenizer: files in sha256-of-name order up to tokenizer_sample_bytes."""
    texts = sorted(read_texts(b.dir("corpus") / "train.jsonl"), key=lambda t: hashlib.sha256(t[0].encode()).digest())
    out, total = [], 0
    for _, text in texts:
        if total >= b.recipe.tokenizer_sample_bytes:
            break
        out.append(text)
        total += len(text.encode("utf-8"))
    return out, total


def stage_tokenizer(b, work: Path) -> dict:
    texts, nbytes = _sample(b)
    t0 = time.time()
    tok = train_bpe_tokenizer(texts, b.recipe.vocab_size, length=len(texts), progress=b.progress)
    write_tokenizer_files(tok, work, model_max_length=b.recipe.target_seq_len)
    b.log(f"tokenizer: {tok.get_vocab_size()} ids from {len(texts)} files ({nbytes / 1e6:.1f} MB) in "
          f"{time.time() - t0:.0f} s")
    return dict(vocab_size=tok.get_vocab_size(), sample_files=len(texts), sample_bytes=nbytes)


def load_tokenizer(b):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(b.dir("tokenizer") / "tokenizer.json"))


def special_ids(b) -> dict:
    tok = load_tokenizer(b)
    return {k: tok.token_to_id(v) for k, v in SPECIAL_TOKENS.items()}


def stage_tokens(b, work: Path) -> dict:
    tok, ids = load_tokenizer(b), special_ids(b)
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    out = {}
    for split in ("train", "held_out"):
        files = list(read_texts(b.dir("corpus") / f"{split}.jsonl"))
        bar = b.bar(len(files), f"tokenize {split}", unit="file")
        chunks, lengths = [], []
        for i in range(0, len(files), 256):
            for enc in tok.encode_batch([t for _, t in files[i:i + 256]], add_special_tokens=False):
                chunks.append(np.asarray([ids["bos_token"]] + enc.ids + [ids["eos_token"]], dtype))
                lengths.append(len(chunks[-1]))
            if bar is not None:
                bar.update(min(256, len(files) - i))
        if bar is not None:
            bar.close()
        np.save(work / f"{split}.npy", np.concatenate(chunks))
        np.save(work / f"{split}_offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        out[split] = dict(files=len(files), tokens=int(sum(lengths)))
    b.log(f"tokens: {out['train']['tokens'] / 1e6:.2f} M training tokens in {out['train']['files']} files, "
          f"{out['held_out']['tokens'] / 1e6:.2f} M held out")
    return out


def documents(b, split: str):
    """The split's files as `Document`s (BOS not supervised)."""
    from pjax.train.data import Document
    toks = np.load(b.dir("tokens") / f"{split}.npy")
    offs = np.load(b.dir("tokens") / f"{split}_offsets.npy")
    docs = []
    for a, e in zip(offs[:-1], offs[1:]):
        mask = np.ones(e - a, np.int32)
        mask[0] = 0
        docs.append(Document(toks[a:e], mask))
    return docs


