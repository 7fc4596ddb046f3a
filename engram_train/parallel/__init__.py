"""Engram parallelism: process groups and sharded table lookups (docs/embedding-parallel.md)."""

from engram_train.parallel.lookup import (
    AllReduceLookup,
    AllToAllLookup,
    engram_embedding_parallel,
    row_range,
)
from engram_train.parallel.groups import (
    destroy_engram_parallel,
    get_engram_data_parallel_group,
    get_engram_data_parallel_rank,
    get_engram_data_parallel_world_size,
    get_engram_embedding_parallel_group,
    get_engram_embedding_parallel_rank,
    get_engram_embedding_parallel_world_size,
    get_engram_model_parallel_group,
    initialize_engram_parallel,
    is_engram_parallel_initialized,
    table_gradient_groups,
)

__all__ = [
    "AllReduceLookup",
    "AllToAllLookup",
    "destroy_engram_parallel",
    "engram_embedding_parallel",
    "get_engram_data_parallel_group",
    "get_engram_data_parallel_rank",
    "get_engram_data_parallel_world_size",
    "get_engram_embedding_parallel_group",
    "get_engram_embedding_parallel_rank",
    "get_engram_embedding_parallel_world_size",
    "get_engram_model_parallel_group",
    "initialize_engram_parallel",
    "is_engram_parallel_initialized",
    "row_range",
    "table_gradient_groups",
]
