"""Stage 4 of a run, ``train``: the optimizer steps, with Megatron-style logging, evaluation,
checkpoints, the divergence guard, and a clean exit on SIGTERM, on the wall-clock limit or on
non-finite steps; then ``finish``: the loss plot (never fails the run) and shutdown."""

from __future__ import annotations

import logging
import math
import sys
import time

import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

from engram_train.checkpoint.layout import read_tracker, retract_checkpoints
from engram_train.logs import console
from engram_train.metrics import format_eval_line, format_log_line
from engram_train.plot import plot_runs
from engram_train.runtime import destroy_distributed
from engram_train.training.divergence import SUSPECT, DivergenceError, guard_from_config, stop_message
from engram_train.training.engram_timing import EngramStepTimes
from engram_train.training.faults import NonFiniteTrainingError, SkipNonFiniteUpdate, StopCheck
from engram_train.training.host_update import HostUpdateError, finish_overlapped_updates, overlapping_parts
from engram_train.training.job import Job
from engram_train.training.resume import Progress
from engram_train.training.step import evaluate, train_step

log = logging.getLogger("engram_train")


def _finite(value) -> bool:
    return value is None or math.isfinite(float(value))


def _validation_loss(job: Job) -> float | None:
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
    set_aside, good = _retract(job, progress, guard.first_abnormal)
    raise DivergenceError(stop_message(
        f"training diverged at iteration {progress.iteration}: {verdict.reason}. Stopped without saving.",
        guard.first_abnormal, set_aside, good, job.cfg.checkpoint.save, job.cfg,
    ))  # fmt: skip


class _Window:
    """The steps since the last log line: their wall time, and Engram's share of it."""

    def __init__(self, engram_times) -> None:
        self.engram_times = engram_times
        self.start, self.steps = time.perf_counter(), 0

    def close(self) -> tuple[float, dict]:
        """(mean step time, Engram's timing record) of the window; a new window starts."""
        step_time = (time.perf_counter() - self.start) / self.steps
        engram = self.engram_times.window(self.steps) if self.engram_times else {}
        self.start, self.steps = time.perf_counter(), 0
        return step_time, engram


def _log(job: Job, progress: Progress, result, window: _Window, evaluate_now: bool) -> dict:
    """One iteration line (and a validation line) on the logging rank; the metrics record."""
    t = job.cfg.train
    step_time, engram = window.close()
    record = dict(
        lm_loss=result.lm_loss, lr=get_canonical_lr_for_logging(job.optimizer.param_groups),
        grad_norm=result.grad_norm, tokens_per_s=t.global_batch_size * t.seq_length / step_time,
        step_time_s=step_time, **engram,
    )  # fmt: skip
    if evaluate_now:
        record["val_loss"] = _validation_loss(job)
    if not job.is_logger:
        return {}
    console(format_log_line(
        iteration=progress.iteration, train_iters=t.train_iters, consumed_samples=progress.consumed,
        step_time_s=step_time, lr=record["lr"], global_batch_size=t.global_batch_size,
        losses={"lm loss": result.lm_loss}, tokens_per_s=record["tokens_per_s"],
        grad_norm=result.grad_norm,
        extra={"engram wait (ms)": engram["engram_wait_s"] * 1000} if engram else None,
    ))  # fmt: skip
    if record.get("val_loss") is not None:
        console(format_eval_line(progress.iteration, {"lm loss": record["val_loss"]}))
    return job.metrics.log(progress.iteration, **record) or {}


def _save(job: Job, progress: Progress) -> None:
    job.save(progress.iteration, progress.consumed)
    progress.last_saved = progress.iteration
    progress.saved.append(progress.iteration)


def _save_if_due(job: Job, progress: Progress, stop, abnormal: bool, verdict) -> None:
    """Save at ``checkpoint.save_interval`` and before an exit; an abnormal step is never
    checkpointed: a non-finite one (its update was skipped; the state is the previous
    iteration's), or one the divergence guard suspects."""
    c = job.cfg.checkpoint
    due = (c.save_interval and progress.iteration % c.save_interval == 0) or stop.exit
    if not (c.save and due):
        return
    if not abnormal:
        _save(job, progress)
    elif verdict is not None and verdict.kind == SUSPECT and job.rank == 0:
        log.warning("iteration %d: %s; not saved until a normal loss follows", progress.iteration,
                    verdict.reason)  # fmt: skip


