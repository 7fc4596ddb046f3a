"""Engram core: compressed tokenizer, n-gram hashing, multi-head embedding tables, the module."""

from engram_train.engram.hashing import (
    NgramHashMapping,
    engram_head_vocab_sizes,
    head_offsets,
    layer_multipliers,
)
from engram_train.engram.tokenizer import CompressedTokenizer

__all__ = [
    "CompressedTokenizer",
    "NgramHashMapping",
    "engram_head_vocab_sizes",
    "head_offsets",
    "layer_multipliers",
]
