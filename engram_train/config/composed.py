"""`EngramTransformerConfig` and `EngramMLATransformerConfig`: megatron's configs composed
with `EngramConfig`, `HyperConnectionConfig` and ``model_family``, so that one object carries every field and one
``__post_init__`` validates them (megatron's fields, then mHC's, then Engram's). Built on first
access: importing megatron-core takes seconds, and ``import engram_train`` does not pay it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engram_train.config.choices import ENGRAM_TABLE_DTYPES
from engram_train.config.family import ModelFamilyConfig, check_model_family
from engram_train.config.mhc import (
    HyperConnectionConfig,
    check_hyper_connections,
    take_mhc_recompute_module,
)
from engram_train.config.model import EngramConfig
from engram_train.errors import ConfigError

_COMPOSED = {
    "EngramTransformerConfig": "TransformerConfig",
    "EngramMLATransformerConfig": "MLATransformerConfig",
}


def _check_megatron_backbone(config) -> None:
    """Engram settings a megatron GPT backbone cannot honour. The standalone `EngramConfig`
    (the reference module, export) accepts them; a megatron config refuses them here, once,
    for the trainer and library users alike."""
    if not config.use_engram:
        return
    if config.context_parallel_size > 1 and config.hybrid_context_parallel:
        raise ConfigError(
            "hybrid_context_parallel=true with use_engram=True: Engram's conv halo follows "
            "megatron's zigzag split (get_batch_on_this_cp_rank), not hybrid CP's packing; set "
            "hybrid_context_parallel: false"
        )
    if config.fp16:
        raise ConfigError(
            "fp16 (system.precision=fp16) is not supported with use_engram=True: megatron's loss "
            "scaler does not cover the Engram table gradients (an overflow there would not skip "
            "the step). Use bf16 (system.precision=bf16) or fp32"
        )


def _compose(name: str, megatron_cls: type) -> type:
    """Dataclass inheriting megatron's config, EngramConfig and HyperConnectionConfig; validates
    megatron's fields, then mHC's (which resolve `engram_hc_mult`), then Engram's."""

    def __post_init__(self) -> None:
        mhc_recompute = take_mhc_recompute_module(self)  # a name megatron-core 0.16/0.19 refuse
        megatron_cls.__post_init__(self)
        check_hyper_connections(self, mhc_recompute)
        EngramConfig.__post_init__(self)
        check_model_family(self.model_family)
        self.validate_num_layers(self.num_layers)
        self.validate_hidden_size(self.hidden_size)
        _check_megatron_backbone(self)

    namespace = {
        "__post_init__": __post_init__,
        "__module__": "engram_train.config",  # where users (and pickles) find it
        "__qualname__": name,
        "__doc__": f"megatron {megatron_cls.__name__} plus every EngramConfig field.",
    }
    bases = (megatron_cls, EngramConfig, HyperConnectionConfig, ModelFamilyConfig)
    return dataclass(type(name, bases, namespace))


def __getattr__(name: str) -> type:
    # Built lazily: importing megatron takes seconds and most users of EngramConfig need not pay.
    if name in _COMPOSED:
        from megatron.core.transformer import transformer_config

        cls = _compose(name, getattr(transformer_config, _COMPOSED[name]))
        globals()[name] = cls
        sys.modules["engram_train.config"].__dict__[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover - static view of the lazily built classes
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    @dataclass
    class EngramTransformerConfig(TransformerConfig, EngramConfig, HyperConnectionConfig,
                                  ModelFamilyConfig): ...

    @dataclass
    class EngramMLATransformerConfig(MLATransformerConfig, EngramConfig, HyperConnectionConfig,
                                     ModelFamilyConfig): ...

    ModelConfig = EngramTransformerConfig | EngramMLATransformerConfig
    """A model config the project builds: megatron's fields with every Engram and mHC field."""


def engram_table_dtype(config):
    """torch dtype of the Engram tables a validated config names (``engram_table_dtype``)."""
    import torch

    return getattr(torch, ENGRAM_TABLE_DTYPES[config.engram_table_dtype])
