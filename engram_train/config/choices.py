"""The Engram options that take one of a few names: the names, and what each means.

Checked in one place (`EngramConfig`'s validation, `config/model.py`); the modules that
implement an option trust the validated value (the table optimizers:
``training/engram_optimizer.TABLE_OPTIMIZER_BUILDERS``).
"""

from __future__ import annotations

EMBEDDING_PARALLEL_METHODS = ("alltoall", "allreduce")
TABLE_OPTIMIZERS = ("sparse_adam", "adam", "rowwise_adam")
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16")
# config value -> torch dtype name (fp8_e4m3: with E8M0 scales per 32 columns, engram/fp8_table.py)
ENGRAM_TABLE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}
ENGRAM_VALUE_INITS = ("normal", "zero")
TABLE_PLACEMENTS = ("device", "host")
ENGRAM_VARIANTS = ("paper", "deepseek_v41")

# {field: (names, what they mean)}
CHOICES = {
    "engram_embedding_parallel_method": (
        EMBEDDING_PARALLEL_METHODS,
        "'alltoall' shards the tables over the Engram embedding-parallel group, 'allreduce' "
        "over the tensor-parallel group (docs/embedding-parallel.md)"),
    "engram_optimizer": (
        TABLE_OPTIMIZERS,
        "'sparse_adam' (row-wise, cost follows the tokens), 'rowwise_adam' (sparse, one second "
        "moment per row) or 'adam' (dense, cost follows the table)"),
    "engram_optimizer_state_dtype": (
        OPTIMIZER_STATE_DTYPES,
        "dtype of rowwise_adam's per-element first moment"),
    "engram_table_dtype": (
        tuple(ENGRAM_TABLE_DTYPES),
        "fp32 (default), bf16 (float32 optimizer masters unless engram_master_weights=false) or "
        "fp8_e4m3 (FP8 rows with E8M0 scales per 32 columns: frozen, or rowwise_adam without "
        "master); fp16 tables are not supported"),
    "engram_table_placement": (
        TABLE_PLACEMENTS,
        "'device' keeps the tables with the model, 'host' keeps them (and their optimizer "
        "state) in host memory"),
    "engram_variant": (
        ENGRAM_VARIANTS,
        "'paper' (DeepSeek's Engram paper: short conv, per-stream key projections) or "
        "'deepseek_v41' (DeepSeek-V4.1's branch: fused wkv, no conv; docs/deepseek-v41.md)"),
    "engram_value_init": (
        ENGRAM_VALUE_INITS,
        "'zero' starts the value projection at zero (the model keeps its function at step 0)"),
}
