"""Engram core: compressed tokenizer, n-gram hashing, multi-head embedding tables, the module."""

from engram_train.engram.tables import (
    MultiHeadEmbedding,
    mark_engram_param,
    partition_invariant_normal_,
)
from engram_train.engram.ngram_hash import (
    NgramHashMapping,
    engram_head_vocab_sizes,
    head_offsets,
    layer_multipliers,
)
from engram_train.engram.engram_module import Engram, ShortConv
from engram_train.engram.reference_io import load_reference_state_dict
from engram_train.engram.compressed_tokenizer import CompressedTokenizer

__all__ = [
    "CompressedTokenizer",
    "Engram",
    "MultiHeadEmbedding",
    "ShortConv",
    "load_reference_state_dict",
    "mark_engram_param",
    "partition_invariant_normal_",
    "NgramHashMapping",
    "engram_head_vocab_sizes",
    "head_offsets",
    "layer_multipliers",
]
