"""engram-train: pretrain a DeepSeek-V3-style GPT (with or without Engram) on megatron-core.

    torchrun --nproc-per-node 2 -m engram_train.train                      # the embedded demo
    torchrun --nproc-per-node 4 -m engram_train.train system.tensor_model_parallel_size=2 \\
        system.pipeline_model_parallel_size=2 model.use_engram=true train.train_iters=20
    engram-train model=engram_27b --cfg job                                # print a preset

Configuration: conf/train.yaml (+ conf/model/*.yaml), every key documented in README.md.
`run` reads top to bottom:

1. `check`: everything that can go wrong before a process group exists - the config, writable
   output directories, and whether the checkpoint to resume from matches this run (Engram hash
   identity, model shape, LR schedule) and is complete.
2. `build`: process groups, data, model, optimizer, LR schedule; free space for a checkpoint.
3. `resume`: verify the checkpoint's files and load it, or start fresh without overwriting one.
4. `train`: the steps, with logging, evaluation, checkpoints, and a clean exit on SIGTERM, on
   the wall-clock limit or on non-finite steps.
5. `finish`: the loss plot (never fails the run) and shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram_train.logs import quiet_known_warnings

# Known third-party warnings are filtered before anything imports torch or megatron-core (the
# list, and ENGRAM_SHOW_WARNINGS=1 to keep them: engram_train/logs.py).
quiet_known_warnings()

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engram_train.models.presets import CONF_DIR  # noqa: E402

log = logging.getLogger("engram_train")


def run(cfg: DictConfig) -> dict:
    """Train as configured; returns the final metrics of this rank (for tests/tools)."""
    plan = check(cfg)
    job = build(cfg, plan)
    progress = resume(job, plan)
    if progress.iteration >= cfg.train.train_iters:
        _nothing_to_train(job, progress)
        finish(job, plot=False)
        return {}
    last = train(job, progress)
    finish(job)
    return last


def _nothing_to_train(job: "Job", progress: "Progress") -> None:
    """Resumed at or past ``train.train_iters``: say so (exit code 0, no step, no save)."""
    from engram_train.logs import console

    t = job.cfg.train
    job.metrics.close()
    if job.rank == 0:
        console(
            f"engram-train: nothing to train: the checkpoint is at iteration {progress.iteration} and "
            f"train.train_iters={t.train_iters}. To train further, raise train.train_iters (a longer "
            "schedule also needs checkpoint.override_opt_param_scheduler=true or "
            "checkpoint.use_checkpoint_opt_param_scheduler=true, docs/reliability.md)"
        )


# -- 1. check -----------------------------------------------------------------------------------


@dataclass
class Plan:
    """What `check` found, before any process group: the validated configs and the resume."""

    model_config: Any
    tokenizer: Any
    vocab_size: int
    hash_mapping: Any  # NgramHashMapping, or None without Engram
    identity: dict  # this run's identity (training/run_identity.py)
    resume_from: str | None  # checkpoint.load when it holds a checkpoint, else None


def lr_scheduler(cfg, optimizer):
    """megatron's scheduler for ``train`` (stepped in samples), with the resume rule of
    ``checkpoint.override_opt_param_scheduler`` / ``use_checkpoint_opt_param_scheduler``."""
    from engram_train.training.optimizer import build_lr_scheduler

    t, c = cfg.train, cfg.checkpoint
    decay_iters = t.lr_decay_iters or t.train_iters
    scheduler = build_lr_scheduler(
        optimizer, t.lr, t.min_lr, t.lr_warmup_iters * t.global_batch_size,
        decay_iters * t.global_batch_size, t.lr_decay_style, t.weight_decay,
    )  # fmt: skip
    scheduler.override_opt_param_scheduler = bool(c.override_opt_param_scheduler)
    scheduler.use_checkpoint_opt_param_scheduler = bool(c.use_checkpoint_opt_param_scheduler)
    return scheduler


def _expected_schedule(cfg) -> dict:
    """The scheduler state this config produces (built on a stand-in optimizer)."""
    from engram_train.training.run_config import ConfigError

    try:
        return lr_scheduler(cfg, types.SimpleNamespace(param_groups=[])).state_dict()
    except AssertionError as e:
        raise ConfigError(f"train: the LR schedule is invalid ({e})") from None


def check_resume(cfg, plan: Plan, ckpt: Path, manifest: dict | None) -> None:
    """Raise `ResumeMismatchError` when checkpoint ``ckpt`` does not match this run: every
    difference it will refuse (run identity and LR schedule) in one message, with the overrides
    that accept them, so that one relaunch settles them all."""
    from megatron.core import dist_checkpointing

    from engram_train.checkpointing import DamagedCheckpointError
    from engram_train.training.run_identity import (
        ResumeMismatchError,
        check_run_identity,
        check_schedule,
        combine_mismatches,
    )

    c = cfg.checkpoint
    found: list[ResumeMismatchError] = []
    if manifest is None:
        log.warning("%s records no run identity (saved before identities existed): not checked", ckpt)
    else:
        try:
            check_run_identity(manifest.get("run"), plan.identity, load_engram=bool(c.load_engram), where=str(ckpt))
        except ResumeMismatchError as e:
            found.append(e)
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as e:
        raise DamagedCheckpointError(f"{ckpt}: cannot read its common state ({e})") from e
    try:
        check_schedule(
            (common.get("extra") or {}).get("scheduler"), _expected_schedule(cfg),
            override=bool(c.override_opt_param_scheduler),
            use_checkpoint=bool(c.use_checkpoint_opt_param_scheduler),
            global_batch_size=int(cfg.train.global_batch_size),
            lr_decay_iters_set=cfg.train.lr_decay_iters is not None, where=str(ckpt),
        )  # fmt: skip
    except ResumeMismatchError as e:
        found.append(e)
    if found:
        raise combine_mismatches(found)


def _refuse_overwrite(cfg) -> None:
    """A fresh start must not overwrite checkpoints in ``checkpoint.save`` unless asked."""
    from engram_train.checkpointing import TRACKER, iteration_dir, list_checkpoints, read_tracker
    from engram_train.training.run_config import ConfigError

    save = cfg.checkpoint.save
    if not save:
        return
    existing = list_checkpoints(save)
    if not existing and read_tracker(save) is None:
        return
    if cfg.checkpoint.overwrite:
        return
    names = ", ".join(iteration_dir(save, i).name for i in existing[-3:]) or TRACKER
    raise ConfigError(
        f"checkpoint.save={save} already holds checkpoints ({names}) and this run starts from "
        f"scratch, so it would overwrite them. Resume with checkpoint.load={save}, choose another "
        "checkpoint.save, or set checkpoint.overwrite=true to delete them and start over"
    )


def check(cfg: DictConfig) -> Plan:
    """Config, output directories and the checkpoint to resume from, before any process group."""
    from engram_train.training.run_config import ConfigError, padded_vocab_size, validate_run_config

    # Validated (run and model rules) and built, still without a process group, and before the
    # modules below (megatron's checkpointing, datasets) are imported: a config error shows at once.
    model_config = validate_run_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))

    from engram_train.checkpointing import (
        check_checkpoint,
        has_checkpoints,
        iteration_dir,
        read_manifest,
        resume_candidates,
        DamagedCheckpointError,
    )
    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import TokenizerNotFoundError
    from engram_train.training.divergence import guard_from_config
    from engram_train.training.faults import check_writable
    from engram_train.training.run_identity import run_identity

    check_writable(cfg.experiment.exp_dir, "experiment.exp_dir")
    if cfg.checkpoint.save:
        check_writable(cfg.checkpoint.save, "checkpoint.save")

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, model_config.tensor_model_parallel_size)
    mapping = None
    if model_config.use_engram:
        from engram_train.engram.ngram_hash import NgramHashMapping

        try:
            mapping = NgramHashMapping(model_config, num_threads=int(cfg.data.get("hash_threads", 1)))
        except (ValueError, TokenizerNotFoundError) as e:  # pad id, tokenizer path: the config's
            raise ConfigError(f"model: {e}") from None
    plan = Plan(model_config, tokenizer, vocab_size, mapping,
                run_identity(model_config, vocab_size, mapping), resume_from=None)  # fmt: skip
    _expected_schedule(cfg)  # a schedule megatron would refuse fails here, not after the build
    guard_from_config(cfg, vocab_size)  # its keys

    load = cfg.checkpoint.load
    if not (load and has_checkpoints(load)):
        _refuse_overwrite(cfg)
        return plan
    # The first candidate that looks complete (sizes only: checksums are shared out in resume).
    for iteration in resume_candidates(load)[0]:
        ckpt = iteration_dir(load, iteration)
        problems = check_checkpoint(ckpt, checksums=False)
        if not problems:
            check_resume(cfg, plan, ckpt, read_manifest(ckpt))
            break
        if not cfg.checkpoint.load_fallback:
            raise DamagedCheckpointError(
                f"checkpoint {ckpt} is damaged; nothing was loaded:\n  " + "\n  ".join(problems)
                + "\nRestore these files, or set checkpoint.load_fallback=true to resume from the "
                "newest intact older checkpoint"
            )
        log.warning("passing over damaged checkpoint %s:\n  %s", ckpt, "\n  ".join(problems))
    plan.resume_from = str(load)
    return plan


# -- 2. build -----------------------------------------------------------------------------------


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
        from engram_train.data import HashPrefetchIterator, MicroBatchIterator

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
        from engram_train.checkpointing import save_checkpoint

        c = self.cfg.checkpoint
        return save_checkpoint(
            c.save, iteration, self.model, self.optimizer,
            extra={"consumed_samples": consumed, "scheduler": self.scheduler.state_dict()},
            run_identity=self.plan.identity, check_space=bool(c.check_free_space),
            space_estimate=self.space_estimate,
        )  # fmt: skip


def build(cfg: DictConfig, plan: Plan) -> Job:
    """Process groups, datasets, model, optimizer and LR schedule of this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.checkpointing import check_free_space, estimate_checkpoint_bytes
    from engram_train.data import build_gpt_datasets
    from engram_train.metrics import is_logging_rank
    from engram_train.models.builder import build_model
    from engram_train.runtime import initialize_distributed
    from engram_train.training.faults import ExitSignalHandler, children_die_with_parent, reap_process_group_on_exit
    from engram_train.training.optimizer import build_optimizer
    from engram_train.training.run_config import data_parallel_size, parallel_sizes

    t, s = cfg.train, cfg.system
    signals = ExitSignalHandler().install() if t.exit_signal_handler else None
    children_die_with_parent()
    reap_process_group_on_exit()
    exp_dir = Path(cfg.experiment.exp_dir)
    initialize_distributed(parallel_sizes(cfg), seed=int(t.seed), timeout_minutes=int(s.distributed_timeout_minutes))
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
    )

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
        hash_fn=plan.hash_mapping.hash_stacked if plan.hash_mapping is not None else None,
        model=model, optimizer=optimizer, scheduler=scheduler, space_estimate=space_estimate,
        signals=signals,
    )  # fmt: skip


