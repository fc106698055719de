"""Training-side API (COD layouts, losses, the training loop). Re-exports only."""
from pjax.models.drafter import cod_attention_mask, draft_logits
from pjax.train.attention import CodMask, DocCausalMask, cod_dense_mask
from pjax.train.cod import (CodConfig, CodLayout, cod_budget, cod_capacities, cod_sample, layout_from_arrays,
                            partition_layout, partition_segment, segment_bounds)
from pjax.train.data import (ByteTokenizer, Document, FeatureStream, RowStream, build_vocab_mapping, chat_document,
                             default_corpus_files, eagle_shift, feature_sample, load_documents, load_feature_sample,
                             pack_documents, save_feature_sample, shift_and_pack_features, text_document,
                             token_frequencies)
from pjax.train.eagle3 import eagle3_loss, eagle3_row_loss
from pjax.train.features import target_features
from pjax.train.loop import TrainResult, train_drafter
from pjax.train.loss import peagle_loss, peagle_loss_and_metrics
from pjax.train.optim import OptimConfig, make_optimizer
from pjax.train.recipes import TinyRun, tiny_run, tiny_target_config
from pjax.train.state import (Checkpointer, TrainConfig, TrainState, drafter_config_for_target,
                              drafter_from_state, init_drafter_for_target, init_train_state)
from pjax.train.step import make_mesh, make_train_step, shard_target, train_step
from pjax.train.target_lm import train_target_lm

__all__ = [
    "ByteTokenizer", "Checkpointer", "CodConfig", "CodLayout", "CodMask", "DocCausalMask", "Document", "FeatureStream",
    "OptimConfig", "RowStream", "TinyRun", "TrainConfig", "TrainResult", "TrainState", "build_vocab_mapping",
    "chat_document",
    "cod_attention_mask", "cod_budget", "cod_capacities", "cod_dense_mask", "cod_sample", "default_corpus_files",
    "draft_logits", "drafter_config_for_target", "drafter_from_state", "eagle3_loss", "eagle3_row_loss",
    "eagle_shift", "feature_sample", "init_drafter_for_target", "init_train_state", "layout_from_arrays",
    "load_documents", "load_feature_sample",
    "make_mesh", "make_optimizer", "make_train_step", "pack_documents", "partition_layout", "peagle_loss",
    "peagle_loss_and_metrics", "partition_segment", "save_feature_sample", "segment_bounds", "shard_target",
    "shift_and_pack_features",
    "target_features", "text_document",
    "tiny_run", "tiny_target_config", "token_frequencies", "train_drafter", "train_step", "train_target_lm",
]