def _say_exit(job: Job, progress: Progress, stop) -> None:
    """Why the run stops early (signal or wall clock), and what was saved."""
    c = job.cfg.checkpoint
    reason = f"received {job.signals.received}" if stop.signal else "train.exit_duration_in_mins reached"
    if progress.last_saved == progress.iteration:
        saved = f"saved iteration {progress.iteration} to {c.save}"
    elif c.save:
        saved = f"this step was abnormal: nothing saved (newest: iteration {progress.last_saved})"
    else:
        saved = "checkpoint.save is not set: nothing saved"
    if job.rank == 0:
        log.warning("%s: %s; exiting", reason, saved)


def train(job: Job, progress: Progress) -> dict:
    """The optimizer steps, logging, evaluation and checkpoints; returns the last record."""
    t, c = job.cfg.train, job.cfg.checkpoint
    stop_check = StopCheck(job.signals, t.exit_duration_in_mins)
    guarded = SkipNonFiniteUpdate(job.optimizer)
    guard = guard_from_config(job.cfg, job.plan.vocab_size)  # None: train.divergence_guard=false
    train_iter = job.batches(job.train_ds, progress.consumed)
    window = _Window(EngramStepTimes(train_iter) if job.hash_fn is not None else None)
    last: dict = {}
    stop, abnormal = None, False
    # An overlapped host table update changes the rows the next step reads first: it needs
    # that step's micro-batches (hash ids included) before this step's optimizer step.
    look_ahead = bool(overlapping_parts(job.optimizer))
    upcoming = None
    try:
        while progress.iteration < t.train_iters:
            microbatches = upcoming or [next(train_iter) for _ in range(job.num_micro)]
            upcoming = None
            if look_ahead and progress.iteration + 1 < t.train_iters:
                upcoming = [next(train_iter) for _ in range(job.num_micro)]
            result = train_step(job.model, guarded, microbatches, t.seq_length, t.micro_batch_size,
                                job.scheduler, next_microbatches=upcoming)
            progress.iteration += 1
            progress.consumed += t.global_batch_size
            window.steps += 1
            stop = stop_check(nonfinite=guarded.skipped_nonfinite or not _finite(result.lm_loss), loss=result.lm_loss)
            # The loss judges the weights of the previous iteration (divergence.py).
            verdict = guard.observe(progress.iteration, stop.loss, result.grad_norm) if guard else None
            abnormal = stop.nonfinite or (verdict is not None and verdict.abnormal)
            final = progress.iteration == t.train_iters
            log_now = (bool(t.log_interval) and progress.iteration % t.log_interval == 0) or final or stop.exit
            eval_now = bool(t.eval_interval) and (progress.iteration % t.eval_interval == 0 or final)
            if log_now or eval_now or abnormal:
                last = _log(job, progress, result, window, eval_now and not abnormal) or last
            if stop.nonfinite:
                _nonfinite_step(job, progress, result, guard)
            if verdict is not None and verdict.stop:
                _diverged(job, progress, guard, verdict)
            _save_if_due(job, progress, stop, abnormal, verdict)
            if stop.exit:
                _say_exit(job, progress, stop)
                break
        finish_overlapped_updates(job.optimizer)  # the last step's table update: its error too
        if c.save and progress.last_saved != progress.iteration and not (stop and stop.exit) and not abnormal:
            _save(job, progress)
    except HostUpdateError as e:
        # Raised on this rank only (its host thread failed), before its next collective: it
        # says so itself and exits; torchrun then stops the ranks waiting for it.
        print(f"engram-train: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if hasattr(train_iter, "close"):
            train_iter.close()
        job.metrics.close()
        if job.signals is not None:
            job.signals.restore()
    return last


def finish(job: Job, plot: bool = True) -> None:
    """Loss plot on the logging rank (a failure is a warning: training is done), then shutdown."""
    if job.is_logger and plot:
        try:
            png = plot_runs([job.exp_dir], job.exp_dir / "loss.png")
            console(f"loss curve written to {png}")
        except Exception as e:  # the run's results are saved; a plot must not fail it
            log.warning("loss plot skipped: %s: %s", type(e).__name__, e)
    destroy_distributed()