# -- 3. resume ----------------------------------------------------------------------------------


@dataclass
class Progress:
    iteration: int = 0
    consumed: int = 0
    last_saved: int | None = None
    nonfinite_steps: int = 0
    saved: list = dataclasses.field(default_factory=list)  # iterations this run saved


def _rotate_outputs(exp_dir: Path) -> None:
    """A fresh start keeps an earlier run's metrics: they move to ``previous/<time>/``."""
    from engram_train.metrics import METRICS_FILE, TENSORBOARD_DIR

    old = [p for p in (exp_dir / METRICS_FILE, exp_dir / TENSORBOARD_DIR, exp_dir / "loss.png") if p.exists()]
    if not old:
        return
    target = exp_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    for p in old:
        shutil.move(str(p), str(target / p.name))
    log.warning("this run starts from scratch: the earlier run's outputs in %s moved to %s", exp_dir, target)


def resume(job: Job, plan: Plan) -> Progress:
    """Load the checkpoint `check` chose (after verifying its files), or start fresh."""
    import torch.distributed as dist

    from engram_train.checkpointing import iteration_dir, list_checkpoints, load_checkpoint_dir, select_checkpoint
    from engram_train.metrics import MetricsWriter

    cfg, c = job.cfg, job.cfg.checkpoint
    progress = Progress()
    if plan.resume_from is not None:
        selection = select_checkpoint(plan.resume_from, fallback=bool(c.load_fallback), checksums=bool(c.verify))
        for iteration, problems in selection.skipped:
            if job.rank == 0:
                log.warning("passing over damaged checkpoint %s:\n  %s",
                            iteration_dir(plan.resume_from, iteration), "\n  ".join(problems))  # fmt: skip
        if selection.skipped:  # `check` looked at a newer one
            check_resume(cfg, plan, selection.path, selection.manifest)
        iteration, extra = load_checkpoint_dir(
            selection.path, job.model, job.optimizer, load_engram=bool(c.load_engram)
        )
        if "scheduler" in extra:
            job.scheduler.load_state_dict(extra["scheduler"])
        progress = Progress(
            iteration=iteration,
            consumed=int(extra.get("consumed_samples", iteration * cfg.train.global_batch_size)),
            last_saved=iteration,
        )
        if job.rank == 0:
            how = "" if selection.found_by == "tracker" else " (no tracker file: the newest complete one)"
            log.info("resumed from %s%s at iteration %d (%d samples consumed)%s", selection.path, how,
                     iteration, progress.consumed,
                     "" if c.load_engram else "; Engram not loaded" + (
                         ": initialised afresh" if plan.model_config.use_engram else ""))  # fmt: skip
    elif job.rank == 0:
        if c.load:
            log.warning("checkpoint.load=%s holds no checkpoint yet: training from scratch", c.load)
        if c.save and c.overwrite:
            for i in list_checkpoints(c.save):
                shutil.rmtree(iteration_dir(c.save, i), ignore_errors=True)
            (Path(c.save) / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
    if job.rank == 0:
        job.exp_dir.mkdir(parents=True, exist_ok=True)
        if progress.iteration == 0:
            _rotate_outputs(job.exp_dir)
        (job.exp_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    dist.barrier()
    # On resume, records after the checkpoint (an abandoned continuation) are dropped.
    job.metrics = MetricsWriter(job.exp_dir, enabled=job.is_logger, resume_iteration=progress.iteration or None)
    return progress


# -- 4. train -----------------------------------------------------------------------------------


def _finite(value) -> bool:
    return value is None or math.isfinite(float(value))


def _validation_loss(job: Job) -> float | None:
    from engram_train.training.step import evaluate

    t = job.cfg.train
    if job.valid_ds is None or not t.eval_iters:
        return None
    val = job.batches(job.valid_ds, 0)
    losses = [evaluate(job.model, [next(val) for _ in range(job.num_micro)], t.seq_length, t.micro_batch_size)
              for _ in range(t.eval_iters)]  # fmt: skip
    if hasattr(val, "close"):
        val.close()
    return None if losses[0] is None else sum(losses) / len(losses)


def _retract(job: Job, progress: Progress, first_abnormal: int) -> tuple[list[str], int | None]:
    """Take this run's checkpoints from iteration ``first_abnormal - 1`` on out of service and
    point the tracker at the newest one below (divergence.py); the same answer on every rank."""
    import torch.distributed as dist

    from engram_train.checkpointing import retract_checkpoints

    save = job.cfg.checkpoint.save
    if not save:
        return [], None
    holder = [None]
    if job.rank == 0:
        holder[0] = retract_checkpoints(save, [i for i in progress.saved if i >= first_abnormal - 1],
                                        below=first_abnormal - 1)  # fmt: skip
    dist.broadcast_object_list(holder, src=0)  # every rank waits for rank 0's renames
    return holder[0]


def _nonfinite_step(job: Job, progress: Progress, result, guard) -> None:
    """Count a step whose loss or grad norm was NaN/inf; stop once the budget is spent."""
    from engram_train.checkpointing import read_tracker
    from engram_train.training.divergence import stop_message
    from engram_train.training.faults import NonFiniteTrainingError

    budget = int(job.cfg.train.nonfinite_skip_budget)
    progress.nonfinite_steps += 1
    what = f"iteration {progress.iteration}: non-finite lm loss ({result.lm_loss}) or grad norm ({result.grad_norm})"
    if progress.nonfinite_steps <= budget:
        if job.rank == 0:
            log.warning("%s: update skipped (%d of train.nonfinite_skip_budget=%d)", what,
                        progress.nonfinite_steps, budget)  # fmt: skip
        return
    stopped = (f"{what}; {progress.nonfinite_steps} such steps, more than train.nonfinite_skip_budget="
               f"{budget}. Stopped without saving")  # fmt: skip
    save = job.cfg.checkpoint.save
    if guard is not None:
        set_aside, good = _retract(job, progress, guard.first_abnormal)
        raise NonFiniteTrainingError(
            stop_message(f"{stopped}; the parameters were not updated by these steps (raise "
                         "train.nonfinite_skip_budget to skip more such steps).",
                         guard.first_abnormal, set_aside, good, save, job.cfg)  # fmt: skip
        )
    latest = read_tracker(save) if save else None
    newest = f"the newest checkpoint is iteration {latest} in {save}" if latest is not None else "no checkpoint exists"
    raise NonFiniteTrainingError(
        f"{stopped} ({newest}); the parameters were not updated by these "
        "steps. Resume from the checkpoint once the cause is found (a lower train.lr, the data), "
        "or raise train.nonfinite_skip_budget to skip more such steps"
    )


def _diverged(job: Job, progress: Progress, guard, verdict) -> None:
    """The guard saw a loss spike or a collapsed model: set checkpoints aside and stop."""
    from engram_train.training.divergence import DivergenceError, stop_message

    set_aside, good = _retract(job, progress, guard.first_abnormal)
    raise DivergenceError(stop_message(
        f"training diverged at iteration {progress.iteration}: {verdict.reason}. Stopped without saving.",
        guard.first_abnormal, set_aside, good, job.cfg.checkpoint.save, job.cfg,
    ))  # fmt: skip


def train(job: Job, progress: Progress) -> dict:
    """The optimizer steps, logging, evaluation and checkpoints; returns the last record."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    from engram_train.logs import console
    from engram_train.metrics import format_eval_line, format_log_line
    from engram_train.training.divergence import SUSPECT, guard_from_config
    from engram_train.training.engram_timing import EngramStepTimes
    from engram_train.training.faults import SkipNonFiniteUpdate, StopCheck
    from engram_train.training.step import train_step

    t, c = job.cfg.train, job.cfg.checkpoint
    stop_check = StopCheck(job.signals, t.exit_duration_in_mins)
    guarded = SkipNonFiniteUpdate(job.optimizer)
    guard = guard_from_config(job.cfg, job.plan.vocab_size)  # None: train.divergence_guard=false
    verdict = None
    train_iter = job.batches(job.train_ds, progress.consumed)
    engram_times = EngramStepTimes(train_iter) if job.hash_fn is not None else None
    tokens_per_step = t.global_batch_size * t.seq_length
    last: dict = {}
    window_start, window_steps = time.perf_counter(), 0
    try:
        while progress.iteration < t.train_iters:
            microbatches = [next(train_iter) for _ in range(job.num_micro)]
            result = train_step(job.model, guarded, microbatches, t.seq_length, t.micro_batch_size, job.scheduler)
            progress.iteration += 1
            progress.consumed += t.global_batch_size
            window_steps += 1
            stop = stop_check(nonfinite=guarded.skipped_nonfinite or not _finite(result.lm_loss), loss=result.lm_loss)
            # The loss judges the weights of the previous iteration (divergence.py).
            verdict = guard.observe(progress.iteration, stop.loss, result.grad_norm) if guard else None
            diverged = verdict is not None and verdict.stop
            abnormal = stop.nonfinite or (verdict is not None and verdict.abnormal)
            final = progress.iteration == t.train_iters
            log_now = (bool(t.log_interval) and progress.iteration % t.log_interval == 0) or final or stop.exit
            eval_now = bool(t.eval_interval) and (progress.iteration % t.eval_interval == 0 or final)
            if log_now or eval_now or abnormal:
                step_time = (time.perf_counter() - window_start) / window_steps
                engram = engram_times.window(window_steps) if engram_times else {}
                window_start, window_steps = time.perf_counter(), 0
                record = dict(
                    lm_loss=result.lm_loss, lr=get_canonical_lr_for_logging(job.optimizer.param_groups),
                    grad_norm=result.grad_norm, tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
                    **engram,
                )  # fmt: skip
                if eval_now and not abnormal:
                    record["val_loss"] = _validation_loss(job)
                if job.is_logger:
                    console(format_log_line(
                        iteration=progress.iteration, train_iters=t.train_iters, consumed_samples=progress.consumed,
                        step_time_s=step_time, lr=record["lr"], global_batch_size=t.global_batch_size,
                        losses={"lm loss": result.lm_loss}, tokens_per_s=record["tokens_per_s"],
                        grad_norm=result.grad_norm,
                        extra={"engram wait (ms)": engram["engram_wait_s"] * 1000} if engram else None,
                    ))  # fmt: skip
                    if record.get("val_loss") is not None:
                        console(format_eval_line(progress.iteration, {"lm loss": record["val_loss"]}))
                    last = job.metrics.log(progress.iteration, **record) or {}
            if stop.nonfinite:
                _nonfinite_step(job, progress, result, guard)
            if diverged:
                _diverged(job, progress, guard, verdict)
            # An abnormal step is never checkpointed: a non-finite one (its update was skipped;
            # the state is the previous iteration's), or one the guard suspects.
            due = (c.save_interval and progress.iteration % c.save_interval == 0) or stop.exit
            if c.save and due and abnormal and verdict is not None and verdict.kind == SUSPECT and job.rank == 0:
                log.warning("iteration %d: %s; not saved until a normal loss follows", progress.iteration,
                            verdict.reason)  # fmt: skip
            if c.save and due and not abnormal:
                job.save(progress.iteration, progress.consumed)
                progress.last_saved = progress.iteration
                progress.saved.append(progress.iteration)
            if stop.exit:
                reason = f"received {job.signals.received}" if stop.signal else "train.exit_duration_in_mins reached"
                if progress.last_saved == progress.iteration:
                    saved = f"saved iteration {progress.iteration} to {c.save}"
                elif c.save:
                    saved = f"this step was abnormal: nothing saved (newest: iteration {progress.last_saved})"
                else:
                    saved = "checkpoint.save is not set: nothing saved"
                if job.rank == 0:
                    log.warning("%s: %s; exiting", reason, saved)
                break
        if c.save and progress.last_saved != progress.iteration and not stop.exit and not abnormal:
            job.save(progress.iteration, progress.consumed)
            progress.last_saved = progress.iteration
            progress.saved.append(progress.iteration)
    finally:
        if hasattr(train_iter, "close"):
            train_iter.close()
        job.metrics.close()
        if job.signals is not None:
            job.signals.restore()
    return last


# -- 5. finish ----------------------------------------------------------------------------------


def finish(job: Job, plot: bool = True) -> None:
    """Loss plot on the logging rank (a failure is a warning: training is done), then shutdown."""
    from engram_train.logs import console
    from engram_train.runtime import destroy_distributed

    if job.is_logger and plot:
        try:
            from engram_train.plot import plot_runs

            png = plot_runs([job.exp_dir], job.exp_dir / "loss.png")
            console(f"loss curve written to {png}")
        except Exception as e:  # the run's results are saved; a plot must not fail it
            log.warning("loss plot skipped: %s: %s", type(e).__name__, e)
    destroy_distributed()


def _exit_with_message(message: str) -> None:
    """Exit with code 1 after printing ``message`` once per node, without a traceback.

    A config or input error is raised identically on every rank: the node's first rank
    (LOCAL_RANK 0, or a process started without torchrun) prints it; the other ranks wait a
    moment before exiting, so that torchrun, which stops the remaining workers as soon as one
    exits, does not stop the printing rank first. (torchrun then reports the failed workers
    in its own summary.)
    """
    if os.environ.get("LOCAL_RANK", "0") == "0":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # every rank raised it; this one reports
            message += f"\n(reported by rank {os.environ.get('RANK', '0')} of {world})"
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    raise SystemExit(1)


# The project's own errors, by module and class. Looked up in sys.modules after the fact, so that
# `main` imports none of these modules (megatron's checkpointing among them) before the config
# is validated.
CONFIG_ERRORS = (
    ("engram_train.training.run_config", "ConfigError"),
    ("engram_train.engram.compressed_tokenizer", "TokenizerNotFoundError"),
)
RUN_ERRORS = (
    ("engram_train.training.run_identity", "ResumeMismatchError"),
    ("engram_train.checkpointing", "CheckpointError"),
    ("engram_train.training.faults", "NonFiniteTrainingError"),
    ("engram_train.training.divergence", "DivergenceError"),
    ("engram_train.runtime.patches", "UntestedMegatronCoreError"),
)


def _is_one_of(error: BaseException, classes) -> bool:
    for module, name in classes:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    """Errors the project raises on purpose (bad config or input, a refused checkpoint, a
    diverged run) end with their message and exit code 1; anything else keeps its traceback."""
    try:
        run(cfg)
    except Exception as e:
        if _is_one_of(e, CONFIG_ERRORS):
            _exit_with_message(f"engram-train: invalid configuration: {e}")
        if _is_one_of(e, RUN_ERRORS):
            _exit_with_message(f"engram-train: {e}")
        raise


if __name__ == "__main__":
    main()
