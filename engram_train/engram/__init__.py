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
from engram_train.engram.v41_ngram_hash import DeepseekV41EngramArgs, DeepseekV41NgramHashMapping
from engram_train.engram.v41_engram_module import DeepseekV41Engram
from engram_train.engram.variant import build_hash_mapping, engram_branch_class

__all__ = [
    "CompressedTokenizer",
    "DeepseekV41Engram",
    "DeepseekV41EngramArgs",
    "DeepseekV41NgramHashMapping",
    "Engram",
    "MultiHeadEmbedding",
    "ShortConv",
    "build_hash_mapping",
    "engram_branch_class",
    "load_reference_state_dict",
    "mark_engram_param",
    "partition_invariant_normal_",
    "NgramHashMapping",
    "engram_head_vocab_sizes",
    "head_offsets",
    "layer_multipliers",
]
