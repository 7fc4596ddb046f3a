"""Engram tables and their optimizer state on one rank, keyed by the options that decide them.

Each function answers for one option, so that a new value (a table optimizer, a table dtype)
is one registry entry here, as it is one entry in ``training/engram_optimizer``:

- ``engram_table_dtype``: bytes per table element (``TABLE_DTYPE_BYTES``);
- ``engram_optimizer`` (with ``engram_optimizer_state_dtype``): the persistent state per table
  element (``moment_bytes_per_element``: two float32 moments for ``adam`` and ``sparse_adam``, a
  per-element first moment plus one row moment per row for ``rowwise_adam``: float32, bf16 with
  fp8 tables; none for frozen fp8 tables) and the step's
  transient bytes (``TABLE_OPTIMIZER_STEP``: ``adam`` builds a dense float32 gradient of the
  shard, the sparse optimizers touch rows only);
- a float32 master copy when the table is not float32 and ``engram_master_weights`` is on, or
  with optimizer-state offload (``master_bytes_per_element``);
- ``engram_table_placement`` / ``engram_offload_embedding_optimizer_states``: which memory holds
  what (``placement_of``).

The rows a step touches travel as (row, float32 value) pairs: gradient rows of one step are
``tokens x heads`` rows per Engram layer at most.
"""

from __future__ import annotations

TABLE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1}  # fp8: plus its scales (table_items)
TABLE_OPTIMIZER_STEP = {"sparse_adam": 0, "rowwise_adam": 0, "adam": 12.5}
"""Transient bytes per table element during the step: ``adam``'s dense float32 gradient of the
shard (4) and torch AdamW's temporaries (measured: a first AdamW step on 25M float32 elements
raised peak RSS by 20.5 bytes per element, 8 of them the moments it creates); the sparse
optimizers touch rows only."""


def moment_bytes_per_element(config) -> float:
    """Persistent optimizer state per table element (``engram/host_table.table_bytes_per_param``
    is the same rule, per parameter with the value and master)."""
    if config.engram_table_dtype == "fp8_e4m3" and config.engram_freeze_tables:
        return 0.0  # fixed data: no optimizer state
    if config.engram_optimizer != "rowwise_adam":
        return 8.0
    first = 2 if config.engram_optimizer_state_dtype == "bf16" else 4
    width = config.n_embed_per_ngram // config.n_head_per_ngram
    row = 2 if config.engram_table_dtype == "fp8_e4m3" else 4  # fp8: a bf16 row moment
    return first + row / width


def master_bytes_per_element(table_dtype: str, offload: bool, placement: str,
                             master_weights: bool = True) -> int:
    """A float32 master: for non-float32 tables unless ``engram_master_weights=false``
    (stochastic rounding instead), and with offload (device tables only)."""
    if table_dtype != "fp32":
        return 4 if master_weights else 0
    return 4 if offload and placement == "device" else 0


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
    master_weights = bool(config.engram_master_weights)
    width = config.n_embed_per_ngram // config.n_head_per_ngram
    table_bytes = elements * TABLE_DTYPE_BYTES[dtype]
    if dtype == "fp8_e4m3":  # one E8M0 byte per row and block of 32 columns
        table_bytes += -(-elements * -(-width // 32) // width)
        master_weights = False
    items = [
        (f"engram_tables_{dtype}", where["table"], table_bytes),
        ("engram_table_moments", where["moments"], int(elements * moment_bytes_per_element(config))),
        ("engram_table_master", where["master"],
         elements * master_bytes_per_element(dtype, offload, placement, master_weights)),
        ("engram_gradient_rows", "device", rows_touched * width * 4 * 2),  # rows + coalesced sums
        ("engram_table_step", where["step"], int(elements * TABLE_OPTIMIZER_STEP[config.engram_optimizer])),
    ]
    return [item for item in items if item[2]]
