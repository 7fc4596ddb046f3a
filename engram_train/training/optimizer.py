"""Optimizer and LR schedule from megatron-core's own pieces.

Engram tables get their own parameter group (LR x ``engram_lr_multiplier``, weight decay
x 0 by default: the paper's recipe) through megatron's ``config_overrides`` keyed on the
``is_engram_table`` attribute that ``MultiHeadEmbedding`` sets on its table.
"""

from __future__ import annotations

from typing import Any

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def engram_param_overrides(opt_config: OptimizerConfig, model_config: Any) -> dict:
    """megatron's standard overrides plus the Engram table group."""
    overrides = get_standard_config_overrides(opt_config)
    if getattr(model_config, "use_engram", False):
        mult = model_config.engram_lr_multiplier
        wd = model_config.engram_weight_decay
        table_group = {
            "max_lr": opt_config.lr * mult,
            "min_lr": (opt_config.min_lr or 0.0) * mult,
            "wd_mult": (wd / opt_config.weight_decay) if opt_config.weight_decay else 0.0,
        }
        overrides[ParamKey(attr="is_engram_table")] = table_group
    return overrides


def build_optimizer(opt_config: OptimizerConfig, model_chunks: list, model_config: Any):
    return get_megatron_optimizer(
        opt_config, model_chunks, config_overrides=engram_param_overrides(opt_config, model_config)
    )


def build_lr_scheduler(
    optimizer,
    lr: float,
    min_lr: float,
    warmup_samples: int,
    decay_samples: int,
    decay_style: str = "cosine",
    weight_decay: float = 0.0,
) -> OptimizerParamScheduler:
    """megatron's scheduler, stepped in samples (as Megatron-LM does)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup_samples > 0 else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_samples,
        lr_decay_steps=max(decay_samples, warmup_samples + 1),
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(decay_samples, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
