"""Training data: documents, packing into rows, the EAGLE shift, draft vocabularies, offline feature files."""
from pjax.train.data.documents import (ByteTokenizer, DataError, Document, chat_document, default_corpus_files,
                                       load_documents, row_to_document, text_document)
from pjax.train.data.features import (FEATURE_KEYS, FeatureStream, feature_sample, load_feature_sample,
                                      save_feature_sample, shift_and_pack_features)
from pjax.train.data.packing import PackedRow, RowStream, pack_documents, split_document, stack_rows
from pjax.train.data.shift import eagle_shift, shift_index
from pjax.train.data.vocab import build_vocab_mapping, token_frequencies

__all__ = ["FEATURE_KEYS", "ByteTokenizer", "DataError", "Document", "FeatureStream", "PackedRow", "RowStream",
           "build_vocab_mapping", "chat_document", "default_corpus_files", "eagle_shift", "feature_sample",
           "load_documents", "load_feature_sample", "pack_documents", "row_to_document", "save_feature_sample",
           "shift_and_pack_features", "shift_index", "split_document", "stack_rows", "text_document",
           "token_frequencies"]
