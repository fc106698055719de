"""Test harness: a tiny byte-level Llama target, a random P-EAGLE head for it and a stream of packed rows cut from
a standard-library file, for the training-step tests."""
from __future__ import annotations

import os
from typing import Optional

import jax

from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.target import init_target
from pjax.train.cod import CodConfig
from pjax.train.config import TrainConfig
from pjax.train.data import ByteTokenizer, RowStream, text_document
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.optim import OptimConfig


def byte_training_setup(seq_len: int, rows: int, *, draft_vocab_size: int, num_depths: int,
                        max_anchors: Optional[int]):
    """(target, drafter, stream, cfg): a 2-layer 32-wide target, a 1-layer head with `draft_vocab_size` draft ids and
    `num_depths` depths, 30 documents of 90-201 bytes packed into rows of seq_len, a 4-step TrainConfig."""
    tok = ByteTokenizer()
    tcfg = ModelConfig("llama", tok.vocab_size, 32, 64, 4, tuple(LayerSpec(8, 2, RopeSpec()) for _ in range(2)))
    target = init_target(tcfg, jax.random.key(0), scale=0.1)
    dcfg = drafter_config_for_target(tcfg, num_layers=1, draft_vocab_size=draft_vocab_size,
                                     mask_token_id=tok.mask_token_id, num_depths=num_depths, aux_layer_ids=(0, 1, 2))
    drafter = init_drafter_for_target(target, dcfg, jax.random.key(1))
    text = open(os.__file__).read()
    docs = [text_document(text[i * 200:i * 200 + 90 + 37 * (i % 4)], tok, tok.bos_token_id) for i in range(30)]
    stream = RowStream(docs, seq_len, rows, seed=1)
    cfg = TrainConfig(total_seq_len=seq_len, batch_rows=rows, total_steps=4,
                      cod=CodConfig(num_depths=num_depths, max_anchors=max_anchors),
                      optim=OptimConfig(lr=1e-3, warmup_steps=1))
    return target, drafter, stream, cfg
