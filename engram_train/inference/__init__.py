"""Serving an Engram export: incremental hashing, host-table gathers, the dense part.

`EngramMemory` opens an export written by ``engram-export`` (tables memory-mapped, never read
whole) and runs the three per-step stages a serving stack needs; docs/export.md shows the loop.
`load_layer_state` and `megatron_state_dict` hand the export's tensors to other consumers.
"""

from engram_train.engram.incremental_hash import IncrementalNgramHasher
from engram_train.inference.memory import EngramMemory, EngramState, gather_table_rows
from engram_train.inference.weights import load_layer_state, megatron_state_dict

__all__ = [
    "EngramMemory",
    "EngramState",
    "IncrementalNgramHasher",
    "gather_table_rows",
    "load_layer_state",
    "megatron_state_dict",
]
