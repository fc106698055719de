"""The README main job's pair: a tiny byte-level target trained on a small corpus (by default Python standard-library
sources, present on every machine), then a P-EAGLE (or EAGLE-3) head against it. `examples/train_peagle.py` runs it
and exports the head; minutes on 2 CPU cores.

What the result depends on, besides the seed: the corpus (the default is the running Python's standard library, whose
files differ between Python versions and releases: `corpus_fingerprint` names it) and the floating-point arithmetic of
the machine (XLA's CPU code depends on the instruction set and the thread count; a few hundred training steps carry a
rounding difference into different weights)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import Drafter
from pjax.models.target import Target, init_target
from pjax.train.cod import CodConfig
from pjax.train.data import ByteTokenizer, RowStream, build_vocab_mapping, load_documents, token_frequencies
from pjax.train.loop import train_drafter
from pjax.train.optim import OptimConfig
from pjax.train.config import TrainConfig
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.target_lm import train_target_lm


def tiny_target_config(vocab_size: int = 260, hidden: int = 64, layers: int = 4) -> ModelConfig:
    spec = LayerSpec(head_dim=16, num_kv_heads=2, rope=RopeSpec(theta=10000.0))
    return ModelConfig("llama", vocab_size, hidden, 2 * hidden, 4, (spec,) * layers, rms_norm_eps=1e-6).validate()


@dataclasses.dataclass
class TinyRun:
    target: Target
    drafter: Drafter
    tokenizer: ByteTokenizer
    target_history: list  # [(step, loss)]
    head_history: list  # summaries from train_drafter
    docs: list
    corpus: dict  # `corpus_fingerprint` of the files trained on


def stdlib_corpus(max_files: int = 12, min_bytes: int = 4000, max_bytes: int = 60000) -> list[str]:
    """The first `max_files` standard-library modules by name of min_bytes..max_bytes, leaving out
    `_sysconfigdata_*` (generated when Python is built: install paths and compiler flags, different on every
    machine)."""
    root = os.path.dirname(os.__file__)
    files = [os.path.join(root, n) for n in sorted(os.listdir(root))
             if n.endswith(".py") and not n.startswith("_sysconfigdata")
             and min_bytes <= os.path.getsize(os.path.join(root, n)) <= max_bytes]
    return files[:max_files]


def corpus_fingerprint(files: Sequence[str]) -> dict:
    """{"files": base names, "bytes", "sha256" over (name, content) in order, "python": the interpreter's version}:
    what tells two runs' corpora apart."""
    h, total = hashlib.sha256(), 0
    for f in files:
        data = open(f, "rb").read()
        h.update(os.path.basename(f).encode() + b"\t" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        total += len(data)
    return dict(files=[os.path.basename(f) for f in files], bytes=total, sha256=h.hexdigest(),
                python=platform.python_version())


def tiny_run(*, corpus_files: Optional[Sequence[str]] = None, objective: str = "peagle", seq_len: int = 128,
             batch_rows: int = 8, target_steps: int = 300, head_steps: int = 300, num_depths: int = 4,
             ttt_steps: int = 3, head_layers: int = 1, draft_vocab_size: Optional[int] = None, seed: int = 0,
             max_files: int = 12, checkpoint_dir=None, progress: bool = False, log_every: int = 25,
             log_fn=None, mesh=None, target: Optional[Target] = None,
             compiler_options: Optional[dict] = None) -> TinyRun:
    """Train a tiny target (unless given) and a head on it; returns both plus the metric histories."""
    tok = ByteTokenizer()
    files = list(corpus_files) if corpus_files else stdlib_corpus(max_files)
    docs = load_documents(files, tok)
    tcfg = tiny_target_config(tok.vocab_size)
    target_hist = []
    if target is None:
        target = init_target(tcfg, jax.random.key(seed), jnp.float32)
        stream = RowStream(docs, seq_len, batch_rows, seed=seed)
        target, target_hist = train_target_lm(target, stream, target_steps, progress=progress,
                                              log_every=log_every, log_fn=log_fn, compiler_options=compiler_options)
    vd = draft_vocab_size or tok.vocab_size
    d2t = None
    if vd < tok.vocab_size:
        d2t, _ = build_vocab_mapping(token_frequencies(docs), vd, tok.vocab_size)
    dcfg = drafter_config_for_target(target.config, num_layers=head_layers, draft_vocab_size=vd,
                                     mask_token_id=tok.mask_token_id, aux_layer_ids=(1, 2, 3),
                                     model_kind=objective, num_depths=num_depths if objective == "peagle" else None)
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(seed + 1), d2t=d2t)
    cfg = TrainConfig(objective=objective, total_seq_len=seq_len, batch_rows=batch_rows, total_steps=head_steps,
                      cod=CodConfig(num_depths=num_depths, max_anchors=None), ttt_steps=ttt_steps,
                      optim=OptimConfig(lr=3e-3, warmup_steps=10, train_embeddings=objective == "peagle"),
                      seed=seed)
    stream = RowStream(docs, seq_len, batch_rows, seed=seed + 100)
    res = train_drafter(target, drafter, stream, cfg, checkpoint_dir=checkpoint_dir, progress=progress,
                        log_every=log_every, log_fn=log_fn, mesh=mesh, compiler_options=compiler_options)
    return TinyRun(target, res.drafter, tok, target_hist, res.history, docs, corpus_fingerprint(files))
