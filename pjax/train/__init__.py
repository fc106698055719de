"""Training drafter heads (P-EAGLE and EAGLE-3) against a frozen target, and a target on next-token prediction.

The curated API; the parts live in submodules: `cod` (COD sampling, partitioning), `masks`, `losses`,
`eagle3`, `data` (documents, packing, streams, vocabularies, offline features), `step`, `loop`, `checkpoint`
(orbax training checkpoints), `replay` (greedy parallel decoding replayed from teacher forcing), `target_lm`.
"""
from pjax.models.sharding import make_mesh
from pjax.train.cod import CodConfig, cod_sample
from pjax.train.config import TrainConfig
from pjax.train.data import (FeatureStream, RowStream, build_vocab_mapping, chat_document, load_documents,
                             save_feature_sample, text_document, token_frequencies)
from pjax.train.eagle3 import eagle3_loss
from pjax.train.heads import drafter_config_for_target, init_drafter_for_target
from pjax.train.loop import TrainResult, evaluate_drafter, train_drafter
from pjax.train.losses import draft_logits, peagle_loss
from pjax.train.optim import OptimConfig
from pjax.train.state import TrainState
from pjax.train.target_features import target_features
from pjax.train.target_lm import train_target_lm

__all__ = ["CodConfig", "FeatureStream", "OptimConfig", "RowStream", "TrainConfig", "TrainResult", "TrainState",
           "build_vocab_mapping", "chat_document", "cod_sample", "draft_logits", "drafter_config_for_target",
           "eagle3_loss", "evaluate_drafter", "init_drafter_for_target", "load_documents", "make_mesh", "peagle_loss",
           "save_feature_sample", "target_features", "text_document", "token_frequencies", "train_drafter",
           "train_target_lm"]
