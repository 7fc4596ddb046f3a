"""Serving an Engram export: incremental hashing, host-table gathers, the dense part.

`EngramMemory` opens an export written by ``engram-export`` (tables memory-mapped, never read
whole) and runs the three per-step stages a serving stack needs; docs/export.md shows the loop.
"""

from engram_train.inference.hashing import IncrementalNgramHasher
from engram_train.inference.memory import EngramMemory, EngramState, load_layer_state

__all__ = ["EngramMemory", "EngramState", "IncrementalNgramHasher", "load_layer_state"]
