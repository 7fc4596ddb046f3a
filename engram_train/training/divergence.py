"""The divergence guard: a run that blows up stops before its next save, and no checkpoint whose
weights produced an abnormal loss stays ``latest``.

Each iteration's LM loss and global gradient norm are judged (the same values on every rank):

- **spike**: a finite loss more than ``train.divergence_spike_factor`` (10) times the largest
  of the last ``train.divergence_window`` (100) losses. This is megatron's spiky-loss rule
  (``RerunStateMachine.is_unexpectedly_large`` with Megatron-LM's factor of 10), over a
  sliding window: megatron's own helper takes its maximum over the first 100 values of a run
  and flags nothing before them, which would miss a run that diverges at iteration 3;
- **collapse**: the gradient norm exactly 0 for ``train.divergence_collapse_steps`` (2)
  consecutive steps while the loss sits at ln(vocabulary), i.e. the model predicts the uniform
  distribution and nothing can train it any more;
- **non-finite** loss or gradient norm (counted against ``train.nonfinite_skip_budget`` by
  the trainer, as before).

Which weights a loss judges: the loss logged at iteration i is computed with the weights saved
after iteration i-1, so checkpoint ``iter_{i-1}`` is vouched for only by a normal loss at
iteration i. When the guard stops a run, the first abnormal iteration a is the start of the
streak of abnormal iterations that ended it; every checkpoint this run saved at an iteration
>= a-1 is renamed ``iter_N.diverged`` (kept for inspection, never loaded) and the tracker
names the newest checkpoint below a-1 (or is removed when there is none). Iterations that are
suspect but not yet conclusive (a zero gradient norm at ln(vocabulary), a skipped non-finite
step) are not saved.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engram_train.config import TrainConfig
from engram_train.errors import EngramError

# The schema's defaults (engram_train/config/run.py); the spike factor is Megatron-LM's
# (megatron/training/training.py: "spiky loss" check).
SPIKE_FACTOR = TrainConfig.divergence_spike_factor
SPIKE_WINDOW = TrainConfig.divergence_window
COLLAPSE_STEPS = TrainConfig.divergence_collapse_steps
# |loss - ln(V)| within this fraction of ln(V) counts as "at ln(vocabulary)".
UNIFORM_LOSS_RTOL = 1e-3

OK, SUSPECT, SPIKE, COLLAPSE, NONFINITE = "ok", "suspect", "spike", "collapse", "non-finite"


class DivergenceError(EngramError, RuntimeError):
    """The guard stopped the run; the message names the iteration, the good checkpoint and the fix."""


@dataclass
class Verdict:
    kind: str  # OK, SUSPECT, SPIKE, COLLAPSE or NONFINITE
    reason: str = ""

    @property
    def abnormal(self) -> bool:
        return self.kind != OK

    @property
    def stop(self) -> bool:
        return self.kind in (SPIKE, COLLAPSE)


@dataclass
class DivergenceGuard:
    """Judges (loss, grad norm) per iteration; remembers where the current abnormal streak began."""

    vocab_size: int
    spike_factor: float = SPIKE_FACTOR
    window: int = SPIKE_WINDOW
    collapse_steps: int = COLLAPSE_STEPS
    recent: deque = field(default_factory=deque, repr=False)
    zero_grad_streak: int = 0
    first_abnormal: int | None = None  # first iteration of the current abnormal streak

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)
        self.uniform_loss = math.log(self.vocab_size)

    def _at_uniform(self, loss: float) -> bool:
        return abs(loss - self.uniform_loss) <= UNIFORM_LOSS_RTOL * self.uniform_loss

    def observe(self, iteration: int, loss: float | None, grad_norm: float | None) -> Verdict:
        """The verdict on iteration `iteration`'s loss (None: not computed) and grad norm."""
        verdict = self._judge(loss, grad_norm)
        if verdict.abnormal:
            if self.first_abnormal is None:
                self.first_abnormal = iteration
        else:
            self.first_abnormal = None
            if loss is not None:
                self.recent.append(float(loss))
        return verdict

    def _judge(self, loss, grad_norm) -> Verdict:
        if (loss is not None and not math.isfinite(loss)) or (grad_norm is not None and not math.isfinite(grad_norm)):
            self.zero_grad_streak = 0
            return Verdict(NONFINITE, f"non-finite lm loss ({loss}) or grad norm ({grad_norm})")
        if loss is None:
            return Verdict(OK)
        if self.recent and loss > self.spike_factor * max(self.recent):
            self.zero_grad_streak = 0
            return Verdict(SPIKE, (
                f"lm loss {loss:.6g} is more than train.divergence_spike_factor={self.spike_factor:g} "
                f"times the largest of the last {len(self.recent)} losses ({max(self.recent):.6g})"
            ))  # fmt: skip
        if grad_norm == 0.0 and self._at_uniform(loss):
            self.zero_grad_streak += 1
            at = f"lm loss {loss:.6g} = ln({self.vocab_size})"
            if self.zero_grad_streak < self.collapse_steps:
                return Verdict(SUSPECT, (
                    f"grad norm exactly 0 at {at}, a collapsed model if it lasts "
                    f"train.divergence_collapse_steps={self.collapse_steps} steps"
                ))  # fmt: skip
            return Verdict(COLLAPSE, (
                f"grad norm exactly 0 for {self.zero_grad_streak} consecutive steps at {at}: the model "
                "has collapsed to the uniform distribution and cannot learn any more"
            ))  # fmt: skip
        self.zero_grad_streak = 0
        return Verdict(OK)


def guard_from_config(cfg, vocab_size: int) -> DivergenceGuard | None:
    """The guard ``train.divergence_*`` configure (None when ``train.divergence_guard`` is
    false); the values were validated with the run config (``training/run_config.py``)."""
    t = cfg.train
    if not t.divergence_guard:
        return None
    return DivergenceGuard(int(vocab_size), float(t.divergence_spike_factor), t.divergence_window,
                           t.divergence_collapse_steps)


def advice(cfg) -> str:
    """What to change, with this run's values."""
    t = cfg.train
    return (
        f"Lower train.lr (now {t.lr:g}), lengthen train.lr_warmup_iters (now {t.lr_warmup_iters}) or "
        f"tighten train.clip_grad (now {t.clip_grad:g}), then resume from the good checkpoint or start "
        "afresh; train.divergence_guard=false turns this check off (for experiments)"
    )


def stop_message(what: str, first_abnormal: int, set_aside: list[str], good: int | None,
                 save: str | None, cfg) -> str:
    """The guard's stop message (`set_aside`: checkpoint folders renamed ``*.diverged``)."""
    lines = [what, f"The first abnormal iteration is {first_abnormal}; its loss was computed with the "
             f"weights of iteration {first_abnormal - 1}, so no checkpoint from iteration "
             f"{first_abnormal - 1} on is trusted."]  # fmt: skip
    if set_aside:
        lines.append(f"Set aside (renamed *.diverged, never loaded): {', '.join(set_aside)}.")
    if not save:
        lines.append("checkpoint.save is not set: nothing was saved.")
    elif good is None:
        lines.append(f"No checkpoint in {save} was vouched for by a normal loss; "
                     f"{'the tracker was removed' if set_aside else 'none is marked latest'}.")  # fmt: skip
    else:
        lines.append(f"The newest good checkpoint is iteration {good} in {save} (now the latest): "
                     f"resume with checkpoint.load={save}.")  # fmt: skip
    lines.append(advice(cfg))
    return "\n".join(lines)
