"""Every setting's type, default and one-line doc, in one place, at the bottom of the package
order (nothing here imports another package of the project but `errors`).

- `model`: `EngramConfig` (the Engram fields and their validation) and `resolve` (a model
  section with every Engram and mHC field defaulted and ``engram_hc_mult`` derived);
- `choices`: the options that take one of a few names (`CHOICES`);
- `composed`: the megatron configs composed with it (`EngramTransformerConfig`,
  `EngramMLATransformerConfig`, built on first access: importing megatron-core takes seconds);
- `mhc`: `HyperConnectionConfig` (the mHC backbone fields), `residual_streams`, the rule
  ``engram_hc_mult`` follows, and the default of the ``mhc`` recompute module;
- `run`: the run config's typed sections (``experiment``, ``system``, ``train``,
  ``checkpoint``, ``data``), the base of ``conf/train.yaml`` (README.md "Configuration
  reference" lists the same keys); `register` puts them into Hydra's ConfigStore, called where
  Hydra composes (importing this package imports neither Hydra nor torch).
"""

from __future__ import annotations

from engram_train.config import composed as _composed
from engram_train.config.choices import (
    CHOICES,
    EMBEDDING_PARALLEL_METHODS,
    ENGRAM_TABLE_DTYPES,
    ENGRAM_VALUE_INITS,
    TABLE_OPTIMIZERS,
    TABLE_PLACEMENTS,
)
from engram_train.config.composed import engram_table_dtype
from engram_train.config.mhc import (
    HyperConnectionConfig,
    check_hyper_connections,
    require_int,
    residual_streams,
    uses_hyper_connections,
)
from engram_train.config.model import EngramConfig, resolve, uses_engram
from engram_train.config.run import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    ExperimentConfig,
    RunConfig,
    SystemConfig,
    TrainConfig,
    check_known_keys,
    register,
    typed_run_config,
)


__all__ = [
    "CHOICES",
    "EMBEDDING_PARALLEL_METHODS",
    "ENGRAM_TABLE_DTYPES",
    "ENGRAM_VALUE_INITS",
    "SECTIONS",
    "TABLE_OPTIMIZERS",
    "TABLE_PLACEMENTS",
    "CheckpointConfig",
    "DataConfig",
    "EngramConfig",
    "EngramMLATransformerConfig",
    "EngramTransformerConfig",
    "ExperimentConfig",
    "HyperConnectionConfig",
    "RunConfig",
    "SystemConfig",
    "TrainConfig",
    "check_hyper_connections",
    "check_known_keys",
    "engram_table_dtype",
    "require_int",
    "residual_streams",
    "resolve",
    "typed_run_config",
    "uses_engram",
    "uses_hyper_connections",
]


def __getattr__(name: str):
    """The megatron-composed configs, built by `composed` on first access."""
    return getattr(_composed, name)
