"""engram-train: pretrain a DeepSeek-V3-style GPT (with or without Engram) on megatron-core.

    torchrun --nproc-per-node 2 -m engram_train.train                      # the embedded demo
    torchrun --nproc-per-node 4 -m engram_train.train system.tensor_model_parallel_size=2 \\
        system.pipeline_model_parallel_size=2 model.use_engram=true train.train_iters=20
    engram-train model=engram_27b --cfg job                                # print a preset

Configuration: conf/train.yaml (+ conf/model/*.yaml), every key documented in README.md.
The loop reads top to bottom: validate -> init -> data -> model/optimizer -> (resume) ->
steps with logging, evaluation and checkpoints -> loss plot.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger("engram_train")


def run(cfg: DictConfig) -> dict:
    """Train as configured; returns the final metrics of this rank (for tests/tools)."""
    from engram_train.training.run_config import (
        build_transformer_config,
        data_parallel_size,
        padded_vocab_size,
        parallel_sizes,
        validate_run_config,
    )

    # megatron logs every parameter name at INFO while building the optimizer; keep its warnings.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_run_config(cfg, world_size)
    model_config = build_transformer_config(cfg)  # validated, still no process group

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    from engram_train.checkpointing import latest_iteration, load_checkpoint, save_checkpoint
    from engram_train.data import HashPrefetchIterator, MicroBatchIterator, build_gpt_datasets, load_tokenizer
    from engram_train.metrics import MetricsWriter, format_eval_line, format_log_line, is_logging_rank
    from engram_train.models.builder import build_model
    from engram_train.runtime import initialize_distributed
    from engram_train.training.optimizer import build_lr_scheduler, build_optimizer
    from engram_train.training.step import evaluate, train_step

    t, s = cfg.train, cfg.system
    exp_dir = Path(cfg.experiment.exp_dir)
    initialize_distributed(parallel_sizes(cfg), seed=int(t.seed), timeout_minutes=int(s.distributed_timeout_minutes))
    rank = dist.get_rank()
    dp_size = data_parallel_size(cfg, world_size)
    dp_rank = parallel_state.get_data_parallel_rank()
    num_micro = t.global_batch_size // (t.micro_batch_size * dp_size)
    is_logger = is_logging_rank()
    if rank == 0:
        exp_dir.mkdir(parents=True, exist_ok=True)
        (exp_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    dist.barrier()

    # Data: megatron GPT datasets; every rank (all pipeline stages) reads its DP share.
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    train_ds, valid_ds, _ = build_gpt_datasets(
        cfg.data.path,
        tokenizer,
        seq_length=t.seq_length,
        num_samples=[t.train_iters * t.global_batch_size, max(1, t.eval_iters * t.global_batch_size), 1],
        split=cfg.data.split,
        seed=t.seed,
        cache_dir=cfg.data.cache_dir or str(exp_dir / "data_cache"),
        reset_position_ids=cfg.data.reset_position_ids,
        reset_attention_mask=cfg.data.reset_attention_mask,
        eod_mask_loss=cfg.data.eod_mask_loss,
    )
    hash_fn = None
    if model_config.use_engram:
        from engram_train.engram.hashing import NgramHashMapping

        hash_fn = NgramHashMapping(model_config).hash_stacked  # one [L, B, S, K] block

    # Model, optimizer, schedule: megatron's DDP, optimizer and param scheduler.
    vocab_size = padded_vocab_size(tokenizer.vocab_size, model_config.tensor_model_parallel_size)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(s.overlap_grad_reduce),
        use_distributed_optimizer=bool(s.use_distributed_optimizer),
    )
    model = build_model(model_config, vocab_size, t.seq_length, ddp_config)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=bool(s.use_distributed_optimizer),
    )
    optimizer = build_optimizer(opt_config, model, model_config)
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    decay_iters = t.lr_decay_iters or t.train_iters
    scheduler = build_lr_scheduler(
        optimizer, t.lr, t.min_lr, t.lr_warmup_iters * t.global_batch_size,
        decay_iters * t.global_batch_size, t.lr_decay_style, t.weight_decay,
    )

    iteration, consumed = 0, 0
    if cfg.checkpoint.load and latest_iteration(cfg.checkpoint.load) is not None:
        iteration, extra = load_checkpoint(cfg.checkpoint.load, model, optimizer)
        consumed = int(extra.get("consumed_samples", iteration * t.global_batch_size))
        if "scheduler" in extra:
            scheduler.load_state_dict(extra["scheduler"])
        if is_logger:
            log.info("resumed from %s at iteration %d (%d samples consumed)", cfg.checkpoint.load, iteration, consumed)
    elif cfg.checkpoint.load and rank == 0:
        log.warning("checkpoint.load=%s holds no checkpoint yet: training from scratch", cfg.checkpoint.load)

    def batches(dataset, consumed_samples):
        it = MicroBatchIterator(
            dataset, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
            dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed_samples,
        )
        if not hash_fn:
            return it
        # hash a whole step ahead: the next step's micro-batches are hashed while this one runs
        return HashPrefetchIterator(it, hash_fn, prefetch=bool(cfg.data.hash_prefetch), depth=num_micro)

    def validation_loss():
        if valid_ds is None or not t.eval_iters:
            return None
        val = batches(valid_ds, 0)
        losses = [evaluate(model, [next(val) for _ in range(num_micro)], t.seq_length, t.micro_batch_size)
                  for _ in range(t.eval_iters)]
        if hasattr(val, "close"):
            val.close()
        return None if losses[0] is None else sum(losses) / len(losses)

    def save(it: int):
        save_checkpoint(cfg.checkpoint.save, it, model, optimizer,
                        extra={"consumed_samples": consumed, "scheduler": scheduler.state_dict()})

    metrics = MetricsWriter(exp_dir, enabled=is_logger, resume_iteration=iteration if iteration else None)
    train_iter = batches(train_ds, consumed)
    from engram_train.training.engram_timing import EngramStepTimes

    engram_times = EngramStepTimes(train_iter) if model_config.use_engram else None
    tokens_per_step = t.global_batch_size * t.seq_length
    last: dict = {}
    window_start, window_steps = time.perf_counter(), 0
    while iteration < t.train_iters:
        microbatches = [next(train_iter) for _ in range(num_micro)]
        result = train_step(model, optimizer, microbatches, t.seq_length, t.micro_batch_size, scheduler)
        iteration += 1
        consumed += t.global_batch_size
        window_steps += 1
        log_now = bool(t.log_interval) and iteration % t.log_interval == 0
        eval_now = bool(t.eval_interval) and (iteration % t.eval_interval == 0 or iteration == t.train_iters)
        if log_now or eval_now:
            step_time = (time.perf_counter() - window_start) / window_steps
            steps_in_window = window_steps
            window_start, window_steps = time.perf_counter(), 0
            record = dict(
                lm_loss=result.lm_loss, lr=get_canonical_lr_for_logging(optimizer.param_groups),
                grad_norm=result.grad_norm, tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
            )
            engram = engram_times.window(steps_in_window) if engram_times else {}
            record.update(engram)
            if eval_now:
                record["val_loss"] = validation_loss()
            if is_logger:
                print(format_log_line(
                    iteration=iteration, train_iters=t.train_iters, consumed_samples=consumed,
                    step_time_s=step_time, lr=record["lr"], global_batch_size=t.global_batch_size,
                    losses={"lm loss": result.lm_loss}, tokens_per_s=record["tokens_per_s"],
                    grad_norm=result.grad_norm,
                    extra={"engram wait (ms)": engram["engram_wait_s"] * 1000} if engram else None,
                ), flush=True)
                if record.get("val_loss") is not None:
                    print(format_eval_line(iteration, {"lm loss": record["val_loss"]}), flush=True)
                last = metrics.log(iteration, **record) or {}
        if cfg.checkpoint.save and cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
            save(iteration)
    if hasattr(train_iter, "close"):
        train_iter.close()
    if cfg.checkpoint.save and not (cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0):
        save(iteration)
    metrics.close()
    if is_logger:
        from engram_train.plot import plot_runs

        png = plot_runs([exp_dir], exp_dir / "loss.png")
        print(f"loss curve written to {png}", flush=True)
    from engram_train.runtime import destroy_distributed

    destroy_distributed()
    return last


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    from engram_train.training.run_config import ConfigError

    try:
        run(cfg)
    except ConfigError as e:
        raise SystemExit(f"engram-train: invalid configuration: {e}") from None


if __name__ == "__main__":
    main()
