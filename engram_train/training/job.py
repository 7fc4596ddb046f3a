"""Stage 2 of a run, ``build``: process groups, datasets, model, optimizer and LR schedule of this
rank, and the free space a checkpoint of the model needs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from omegaconf import DictConfig

from engram_train.checkpoint.disk import check_free_space
from engram_train.checkpoint.lock import lock_save_folder
from engram_train.checkpoint.save import save_checkpoint
from engram_train.checkpoint.state import estimate_checkpoint_bytes
from engram_train.data.batches import HashPrefetchIterator, MicroBatchIterator
from engram_train.data.datasets import build_gpt_datasets
from engram_train.metrics import is_logging_rank
from engram_train.models.builder import build_model
from engram_train.runtime import initialize_distributed
from engram_train.runtime.cpu_compat import start_writer_queue_early
from engram_train.training.faults import ExitSignalHandler, children_die_with_parent, reap_process_group_on_exit
from engram_train.training.optimizer import build_optimizer
from engram_train.training.plan import Plan, lr_scheduler
from engram_train.training.run_config import data_parallel_size, parallel_sizes

log = logging.getLogger("engram_train")


@dataclass
class Job:
    """Everything `build` makes; `resume`, `train` and `finish` read it."""

    cfg: DictConfig
    plan: Plan
    exp_dir: Path
    rank: int
    dp_rank: int
    dp_size: int
    num_micro: int
    is_logger: bool
    train_ds: Any
    valid_ds: Any
    hash_fn: Any
    model: list
    optimizer: Any
    scheduler: Any
    space_estimate: int | None
    signals: Any  # ExitSignalHandler or None
    metrics: Any = None

    def batches(self, dataset, consumed_samples: int):
        t = self.cfg.train
        it = MicroBatchIterator(
            dataset, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
            dp_rank=self.dp_rank, dp_size=self.dp_size, consumed_samples=consumed_samples,
        )  # fmt: skip
        if self.hash_fn is None:
            return it
        # hash a whole step ahead: the next step's micro-batches are hashed while this one runs
        return HashPrefetchIterator(it, self.hash_fn, prefetch=bool(self.cfg.data.hash_prefetch),
                                    depth=self.num_micro)

    def save(self, iteration: int, consumed: int) -> Path:
        c = self.cfg.checkpoint
        return save_checkpoint(
            c.save, iteration, self.model, self.optimizer,
            extra={"consumed_samples": consumed, "scheduler": self.scheduler.state_dict()},
            run_identity=self.plan.identity, check_space=bool(c.check_free_space),
            space_estimate=self.space_estimate,
        )  # fmt: skip


def build(cfg: DictConfig, plan: Plan) -> Job:
    """Process groups, datasets, model, optimizer and LR schedule of this rank."""
    t, s = cfg.train, cfg.system
    signals = ExitSignalHandler().install() if t.exit_signal_handler else None
    children_die_with_parent()
    reap_process_group_on_exit()
    exp_dir = Path(cfg.experiment.exp_dir)
    if cfg.checkpoint.save and os.environ.get("RANK", "0") == "0":
        lock_save_folder(cfg.checkpoint.save)  # the saving rank, for the run's life
    initialize_distributed(parallel_sizes(cfg), seed=int(t.seed), timeout_minutes=int(s.distributed_timeout_minutes))
    if cfg.checkpoint.save:
        start_writer_queue_early()  # before the model: a manager forked later copies its pages
    rank = dist.get_rank()
    dp_size = data_parallel_size(cfg, dist.get_world_size())

    # Data: megatron GPT datasets; every rank (all pipeline stages) reads its DP share.
    train_ds, valid_ds, _ = build_gpt_datasets(
        cfg.data.path,
        plan.tokenizer,
        seq_length=t.seq_length,
        num_samples=[t.train_iters * t.global_batch_size, max(1, t.eval_iters * t.global_batch_size), 1],
        split=cfg.data.split,
        seed=t.seed,
        cache_dir=cfg.data.cache_dir or str(exp_dir / "data_cache"),
        reset_position_ids=cfg.data.reset_position_ids,
        reset_attention_mask=cfg.data.reset_attention_mask,
        eod_mask_loss=cfg.data.eod_mask_loss,
        global_batch_size=t.global_batch_size,
    )
    if valid_ds is None and t.eval_iters and t.eval_interval and rank == 0:
        log.info("data.split=%r has no validation share: this run validates neither every "
                 "train.eval_interval=%d iterations nor at the end; give it one to validate, e.g. "
                 "data.split=\"90,10,0\"", str(cfg.data.split), t.eval_interval)  # fmt: skip

    # Model, optimizer, schedule: megatron's DDP, optimizer and param scheduler.
    model_config = plan.model_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(s.overlap_grad_reduce),
        use_distributed_optimizer=bool(s.use_distributed_optimizer),
    )
    model = build_model(model_config, plan.vocab_size, t.seq_length, ddp_config)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
        bf16=model_config.bf16, fp16=model_config.fp16, params_dtype=model_config.params_dtype,
        use_distributed_optimizer=bool(s.use_distributed_optimizer),
    )  # fmt: skip
    optimizer = build_optimizer(opt_config, model, model_config)
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    scheduler = lr_scheduler(cfg, optimizer)

    space_estimate = None
    if cfg.checkpoint.save:
        space_estimate = estimate_checkpoint_bytes(model)
        if cfg.checkpoint.check_free_space:
            check_free_space(cfg.checkpoint.save, space_estimate, "hold a checkpoint of this model")
    return Job(
        cfg=cfg, plan=plan, exp_dir=exp_dir, rank=rank,
        dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp_size,
        num_micro=t.global_batch_size // (t.micro_batch_size * dp_size), is_logger=is_logging_rank(),
        train_ds=train_ds, valid_ds=valid_ds,
        # one [L, B, S, K] block per micro-batch (models/engram_gpt.py)
        hash_fn=plan.hash_mapping.hash_block if plan.hash_mapping is not None else None,
        model=model, optimizer=optimizer, scheduler=scheduler, space_estimate=space_estimate,
        signals=signals,
    )  # fmt: skip
