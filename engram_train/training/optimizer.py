"""Optimizer and LR schedule from megatron-core's own pieces.

With ``use_engram`` the Engram tables are kept out of megatron's optimizer (as out of its DDP)
and stepped by ``EngramTableOptimizer`` (LR x ``engram_lr_multiplier``, weight decay
``engram_weight_decay``: the paper's recipe), chained after megatron's optimizers in one
``ChainedOptimizer``: see ``training/engram_optimizer.py`` for why and how gradients, norms and
clipping combine. Without Engram this is megatron's optimizer alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.optimizer import (
    ChainedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from engram_train.config.model import uses_engram

if TYPE_CHECKING:
    from engram_train.config.composed import ModelConfig


def build_optimizer(opt_config: OptimizerConfig, model_chunks: list, model_config: ModelConfig):
    """megatron's optimizer for ``model_chunks`` (DDP-wrapped), plus the Engram table optimizer."""
    overrides = get_standard_config_overrides(opt_config)
    if not uses_engram(model_config):  # megatron's own config (no Engram fields) too
        return get_megatron_optimizer(opt_config, model_chunks, config_overrides=overrides)

    from engram_train.parallel.groups import table_gradient_groups
    from engram_train.models.table_params import engram_table_params, hidden_from_megatron
    from engram_train.training.engram_optimizer import (
        EngramTableOptimizer,
        engram_table_param_group,
    )

    tables = engram_table_params(model_chunks)
    with hidden_from_megatron(tables):
        megatron_optimizer = get_megatron_optimizer(
            opt_config, model_chunks, config_overrides=overrides
        )
    grad_sync_group, norm_group = table_gradient_groups(model_config)
    table_group = engram_table_param_group(opt_config, model_config)
    if model_config.engram_freeze_tables and model_config.engram_table_dtype == "fp8_e4m3":
        # fp8 tables frozen: fixed data, no gradient and no optimizer state (docs/host-tables.md)
        for table in tables:
            table.requires_grad_(False)
        tables = []
    elif model_config.engram_freeze_tables:
        # The control of engram_freeze_tables: a zero LR at every step keeps the tables at
        # their init while the step still costs what a trained table's does.
        table_group.update(lr=0.0, max_lr=0.0, min_lr=0.0)
    table_optimizer = EngramTableOptimizer(
        opt_config,
        tables,
        table_group,
        grad_sync_group,
        norm_group,
        table_optimizer=model_config.engram_optimizer,
        calculate_per_token_loss=model_config.calculate_per_token_loss,
        offload_states=model_config.engram_offload_embedding_optimizer_states,
        master_weights=model_config.engram_master_weights,
        state_dtype=model_config.engram_optimizer_state_dtype,
        seed=model_config.engram_seed,
        overlap_host_update=model_config.engram_overlap_host_update,
    )
    parts = (
        megatron_optimizer.chained_optimizers
        if isinstance(megatron_optimizer, ChainedOptimizer)
        else [megatron_optimizer]
    )
    return ChainedOptimizer([*parts, table_optimizer])


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


# The parts of an optimizer param group that belong to the LR schedule. megatron's scheduler
# reads each group's ``max_lr``/``min_lr`` before its own (``OptimizerParamScheduler.get_lr``),
# and loading optimizer state restores the saved groups' values: without a correction the
# checkpoint's peak and floor would stay in force whatever the scheduler was told.
SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr")


# What tells a param group's role apart from its schedule (megatron's structural flags).
_GROUP_ROLE_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "default_config")


def align_groups_to_checkpoint(optimizer, saved: list[list[dict]]) -> None:
    """Give each param group the ``max_lr``/``min_lr`` of its counterpart in the checkpoint
    (``saved``: per optimizer of the chain, its saved groups), before the optimizer state
    loads. megatron-core 0.19 matches saved groups to the current ones by a key that includes
    both (``_filter_and_reorder_param_groups``), so a run with another LR could not load its
    own checkpoint; `resume_schedule` then sets the values the chosen schedule asks for."""
    parts = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    # The Engram table optimizer comes last: a checkpoint without Engram has one part fewer.
    for part, saved_groups in zip(parts, saved):
        for group in part.param_groups:
            role = tuple(group.get(k) for k in _GROUP_ROLE_KEYS)
            values = {
                tuple(g.get(k) for k in SCHEDULE_GROUP_KEYS)
                for g in saved_groups
                if tuple(g.get(k) for k in _GROUP_ROLE_KEYS) == role
            }
            if len(values) == 1:  # else ambiguous or absent: megatron's own load decides
                group.update(zip(SCHEDULE_GROUP_KEYS, values.pop()))


def group_schedule(optimizer) -> list[dict]:
    """Each param group's ``max_lr``/``min_lr``, in the optimizer's group order."""
    return [{k: g[k] for k in SCHEDULE_GROUP_KEYS if k in g} for g in optimizer.param_groups]


def resume_schedule(scheduler, optimizer, run_groups: list[dict], saved: dict | None, consumed: int) -> str:
    """Put the LR schedule of a resumed run in force, as Megatron-LM's flags mean it.

    Called after the optimizer state was loaded; ``run_groups`` is `group_schedule` of the
    optimizer as this run built it. ``checkpoint.use_checkpoint_opt_param_scheduler``: the
    checkpoint's schedule (scheduler state and the groups' values as loaded). Otherwise this
    run's values: with ``override_opt_param_scheduler`` counted from the checkpoint's sample
    count, with neither flag after `check_schedule` found them equal. A checkpoint without
    scheduler state (an import) carries no schedule: this run's applies from ``consumed``
    samples (0 for an import). Returns which schedule applies, for the log.
    """
    if saved and scheduler.use_checkpoint_opt_param_scheduler:
        scheduler.load_state_dict(saved)
        return "the checkpoint's"
    groups = optimizer.param_groups
    for group, values in zip(groups, run_groups, strict=True):
        group.update(values)
    if saved:
        scheduler.load_state_dict(saved)  # override: this run's values; neither: equal to them
    else:
        scheduler.num_steps = 0
        scheduler.step(increment=consumed)
    return "this run's"
