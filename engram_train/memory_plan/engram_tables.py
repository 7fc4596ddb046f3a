"""Engram tables and their optimizer state on one rank, keyed by the options that decide them.

Each function answers for one option, so that a new value (a table optimizer, a table dtype)
is one registry entry here, as it is one entry in ``training/engram_optimizer``:

- ``engram_table_dtype``: bytes per table element (``TABLE_DTYPE_BYTES``);
- ``engram_optimizer``: the persistent state per table element and the step's transient bytes
  (``TABLE_OPTIMIZER_STATE``): both keep two float32 moments per element; ``adam`` also builds a
  dense float32 gradient of the shard for its step, ``sparse_adam`` touches rows only;
- a float32 master copy when the table is not float32, or with optimizer-state offload
  (``master_bytes_per_element``);
- ``engram_table_placement`` / ``engram_offload_embedding_optimizer_states``: which memory holds
  what (``placement_of``).

The rows a step touches travel as (row, float32 value) pairs: gradient rows of one step are
``tokens x heads`` rows per Engram layer at most.
"""

from __future__ import annotations

from dataclasses import dataclass

TABLE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class TableOptimizerState:
    state_per_element: int  # persistent bytes per table element (the moments)
    step_per_element: int  # transient bytes per table element during the step


TABLE_OPTIMIZER_STATE: dict[str, TableOptimizerState] = {
    "sparse_adam": TableOptimizerState(state_per_element=8, step_per_element=0),
    # dense float32 gradient + torch Adam's temporaries for the shard
    "adam": TableOptimizerState(state_per_element=8, step_per_element=8),
}


def master_bytes_per_element(table_dtype: str, offload: bool, placement: str) -> int:
    """A float32 master: for non-float32 tables, and with offload (device tables only)."""
    return 4 if table_dtype != "fp32" or (offload and placement == "device") else 0


def placement_of(placement: str, offload: bool) -> dict[str, str]:
    """Which memory ("device" or "host") holds the table, its master and its moments."""
    if placement == "host":
        return {"table": "host", "master": "host", "moments": "host", "step": "host"}
    state = "host" if offload else "device"
    return {"table": "device", "master": state, "moments": state, "step": state}




def table_items(config, elements: int, rows_touched: int) -> list[tuple[str, str, int]]:
    """``(item, memory, bytes)`` of one rank's tables: ``elements`` table elements on the
    rank, ``rows_touched`` gradient rows of one step (tokens x heads x Engram layers, the
    rank's share)."""
    if not elements:
        return []
    dtype = config.engram_table_dtype
    placement = config.engram_table_placement
    offload = bool(config.engram_offload_embedding_optimizer_states)
    where = placement_of(placement, offload)
    state = TABLE_OPTIMIZER_STATE[config.engram_optimizer]
    width = config.n_embed_per_ngram // config.n_head_per_ngram
    items = [
        (f"engram_tables_{dtype}", where["table"], elements * TABLE_DTYPE_BYTES[dtype]),
        ("engram_table_moments", where["moments"], elements * state.state_per_element),
        ("engram_table_master", where["master"],
         elements * master_bytes_per_element(dtype, offload, placement)),
        ("engram_gradient_rows", "device", rows_touched * width * 4 * 2),  # rows + coalesced sums
        ("engram_table_step", where["step"], elements * state.step_per_element),
    ]
    return [item for item in items if item[2]]
